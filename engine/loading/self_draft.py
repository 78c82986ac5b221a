"""The self-draft: a draft made from the target's own weights at first load (SubSpec, NeurIPS
2025), so that no draft model has to be chosen or downloaded.

The target's resident layers serve the draft as they are (they cost no transfer). Each
offloaded layer, which the target streams over the link every pass, gets a low-bit substitute
(2-4 bits, group-wise: engine.offload.lowbit) kept on the device, de-quantised as the draft runs
it. The draft shares the target's embedding, final norm, head and rotary tables, has the same
cache shapes, and so reads the target's K/V of the committed text (drafting.share_context):
its only error is the substitutes' rounding.

The bits are chosen by the caller (`fitting_bits`: the widest that fits in what the target's
resident layers and caches leave). A 3-bit self-draft keeps the attention's value projection at
4 bits in groups of 64 (entry_bits, entry_group): on the starter (groups of 32 with byte (s, m),
lowbit.py) that cut the KL to the target on held-out chat from 0.33 to 0.31 nats a token (0.30
in groups of 32, 0.27 with the key projection at 4 bits too, either of which would take the draft
past 80 % of the FP4 proxy's memory: 3.6 bits a weight).

Given the target's tokenizer, the substitutes are activation-aware (engine.offload.calibrate):
the target runs once over a built-in text of ~500 tokens, each Linear's inputs are kept, and
each weight's columns are scaled by its inputs' magnitudes before quantising (the `#cscale`
side entry; all ones without a tokenizer), and each group's scale and offset are fitted to
the error weighed by its columns' input energy, from the range and two clipped starts. On the
starter at 3 bits these take the KL divergence to the target from 2.30 to 0.42 nats a token on
held-out chat answers with groups of 64, and groups of 32 with byte (s, m) to 0.29 (the FP4
proxy: 0.49).

Substitutes are cached on disk, in one safetensors file keyed by the target's fingerprint, the
bits, the substituted layers, the calibration text and this module's format (FORMAT: version 2
added the column scales, the 3-bit levels and the wider key/value projections, version 3 the
weighted, clipped group fit, version 4 groups of 32 with byte (s, m) and only the value
projection wider, so an older file is never read): a changed target gets a new key, and a file whose header or sizes do not
match is deleted and rebuilt. (The codes are not checksummed: a damaged code makes worse drafts,
never wrong text, since every token is verified by the target.)

On a CPU the same construction runs when the target's layers are offloaded (`--offload all`);
with nothing offloaded the self-draft would be the target itself, and is refused.

What this module does not do: decide whether a self-draft pays (engine.decoding.draft_choice)
or quantise (engine.offload.lowbit).
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.errors import UsageError
from engine.loading.materialise import layer_template
from engine.model.causal_lm import CausalLM
from engine.offload import calibrate, lowbit
from engine.offload.layout import Entry, LayerLayout
from engine.offload.streamer import LayerHome, LayerStreamer
from engine.offload.unpack import Unpacker
from engine.shapes import Placement
from engine.types import Tokenizer

log = logging.getLogger(__name__)

SELF_DRAFT_BITS = (4, 3, 2)  # widest first
FORMAT = "specchat-self-draft-4"
WIDER = ("v_proj",)  # one bit wider in a 3-bit self-draft (entry_bits), in groups of WIDER_GROUP
WIDER_GROUP = 64
Report = Callable[[float, str], None]


@dataclass(frozen=True)
class SelfDraftInfo:
    bits: int
    substituted: int  # target layers with a low-bit substitute
    resident: int  # target layers the draft runs as they are
    nbytes: int  # the substitutes' device bytes (the draft's own memory; the rest is the target's)
    cached: bool  # read from the disk cache rather than quantised now

    @property
    def label(self) -> str:
        n = self.substituted + self.resident
        return f"self-draft, {self.bits}-bit ({self.substituted} of {n} layers)"


def offloaded_layers(target: CausalLM) -> list[int]:
    """The target's layers that are not resident on its device (streamed from RAM or disk)."""
    if target.streamer is None:
        return []
    return [i for i, h in enumerate(target.streamer.homes) if h.store_index is not None]


