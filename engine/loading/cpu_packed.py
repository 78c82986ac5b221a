"""Resident layers of a packed model on a CPU: each Linear weight whose GGUF blocks are linear
(gguf_blocks.AFFINE: Q4_0, Q4_1, Q4_K, Q5_0, Q5_1, Q5_K, Q6_K, Q8_0) stays packed, as codes and
group scales that the packed CPU kernel (engine.kernels) multiplies by directly; every other
parameter is de-quantised once into the compute dtype. The head, when the file stores it (or
the tied embedding) in such a type, is packed the same way: on a small model it is the largest
matrix of a step (the starter's 49152 x 576 head is a fifth of its weights).

On a CPU the device memory is the RAM the packed layers already sit in, so nothing crosses a
link and a step's speed is the speed at which its weights are read: half a byte or one byte
per weight here against four for fp32. The values are the file's own (scale * code +
minimum is the de-quantised value bit for bit); only the order of a product's sums differs
from a dense product.

An MoE layer's experts (3-D (E, out, in) parameters; fused gate_up_proj from two GGUF tensors)
are no Linear weights: the kernel multiplies 2-D Linears, so experts are de-quantised once at
load into the compute dtype, like the norms.

No kernel (no C compiler, Windows, SPECCHAT_NO_KERNELS=1) leaves everything de-quantised, as
de-quantising at load did before kernels existed (materialise.unpack_at_load).

What this module does not do: decide which layers are resident (materialise.py), or read
files (engine.loading.gguf).
"""

from __future__ import annotations

import logging
import math

import torch
from torch import nn

from engine.kernels.build import kernels
from engine.kernels.linear import PackedLinear, QuantWeight, from_codes
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
    codes, scales, mins, group = gguf_blocks.affine(stored.reshape(-1, nbytes), qtype)
    return from_codes(codes.reshape(rows, cols), scales.reshape(rows, -1),
                      mins.reshape(rows, -1) if mins is not None else None, group, gguf_blocks.AFFINE_BITS[qtype])


def kernel_bytes(layout: LayerLayout, layer: nn.Module) -> int:
    """RAM one layer takes placed by `place_layer` (kernels on)."""
    total = 0
    esize = torch.empty((), dtype=layout.compute_dtype).element_size()
    for e in layout.entries:
        if not e.stands_for_param:
            continue
        numel = math.prod(e.shape)
        if eligible(layer, e):
            values, _ = gguf_blocks.block_size(e.qtype)
            group = 16 if e.qtype == gguf_blocks.Q.Q6_K else 32
            bits = gguf_blocks.AFFINE_BITS[e.qtype]
            code_bytes = numel // 2 if bits <= 4 and group == 32 else numel
            sides = 2 if e.qtype not in (gguf_blocks.Q.Q8_0, gguf_blocks.Q.Q6_K) else 1
            total += code_bytes + numel // group * 4 * sides
        else:
            total += numel * esize
    return total


def place_layer(layer: nn.Module, layout: LayerLayout, packed: torch.Tensor, unpacker: Unpacker,
                dtype: torch.dtype, device: torch.device, use_kernels: bool) -> int:
    """Make `layer` (meta) a resident layer from its packed buffer: eligible Linears become
    PackedLinear, the rest is de-quantised. Returns how many Linears were packed."""
    packed_count = 0
    dense: dict[str, torch.Tensor] = {}
    for e in layout.entries:
        if e.side:
            continue
        if use_kernels and eligible(layer, e):
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
        unpacker(layout, packed, dense, only=set(dense))
    for name, value in dense.items():  # biases land on the PackedLinear that replaced their Linear
        set_parameter(layer, name, value)
    return packed_count


def packed_head(blocks: torch.Tensor, qtype: int, shape: tuple[int, ...], row_order: torch.Tensor | None) -> PackedLinear | None:
    """The head as a PackedLinear, when its blocks are a type the kernel reads and a kernel exists."""
    if not kernels_on() or qtype not in gguf_blocks.AFFINE or len(shape) != 2:
        return None
    values, _ = gguf_blocks.block_size(qtype)
    if shape[1] % values:
        return None
    return PackedLinear(quant_weight(blocks, qtype, shape, row_order))
