"""Resident layers of a packed model on a CPU: each Linear weight whose GGUF blocks are linear
(gguf_blocks.AFFINE: Q2_K-Q6_K, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, MXFP4, IQ4_NL, IQ4_XS) stays packed, as codes and
group scales that the packed CPU kernel (engine.kernels) multiplies by directly; every other
parameter is de-quantised once into the compute dtype. The head, when the file stores it (or
the tied embedding) in such a type, is packed the same way: on a small model it is the largest
matrix of a step (the starter's 49152 x 576 head is a fifth of its weights).

On a CPU the device memory is the RAM the packed layers already sit in, so nothing crosses a
link and a step's speed is the speed at which its weights are read: half a byte or one byte
per weight here against four for fp32. The values are the file's own (scale * code +
minimum is the de-quantised value bit for bit); only the order of a product's sums differs
from a dense product.

An MoE layer's routed experts (3-D (E, out, in) parameters; the fused gate_up_proj from two
GGUF tensors) stay packed too, one kernel weight per expert and tensor, and the experts module
becomes a PackedExperts (engine.kernels.experts) that runs only the experts a pass routes to. A
projection with a part in a type the kernel does not read (a float type) is de-quantised whole; IQ4_NL and
IQ4_XS stay in their nibbles too (q8 codes of their table's values, 0.5625 and 0.54 bytes a weight), Q2_K
and Q3_K in two- and three-bit codes in groups of 16 (0.41 and 0.45 bytes a weight, the files' 0.33 and 0.43;
six-bit codes took 0.91 and 0.83, fp32 4).
gpt-oss's MXFP4 experts stay packed as the file's nibbles (kind q4 codes of E2M1's values,
linear.from_nibbles) with a power-of-two scale per 32 in fp16 (0.5625 bytes a weight against the
file's 0.53, and 4 in fp32); a
GGUF's are held rows first for that (engine.model.gpt_oss_experts). A safetensors checkpoint's
(transformers' transposed module) stay the dense module they were.

No kernel (no C compiler, Windows, SPECCHAT_NO_KERNELS=1) leaves everything de-quantised, as
de-quantising at load did before kernels existed (layer_plan.unpack_at_load).

What this module does not do: decide which layers are resident (materialise.py), or read
files (engine.loading.gguf).
"""

from __future__ import annotations

import logging
import math

import torch
from torch import nn

from engine.kernels import expert_parts, experts as packed_experts
from engine.kernels.build import kernels
from engine.kernels.linear import PackedLinear, QuantWeight, from_codes, from_factors, from_nibbles
from engine.offload import gguf_blocks
from engine.offload.layout import Entry, LayerLayout, set_parameter
from engine.offload.unpack import Unpacker

log = logging.getLogger(__name__)


def kernels_on() -> bool:
    return kernels() is not None


def eligible(layer: nn.Module, e: Entry) -> bool:
    """Whether entry `e` of `layer` is a Linear weight in blocks the kernel reads."""
    if e.kind != "gguf" or e.qtype not in gguf_blocks.AFFINE or len(e.shape) != 2 or not e.name.endswith(".weight"):
        return False
    owner = layer.get_submodule(e.name.rpartition(".")[0])
    values, _ = gguf_blocks.block_size(e.qtype)
    return isinstance(owner, nn.Linear) and e.shape[1] % values == 0


EXPERT_PROJECTIONS = ("gate_up_proj", "up_proj", "down_proj")


def expert_eligible(layer: nn.Module, e: Entry) -> bool:
    """Whether entry `e` of `layer` is (a part of) a routed-expert projection in blocks the kernel
    reads, of an experts module PackedExperts runs."""
    if e.kind != "gguf" or e.qtype not in gguf_blocks.AFFINE or len(e.shape) != 3 or e.row_order is not None:
        return False
    owner, _, leaf = e.param.rpartition(".")
    if leaf not in EXPERT_PROJECTIONS or not owner:
        return False
    values, _ = gguf_blocks.block_size(e.qtype)
    return expert_parts.supports(layer.get_submodule(owner)) and e.shape[-1] % values == 0


def _expert_params(layer: nn.Module, layout: LayerLayout) -> set[str]:
    """The expert parameters of `layer` whose every part `expert_eligible`."""
    parts: dict[str, list[Entry]] = {}
    for e in layout.entries:
        if not e.side and len(e.shape) == 3:
            parts.setdefault(e.param, []).append(e)
    return {name for name, es in parts.items() if all(expert_eligible(layer, e) for e in es)}