def _layouts(target: CausalLM, bits: int) -> list[LayerLayout]:
    """The low-bit layout of every layer (the resident ones' are only their kind's key)."""
    make = layer_template(target.hf_model)
    out: list[LayerLayout] = []
    by_params: dict[tuple, LayerLayout] = {}
    for i in range(target.shape.num_layers):
        names = tuple((n, tuple(p.shape)) for n, p in make(i).named_parameters())
        if names not in by_params:
            by_params[names] = _layout(names, target.dtype, bits)
        out.append(by_params[names])
    return out


def entry_bits(name: str, bits: int) -> int:
    """The width of one weight in a `bits` self-draft: at 3 bits the attention's value
    projection (WIDER: with the key projection a GQA model's smallest matrices, and on the
    starter the one whose rounding costs the most KL per bit) takes 4; everything else `bits`."""
    module = name.rsplit(".", 2)[-2] if name.count(".") >= 1 else name
    return bits + 1 if bits == 3 and module in WIDER else bits


ROUTERS = ("gate", "router", "shared_expert_gate")  # an MoE's routing matrices: kept as the target has them


def _router(name: str) -> bool:
    """An MoE router's weight ("mlp.gate.weight"; not "mlp.gate_proj.weight"): a few thousandths
    of the layer's parameters, and its rounding would send tokens to other experts than the
    target's, so it stays dense."""
    parts = name.split(".")
    return len(parts) >= 2 and parts[-2] in ROUTERS


def entry_group(name: str, shape: tuple[int, ...], bits: int) -> int | None:
    """The group size of one weight in a `bits` self-draft (None: it stays dense): lowbit's,
    but 64 for a wider entry (entry_bits) whose rows it divides: its fourth bit gains more than
    groups of 32 would, which would take the draft past 3.6 bits a weight."""
    group = lowbit.group_of(shape)
    if group is not None and entry_bits(name, bits) > bits and shape[-1] % WIDER_GROUP == 0:
        return WIDER_GROUP
    return group


