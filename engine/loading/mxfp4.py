"""MXFP4, the OCP microscaling 4-bit float format gpt-oss's checkpoints store their experts in.

A stored pair `<name>_blocks` (uint8, (experts, rows, groups, 16)) and `<name>_scales` (uint8,
(experts, rows, groups)) is a tensor of (experts, rows, groups * 32) values: each byte holds
two FP4 (E2M1) codes, the low nibble first; each group of 32 values shares one E8M0 scale, a
power of two with bias 127. transformers' module holds the tensor transposed, (experts,
groups * 32, rows): gpt-oss's `gate_up_proj` (experts, hidden, 2 * intermediate) is stored as
(experts, 2 * intermediate, hidden / 32, 16). This is transformers' own de-quantisation
(integrations/mxfp4.py, `convert_moe_packed_tensors`), value for value: every FP4 value times
a power of two is exact in fp32, so one rounding to the compute dtype gives its bits.

What this module does not do: read files (checkpoint.py serves a pair as one tensor) or run
FP4 arithmetic (the values are de-quantised once, at load).
"""

from __future__ import annotations

import torch

GROUP = 32  # values per E8M0 scale
BIAS = 127  # E8M0 exponent bias
# E2M1 codes 0..15: sign bit, two exponent bits, one mantissa bit
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def mxfp4_shape(blocks: tuple[int, ...], scales: tuple[int, ...]) -> tuple[int, ...] | None:
    """The model tensor's shape (experts, groups * 32, rows) of stored blocks and scales of
    these shapes, or None when they are no MXFP4 pair."""
    if len(blocks) != 4 or blocks[-1] != GROUP // 2 or tuple(blocks[:-1]) != tuple(scales):
        return None
    experts, rows, groups, _ = blocks
    return experts, groups * GROUP, rows


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """One expert's (rows, groups, 16) uint8 blocks and (rows, groups) uint8 scales -> its
    (groups * 32, rows) fp32 values, transposed as transformers' module holds them."""
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32, device=blocks.device)
    rows, groups, _ = blocks.shape
    codes = torch.stack((blocks & 0x0F, blocks >> 4), dim=-1).long()  # (rows, groups, 16, 2): low nibble first
    values = lut[codes].reshape(rows, groups, GROUP)  # (rows, groups, 32)
    values = torch.ldexp(values, scales.to(torch.int32).unsqueeze(-1) - BIAS)  # exact: a power of two
    return values.reshape(rows, groups * GROUP).T  # (groups * 32, rows)