def packs_experts(layer: nn.Module, layout: LayerLayout) -> bool:
    """Whether every routed-expert parameter of `layer` stays packed for the kernel."""
    names = {e.param for e in layout.entries if not e.side and len(e.shape) == 3}
    return bool(names) and names <= _expert_params(layer, layout)


def _merged(parts: list[tuple[int, int, QuantWeight]], experts: int) -> list[tuple[int, int, QuantWeight]]:
    """Two adjacent parts of one kernel kind (a GGUF's gate and up experts) -> one weight whose
    expert e holds its gate rows then its up rows: one kernel call an expert, and one allocation
    a layer (merging expert by expert left the heap fragmented)."""
    out: list[tuple[int, int, QuantWeight]] = []
    for a, b, w in sorted(parts, key=lambda p: p[0]):
        if out and out[-1][1] == a and expert_parts.same_kind(out[-1][2], w):
            a0, _, v = out.pop()

            def cat(x: torch.Tensor | None, y: torch.Tensor | None) -> torch.Tensor | None:
                if x is None or y is None:
                    return None
                return torch.cat([x.reshape(experts, -1, x.shape[-1]), y.reshape(experts, -1, y.shape[-1])],
                                 dim=1).reshape(-1, x.shape[-1])

            codes, scales = cat(v.codes, w.codes), cat(v.scales, w.scales)
            assert codes is not None and scales is not None
            w = v.like(codes, scales, cat(v.mins, w.mins), v.out_features + w.out_features)
            a = a0
        out.append((a, b, w))
    return out


def _per_expert(w: QuantWeight, experts: int) -> tuple[QuantWeight, ...]:
    """A weight of experts x rows stacked rows -> one weight per expert (views, no copy)."""
    rows = w.out_features // experts

    def cut(t: torch.Tensor | None, e: int) -> torch.Tensor | None:
        return None if t is None else t[e * rows : (e + 1) * rows]

    return tuple(w.like(w.codes[e * rows : (e + 1) * rows], w.scales[e * rows : (e + 1) * rows], cut(w.mins, e), rows)
                 for e in range(experts))


