"""The packed layer layout: an offset table describing a decoder layer packed into one flat
byte buffer, and NF4.

Every decoder layer of a model has the same parameters, so one offset table (`LayerLayout`)
describes any layer of a 16-bit or NF4 model. "Load layer i into ring slot k" is then a single
contiguous copy, and a template decoder layer whose parameters are views into slot k runs it
(`bind`). Packed layers travel packed and are de-quantised on the device into one dense buffer
just before they run (unpack.py), for entries of kind:

- "dense": a parameter as it runs, in the compute dtype;
- "nf4": 4-bit codes (bitsandbytes order) + an fp32 absmax per 64 weights (entry `name#absmax`);
- "gguf": a tensor's bytes as a GGUF file stores them (`qtype`: the ggml type; `row_order`:
  llama.cpp's row permutation to undo). A GGUF model has one layout per layer, since a file
  may store its layers in different types (Q4_K_M keeps some in Q6_K), with the offsets the
  tensors have in the file, so a layer's bytes are one span of the file. One parameter may
  come from several tensors of the file: an MoE layer's fused experts `gate_up_proj` (E, 2I, H)
  are llama.cpp's `ffn_gate_exps` and `ffn_up_exps` (E, I, H) each. Such a parameter has one
  entry per tensor, `name#k` with `part` (a, b): its bytes de-quantise into rows [a, b) of
  every matrix of the parameter (a strided slice of the dense parameter);
- "awq" / "gptq": int4 codes packed eight per int32, with `#scales`, `#qzeros` (and `#g_idx`);
- "lowbit": a self-draft's 2-4-bit codes (lowbit.py; `qtype`: the bits), with a byte `#scale`
  (uint8) and `#min` (int8) per group, two fp16 factors per row (`#rows`) and an fp16 column
  scale per input (`#cscale`).

What this module does not do: decide where a layer lives (host_store, streamer), read
checkpoints (engine.loading), or de-quantise (unpack.py).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import bitsandbytes.functional as bnbf
import torch
from torch import nn

from engine.shapes import Packing
from engine.types import Quant

ALIGN = 256  # byte alignment of every entry: safe for any dtype view and for DMA
NF4_BLOCK = 64


# ---- layout ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Entry:
    """One tensor of a packed layer (kinds: see the module docstring). Side entries (absmax,
    scales, zeros, g_idx) are named `weight name + "#" + what`."""

    name: str
    kind: str
    shape: tuple[int, ...]  # the parameter's shape (packed kinds too: the de-quantised shape; a part: all of it)
    dtype: torch.dtype  # storage dtype
    offset: int
    nbytes: int
    qtype: int = -1  # "gguf": the ggml type; "gptq": the checkpoint format (2: zeros stored as they are)
    row_order: tuple[int, ...] | None = None  # "gguf": stored row that becomes row j
    # a part of parameter `param` (name `param#k`): rows [a, b) along dim -2 of each of its matrices
    part: tuple[int, int] | None = None

    @property
    def side(self) -> bool:
        """An entry that is no parameter (or part of one): absmax, scales, zeros, g_idx."""
        return "#" in self.name and self.part is None

    @property
    def param(self) -> str:
        """The parameter this entry fills (all of it, or its part)."""
        return self.name.partition("#")[0] if self.part is not None else self.name

    @property
    def stands_for_param(self) -> bool:
        """Whether this entry counts its parameter once: every non-side entry but later parts."""
        return not self.side and (self.part is None or self.part[0] == 0)


ABSMAX = "#absmax"


def _aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


@dataclass(frozen=True)
class LayerLayout:
    entries: tuple[Entry, ...]
    nbytes: int  # one packed layer
    dense_nbytes: int  # the same layer with every parameter in the compute dtype
    compute_dtype: torch.dtype
    quant: Packing

    @classmethod
    def of(cls, layer: nn.Module, compute_dtype: torch.dtype, quant: Quant) -> LayerLayout:
        """The layout of a decoder layer (any device, meta included): Linear weights are NF4
        when quant is "nf4" and their size is a multiple of the block; the rest stays dense."""
        linear = {f"{name}.weight" for name, m in layer.named_modules() if isinstance(m, nn.Linear)}
        # an MoE layer's fused experts (experts, out, in) are Linear weights too, one per expert
        linear |= {name for name, p in layer.named_parameters() if p.ndim == 3 and ".experts." in f".{name}"}
        entries: list[Entry] = []
        offset = dense = 0
        esize = torch.empty((), dtype=compute_dtype).element_size()
        for name, p in layer.named_parameters():
            numel = p.numel()
            dense += _aligned(numel * esize)
            if quant == "nf4" and name in linear and numel % NF4_BLOCK == 0:
                entries.append(Entry(name, "nf4", tuple(p.shape), torch.uint8, offset, numel // 2))
                offset += _aligned(numel // 2)
                n_abs = numel // NF4_BLOCK * 4
                entries.append(Entry(name + ABSMAX, "absmax", (numel // NF4_BLOCK,), torch.float32, offset, n_abs))
                offset += _aligned(n_abs)
            else:
                entries.append(Entry(name, "dense", tuple(p.shape), compute_dtype, offset, numel * esize))
                offset += _aligned(numel * esize)
        return cls(tuple(entries), offset, dense, compute_dtype, quant)

    @classmethod
    def packed(cls, entries: list[Entry], compute_dtype: torch.dtype, quant: Packing,
               span: int | None = None) -> LayerLayout:
        """A layout of given entries. Their offsets are kept when `span` (the packed size) is
        given (a GGUF layer laid out as in its file); otherwise they are laid out in order."""
        esize = torch.empty((), dtype=compute_dtype).element_size()
        dense = sum(_aligned(_numel(e.shape) * esize) for e in entries if e.stands_for_param)
        if span is None:
            placed, offset = [], 0
            for e in entries:
                placed.append(replace(e, offset=offset))
                offset += _aligned(e.nbytes)
            entries, span = placed, offset
        return cls(tuple(entries), span, dense, compute_dtype, quant)

    def dense_layout(self) -> LayerLayout:
        """The unpacked twin: every parameter dense, in the same order."""
        entries, offset = [], 0
        esize = torch.empty((), dtype=self.compute_dtype).element_size()
        for e in self.entries:
            if not e.stands_for_param:
                continue
            n = _numel(e.shape) * esize
            entries.append(Entry(e.param, "dense", e.shape, self.compute_dtype, offset, n))
            offset += _aligned(n)
        return LayerLayout(tuple(entries), offset, offset, self.compute_dtype, "none")

    def view(self, buf: torch.Tensor, entry: Entry) -> torch.Tensor:
        """The tensor `entry` inside a packed buffer `buf` (uint8, nbytes long)."""
        raw = buf[entry.offset : entry.offset + entry.nbytes]
        if entry.kind == "nf4":
            return raw.view(-1, 1)  # (numel/2, 1): bitsandbytes' packed shape
        if entry.kind in ("gguf", "awq", "gptq", "lowbit"):
            return raw  # blocks or packed codes: unpack.py reads them
        return raw.view(entry.dtype).view(entry.shape)

    def params(self, buf: torch.Tensor) -> dict[str, torch.Tensor]:
        """Dense parameter views (only meaningful for an unquantised layout)."""
        assert self.quant == "none"
        return {e.name: self.view(buf, e) for e in self.entries}


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


# ---- NF4 ------------------------------------------------------------------------------------
def quantize_nf4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A weight -> (packed codes (numel/2, 1) uint8, absmax (numel/64,) fp32), blocksize 64."""
    packed, state = bnbf.quantize_4bit(weight.contiguous(), blocksize=NF4_BLOCK, quant_type="nf4")
    return packed, state.absmax.float()