def _layout(params: tuple[tuple[str, tuple[int, ...]], ...], dtype: torch.dtype, bits: int) -> LayerLayout:
    esize = torch.empty((), dtype=dtype).element_size()
    entries: list[Entry] = []
    for name, shape in params:
        numel = 1
        for s in shape:
            numel *= s
        group = entry_group(name, shape, bits)
        if group is None or _router(name):
            entries.append(Entry(name, "dense", shape, dtype, 0, numel * esize))
            continue
        width = entry_bits(name, bits)
        entries.append(Entry(name, "lowbit", shape, torch.uint8, 0, lowbit.packed_nbytes(numel, width), qtype=width))
        entries.append(Entry(name + "#scale", "side", (numel // group,), torch.uint8, 0, numel // group))
        entries.append(Entry(name + "#min", "side", (numel // group,), torch.int8, 0, numel // group))
        entries.append(Entry(name + "#rows", "side", (numel // shape[-1], 2), torch.float16, 0, numel // shape[-1] * 4))
        entries.append(Entry(name + "#cscale", "side", (shape[-1],), torch.float16, 0, shape[-1] * 2))
    return LayerLayout.packed(entries, dtype, "lowbit")


def substitute_bytes(target: CausalLM, bits: int) -> int:
    """Device bytes the low-bit substitutes of the target's offloaded layers take, with the one
    dense buffer the draft de-quantises a layer into."""
    layers = offloaded_layers(target)
    if not layers:
        return 0
    layouts = _layouts(target, bits)
    return sum(layouts[i].nbytes for i in layers) + max(layouts[i].dense_nbytes for i in layers)


def fitting_bits(target: CausalLM, free_bytes: int) -> int | None:
    """The widest of SELF_DRAFT_BITS whose substitutes fit in `free_bytes`, or None."""
    return next((b for b in SELF_DRAFT_BITS if substitute_bytes(target, b) <= free_bytes), None)


def cache_key(target: CausalLM, bits: int, layers: list[int], calibration: list[int] | None = None) -> str:
    """The disk cache's key: what the substitutes depend on ("" = not cached: no fingerprint)."""
    if not target.fingerprint:
        return ""
    calib = "none" if calibration is None else hashlib.sha256(str(calibration).encode()).hexdigest()[:16]
    text = (f"{FORMAT}|{target.fingerprint}|{bits}|{lowbit.GROUPS}|{lowbit.FIT_ROUNDS}|{layers}|{calib}|"
            f"{calibrate.ALPHAS}|{calibrate.MAX_ROWS}|{lowbit.NF_BITS}|{WIDER}|{WIDER_GROUP}")
    return hashlib.sha256(text.encode()).hexdigest()[:32]


@torch.inference_mode()
def build_self_draft(target: CausalLM, bits: int, cache_dir: Path | None = None,
                     report: Report | None = None, tokenizer: Tokenizer | None = None) -> CausalLM:
    """The self-draft of a loaded target (see the module docstring), `bits` wide; with the
    target's tokenizer, its weights are scaled by their inputs on a built-in text (calibrate.py).
    Raises UsageError when nothing of the target is offloaded."""
    if bits not in SELF_DRAFT_BITS:
        raise UsageError(f"a self-draft takes {', '.join(map(str, sorted(SELF_DRAFT_BITS)))} bits, not {bits}")
    layers = offloaded_layers(target)
    if not layers:
        raise UsageError(
            f"the self-draft replaces the target's offloaded layers, and none is offloaded: the whole target runs on "
            f"{target.device.type}, so a self-draft would cost as much as the target. Decode without a draft "
            f"(--draft none), or offload layers (--offload all) to try it.")
    assert target.streamer is not None
    device = target.device
    layouts = _layouts(target, bits)
    calibration = calibrate.calibration_ids(tokenizer) if tokenizer is not None else None
    key = cache_key(target, bits, layers, calibration)
    path = cache_dir / f"{key}.safetensors" if cache_dir is not None and key else None
    bufs = _read_cache(path, key, layers, layouts, device) if path is not None else None
    cached = bufs is not None
    if bufs is None:
        inputs = calibrate.collect_inputs(target, calibration, layers) if calibration else {}
        bufs = _quantise(target, layers, layouts, bits, inputs, report)
        if path is not None:
            _write_cache(path, key, bits, layers, bufs)
    # resident layers run as the target runs them: its modules, or its packed device buffers (NF4
    # on a GPU) with the target's layouts
    homes = [LayerHome(packed=bufs[i]) if i in bufs else target.streamer.homes[i] for i in range(len(layouts))]
    layouts = [target.streamer.layouts[i] if homes[i].packed is not None and i not in bufs else layouts[i]
               for i in range(len(layouts))]  # (a module's layout only names its kind; the first decides unpacking)
    streamer = LayerStreamer(homes, layouts, None, layer_template(target.hf_model), device, 0)
    n = len(homes)
    placement = Placement(n, n, 0, 0, max(layouts[i].nbytes for i in layers), "lowbit", str(device))
    fingerprint = f"{target.fingerprint}+self{bits}" if target.fingerprint else ""
    draft = CausalLM(target.hf_model, streamer=streamer, placement=placement, fingerprint=fingerprint)
    nbytes = sum(int(b.numel()) for b in bufs.values()) + streamer.dense_layout.nbytes
    draft.self_draft = SelfDraftInfo(bits, len(layers), n - len(layers), nbytes, cached)  # type: ignore[attr-defined]
    log.info("%s: %.1f MiB on %s%s", draft.self_draft.label, nbytes / 2**20,  # type: ignore[attr-defined]
             device.type, " (from the disk cache)" if cached else "")
    return draft


def _quantise(target: CausalLM, layers: list[int], layouts: list[LayerLayout], bits: int,
              inputs: dict[int, dict[str, torch.Tensor]], report: Report | None) -> dict[int, torch.Tensor]:
    """Each offloaded layer, de-quantised from the target's host store on its device and
    re-quantised to `bits` there (on a GPU, where there is one), scaled by its Linears' inputs
    where `inputs` has them."""
    streamer = target.streamer
    assert streamer is not None and streamer.store is not None
    device = target.device
    unpack = Unpacker(device)
    out: dict[int, torch.Tensor] = {}
    for n, i in enumerate(layers):
        if report is not None:
            report(n / len(layers), f"making the {bits}-bit self-draft: layer {n + 1} of {len(layers)}")
        home = streamer.homes[i]
        assert home.store_index is not None
        src = streamer.store.source(home.store_index).to(device)
        layout = streamer.layouts[i]
        dense_layout = layout.dense_layout()
        if layout.quant == "none":
            params = layout.params(src)
        else:
            params = dense_layout.params(torch.empty(dense_layout.nbytes, dtype=torch.uint8, device=device))
            unpack(layout, src, params)
        out[i] = _pack_layer(layouts[i], params, inputs.get(i, {}), device)
    return out


def _pack_layer(layout: LayerLayout, params: dict[str, torch.Tensor], inputs: dict[str, torch.Tensor],
                device: torch.device) -> torch.Tensor:
    buf = torch.empty(layout.nbytes, dtype=torch.uint8, device=device)
    by_name = {e.name: e for e in layout.entries}
    for e in layout.entries:
        if e.side:
            continue
        value = params[e.name]
        if e.kind == "dense":
            layout.view(buf, e).copy_(value.reshape(e.shape))
            continue
        group = value.numel() // by_name[e.name + "#scale"].shape[0]  # the layout's (entry_group)
        x = inputs.get(e.name)
        if x is not None and value.dim() in (2, 3) and x.shape[-1] == value.shape[-1]:
            # an MoE's fused gate/up (E, 2I, H): one column scale for all experts' rows, from
            # every token's input (each expert takes a share of them)
            codes, scale, offset, rows, cscale = calibrate.quantise_aware(value.reshape(-1, value.shape[-1]), x,
                                                                          e.qtype, group)
        else:  # no inputs seen (no tokenizer; an MoE's fused down projection, whose inputs are
            # each expert's own): unscaled columns
            codes, scale, offset, rows = lowbit.quantize(value, e.qtype, group)
            cscale = torch.ones(e.shape[-1], dtype=torch.float16, device=device)
        layout.view(buf, e).copy_(codes)
        layout.view(buf, by_name[e.name + "#scale"]).copy_(scale)
        layout.view(buf, by_name[e.name + "#min"]).copy_(offset)
        layout.view(buf, by_name[e.name + "#rows"]).copy_(rows)
        layout.view(buf, by_name[e.name + "#cscale"]).copy_(cscale)
    return buf


def _read_cache(path: Path, key: str, layers: list[int], layouts: list[LayerLayout],
                device: torch.device) -> dict[int, torch.Tensor] | None:
    """The substitutes saved under `key`, or None (missing; damaged: deleted)."""
    if not path.is_file():
        return None
    from safetensors import SafetensorError, safe_open

    try:
        out: dict[int, torch.Tensor] = {}
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            if meta.get("format") != FORMAT or meta.get("key") != key or set(f.keys()) != {f"layer.{i}" for i in layers}:
                raise ValueError("another build's file")
            for i in layers:
                t = f.get_tensor(f"layer.{i}")
                if t.dtype != torch.uint8 or t.shape != (layouts[i].nbytes,):
                    raise ValueError(f"layer {i} has {tuple(t.shape)} {t.dtype}")
                out[i] = t.to(device)
        return out
    except (OSError, ValueError, SafetensorError) as e:
        log.warning("the saved self-draft %s cannot be used (%s): it is made again", path.name, e)
        path.unlink(missing_ok=True)
        return None


def _write_cache(path: Path, key: str, bits: int, layers: list[int], bufs: dict[int, torch.Tensor]) -> None:
    """Save the substitutes (atomically; a full disk costs only the cache)."""
    from safetensors.torch import save_file

    tmp = path.with_name(path.name + f".{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        save_file({f"layer.{i}": bufs[i].cpu() for i in layers}, str(tmp),
                  metadata={"format": FORMAT, "key": key, "bits": str(bits)})
        os.replace(tmp, path)
    except OSError as e:
        log.warning("the self-draft is not saved to %s (%s): it is made again at the next load", path.parent, e)
        tmp.unlink(missing_ok=True)