def quant_weight(blocks: torch.Tensor, qtype: int, shape: tuple[int, ...],
                 row_order: torch.Tensor | None) -> QuantWeight:
    """A tensor's GGUF bytes (rows x row bytes, flat) -> the kernel's weight, rows in the model's
    order (`row_order[j]`: the stored row that becomes row j)."""
    rows, cols = shape
    per_row = gguf_blocks.row_bytes(qtype, cols)
    stored = blocks.reshape(rows, per_row)
    if row_order is not None:
        stored = stored[row_order]
    _, nbytes = gguf_blocks.block_size(qtype)
    blocks = stored.reshape(-1, nbytes)
    if qtype in gguf_blocks.NIBBLE_TABLES:  # their nibbles as they are, codes of a table's values
        nibbles, scales, d, mult = gguf_blocks.table_nibbles(blocks, qtype)
        return from_nibbles(nibbles.reshape(rows, cols // 2), gguf_blocks.NIBBLE_TABLES[qtype],
                            scales.reshape(rows, -1) if scales is not None else None,
                            d.reshape(rows, -1) if d is not None else None, mult.reshape(rows, -1) if mult is not None else None)
    codes, scales, mins, group = gguf_blocks.affine(blocks, qtype)
    bits = gguf_blocks.AFFINE_BITS[qtype]
    if qtype in gguf_blocks.K_FACTORED:  # kept as the file factors them: 10 bytes per 8 groups
        del scales, mins
        d, sc, dmin, mn = gguf_blocks.k_factors(blocks, qtype)
        return from_factors(codes.reshape(rows, cols), d.reshape(rows, -1), sc.reshape(rows, -1),
                            dmin.reshape(rows, -1) if dmin is not None else None,
                            mn.reshape(rows, -1) if mn is not None else None, group, bits)
    return from_codes(codes.reshape(rows, cols), scales.reshape(rows, -1),
                      mins.reshape(rows, -1) if mins is not None else None, group, bits)


CHUNK_WEIGHTS = 1 << 25  # weights converted at once (expert_weights): ~32 MB of int8 codes in flight


def expert_weights(parts: list[tuple[int, int, torch.Tensor, int]], experts: int, cols: int
                   ) -> list[tuple[int, int, QuantWeight]]:
    """The routed experts' parts of one parameter ((a, b, GGUF bytes, type): rows a..b of every
    expert, (experts x (b - a), cols)) as the kernel's weights; adjacent parts of one type (a
    GGUF's gate and up experts) in one weight whose expert e holds its rows of each in turn (one
    kernel call an expert). Converted a few experts at a time (CHUNK_WEIGHTS) straight into
    that weight's tensors: whole, the transients (a byte per code, the bit fields, index
    tensors) and then the gate/up concatenation cost several times the packed result: a
    Qwen3-Next-sized layer (512 experts of 3 x 512 x 2048) took a 4.4 GB file's load to 8.6 GB of
    anonymous memory for a 4.6 GB footprint (now 5.8). Chunks of experts, not single ones: 512
    small conversions fragmented the heap (+0.9 GB). (_pack_experts' _merged still joins
    adjacent parts of different types that the kernel holds alike.)"""
    groups: list[list[tuple[int, int, torch.Tensor, int]]] = []
    for part in sorted(parts, key=lambda p: p[0]):
        if groups and groups[-1][-1][1] == part[0] and groups[-1][-1][3] == part[3]:
            groups[-1].append(part)
        else:
            groups.append([part])
    out: list[tuple[int, int, QuantWeight]] = []
    for group in groups:
        width = sum(b - a for a, b, _, _ in group)
        first: QuantWeight | None = None
        dest: list[torch.Tensor | None] = []
        at = 0
        for a, b, blocks, qtype in group:
            rows = b - a
            stored = blocks.reshape(experts * rows, -1)
            step = max(1, CHUNK_WEIGHTS // max(rows * cols, 1))
            for e0 in range(0, experts, step):
                e1 = min(experts, e0 + step)
                w = quant_weight(stored[e0 * rows : e1 * rows], qtype, ((e1 - e0) * rows, cols), None)
                if first is None:
                    first = w
                    dest = [None if t is None else t.new_empty((experts, width, t.shape[-1]))
                            for t in (w.codes, w.scales, w.mins)]
                for t, room in zip((w.codes, w.scales, w.mins), dest):
                    if t is not None and room is not None:
                        room[e0:e1, at : at + rows] = t.reshape(e1 - e0, rows, -1)
            at += rows
        assert first is not None and dest[0] is not None and dest[1] is not None
        codes, scales, mins = (None if t is None else t.reshape(experts * width, -1) for t in dest)
        assert codes is not None and scales is not None
        out.append((group[0][0], group[-1][1], first.like(codes, scales, mins, experts * width)))
    return out


def kernel_bytes(layout: LayerLayout, layer: nn.Module) -> int:
    """RAM one layer takes placed by `place_layer` (kernels on)."""
    total = 0
    esize = torch.empty((), dtype=layout.compute_dtype).element_size()
    experts = _expert_params(layer, layout)
    for e in layout.entries:
        if e.param in experts and not e.side:  # each part packed, its own rows
            rows = math.prod(e.shape[:-1]) if e.part is None else e.shape[0] * (e.part[1] - e.part[0])
            total += _packed_bytes(e.qtype, rows * e.shape[-1])
            continue
        if not e.stands_for_param:
            continue
        numel = math.prod(e.shape)
        if eligible(layer, e):
            total += _packed_bytes(e.qtype, numel)
        else:
            total += numel * esize
    return total


def _packed_bytes(qtype: int, numel: int) -> int:
    """Bytes of `numel` weights of GGUF type `qtype` as the kernel holds them (K-quants' scales
    and minimums as they factor them, 10 bytes per 8 groups; the others' in fp32 at most)."""
    group = 16 if qtype in gguf_blocks.GROUP16 else 32
    bits = 4 if qtype in gguf_blocks.NIBBLE_TABLES else gguf_blocks.AFFINE_BITS[qtype]
    code_bytes = (numel // 2 if bits <= 4 and group == 32 else numel * 3 // 4 if bits in (5, 6)
                  else numel // 4 if bits == 2 else numel * 3 // 8 if bits == 3 else numel)
    scales_only = (gguf_blocks.Q.Q8_0, gguf_blocks.Q.Q6_K, gguf_blocks.Q.MXFP4, gguf_blocks.Q.IQ4_NL, gguf_blocks.Q.IQ4_XS,
                   gguf_blocks.Q.Q3_K)
    sides = 1 if qtype in scales_only else 2  # scales, or scales and minimums
    if qtype in gguf_blocks.K_FACTORED:
        return code_bytes + numel // (8 * group) * 10 * sides
    return code_bytes + numel // group * 4 * sides


def place_layer(layer: nn.Module, layout: LayerLayout, packed: torch.Tensor, unpacker: Unpacker,
                dtype: torch.dtype, device: torch.device, use_kernels: bool,
                device_packed: torch.Tensor | None = None) -> int:
    """Make `layer` (meta) a resident layer from its packed buffer (in RAM): eligible Linears
    become PackedLinear, routed experts a PackedExperts, the rest is de-quantised. On a GPU
    (`device` not the CPU; `device_packed`: the same bytes there) only the routed experts stay
    packed in RAM, for the CPU kernel; everything else is de-quantised on the GPU. Returns how
    many Linears (and expert projections) were packed."""
    packed_count = 0
    dense: dict[str, torch.Tensor] = {}
    experts = _expert_params(layer, layout) if use_kernels else set()
    on_cpu = device.type == "cpu"
    raw_parts: dict[str, list[tuple[int, int, torch.Tensor, int]]] = {}
    shapes: dict[str, tuple[int, ...]] = {}
    for e in layout.entries:
        if e.side:
            continue
        if e.param in experts:  # converted below, a few experts at a time (expert_weights)
            a, b = e.part if e.part is not None else (0, e.shape[1])
            raw_parts.setdefault(e.param, []).append((a, b, layout.view(packed, e), e.qtype))
            shapes[e.param] = e.shape
        elif use_kernels and on_cpu and eligible(layer, e):
            order = unpacker.row_order(e)
            weight = quant_weight(layout.view(packed, e), e.qtype, e.shape, order)
            owner, _, attr = e.name.rpartition(".")
            parent_name, _, child = owner.rpartition(".")
            parent = layer.get_submodule(parent_name) if parent_name else layer
            setattr(parent, child, PackedLinear(weight))
            packed_count += 1
        elif e.param not in dense:  # every part of a fused parameter fills one tensor
            dense[e.param] = torch.empty(e.shape, dtype=dtype, device=device)
    if dense:
        unpacker(layout, packed if device_packed is None else device_packed, dense, only=set(dense))
    for name, value in dense.items():  # biases land on the PackedLinear that replaced their Linear
        set_parameter(layer, name, value)
    expert_parts = {name: expert_weights(found, shapes[name][0], shapes[name][2]) for name, found in raw_parts.items()}
    for owner in sorted({name.rpartition(".")[0] for name in expert_parts}):
        packed_count += _pack_experts(layer, owner, expert_parts)
    return packed_count


def _pack_experts(layer: nn.Module, owner: str, parts: dict[str, list[tuple[int, int, QuantWeight]]]) -> int:
    """Replace experts module `owner` of `layer` by a PackedExperts over its packed projections
    (`parts`, by parameter name: each part's rows and its weight of experts x rows rows) and its
    dense ones (already set on it)."""
    module = layer.get_submodule(owner)
    experts = int(getattr(module, "num_experts"))

    def projection(leaf: str) -> list[expert_parts.Part]:
        found = parts.get(f"{owner}.{leaf}")
        if found is not None:
            return [expert_parts.Part(a, b, packed=_per_expert(w, experts)) for a, b, w in _merged(found, experts)]
        value = getattr(module, leaf)
        return [expert_parts.Part(0, value.shape[1], dense=value.data)]

    first = "gate_up_proj" if getattr(module, "has_gate", True) else "up_proj"
    new = packed_experts.PackedExperts(module, projection(first), projection("down_proj"))
    parent_name, _, child = owner.rpartition(".")
    setattr(layer.get_submodule(parent_name) if parent_name else layer, child, new)
    return sum(1 for name in parts if name.startswith(owner + "."))


def packed_matrix(blocks: torch.Tensor, qtype: int, shape: tuple[int, ...],
                  row_order: torch.Tensor | None) -> QuantWeight | None:
    """A whole matrix (a head, an embedding table) as the kernel's weight, when its blocks are a
    type the kernel reads and a kernel exists; else None."""
    if not kernels_on() or qtype not in gguf_blocks.AFFINE or len(shape) != 2:
        return None
    values, _ = gguf_blocks.block_size(qtype)
    if shape[1] % values:
        return None
    return quant_weight(blocks, qtype, shape, row_order)


def packed_head(blocks: torch.Tensor, qtype: int, shape: tuple[int, ...], row_order: torch.Tensor | None) -> PackedLinear | None:
    """The head as a PackedLinear, when packed_matrix takes its blocks."""
    weight = packed_matrix(blocks, qtype, shape, row_order)
    return PackedLinear(weight) if weight is not None else None