def dequantize_nf4(packed: torch.Tensor, absmax: torch.Tensor, out: torch.Tensor, code: torch.Tensor) -> None:
    """Write the dequantised weight into `out` (its shape and dtype, contiguous), on packed's
    device. The blocks run over the flattened weight, so it is de-quantised flat: bitsandbytes'
    CPU backend, given a 2-D shape whose rows are not whole blocks (48 columns, say), puts the
    values in the wrong places (mean error 0.36 of the weight's magnitude, against NF4's 0.09)."""
    flat = out.view(-1)
    state = bnbf.QuantState(absmax=absmax, shape=flat.shape, code=code, blocksize=NF4_BLOCK,
                            quant_type="nf4", dtype=out.dtype)
    if out.device.type == "cuda":
        bnbf.dequantize_4bit(packed, state, out=flat)
    else:  # bitsandbytes' CPU backend has no out= variant
        flat.copy_(bnbf.dequantize_4bit(packed, state).reshape(-1))


def nf4_code(device: torch.device) -> torch.Tensor:
    return bnbf.get_4bit_type("nf4", device=device)


def pack_entry(layout: LayerLayout, buf: torch.Tensor, name: str, value: torch.Tensor) -> None:
    """Store parameter `name` (any dtype/device) into packed buffer `buf`, quantising as the
    layout says."""
    entry = next(e for e in layout.entries if e.name == name)
    if entry.kind == "nf4":
        packed, absmax = quantize_nf4(value.to(layout.compute_dtype))
        layout.view(buf, entry).copy_(packed.view(-1, 1))
        layout.view(buf, _absmax_entry(layout, name)).copy_(absmax)
    else:
        layout.view(buf, entry).copy_(value.reshape(entry.shape))


def pack_prequantized(layout: LayerLayout, buf: torch.Tensor, name: str, packed: torch.Tensor,
                      absmax: torch.Tensor) -> None:
    """Store an already-NF4 weight (blocksize 64) as it is."""
    layout.view(buf, next(e for e in layout.entries if e.name == name)).copy_(packed.reshape(-1, 1))
    layout.view(buf, _absmax_entry(layout, name)).copy_(absmax.float())


def _absmax_entry(layout: LayerLayout, name: str) -> Entry:
    return next(e for e in layout.entries if e.name == name + ABSMAX)


def set_parameter(module: nn.Module, name: str, value: torch.Tensor) -> None:
    """Make `value` (no copy) the parameter `name` ("mlp.up_proj.weight") of `module`."""
    owner, _, attr = name.rpartition(".")
    setattr(module.get_submodule(owner), attr, nn.Parameter(value, requires_grad=False))


def bind(module: nn.Module, params: dict[str, torch.Tensor]) -> None:
    """Make `module`'s parameters the given tensors (views: no copy)."""
    for name, t in params.items():
        set_parameter(module, name, t)
