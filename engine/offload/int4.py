"""AWQ and GPTQ 4-bit weights de-quantised with torch ops (no CUDA-only packages).

Both store a Linear weight W (out, in) as 4-bit codes q, per-group fp16 scales s and 4-bit
zero points z, groups of `group_size` input channels: W[o, i] = (q[i, o] - z[g(i), o]) * s[g(i), o].

- GPTQ (AutoGPTQ's layout): `qweight` int32 (in/8, out), eight codes per int32 along the input
  dimension, lowest bits first; `qzeros` int32 (groups, out/8), eight zeros per int32 along the
  output dimension, stored minus one (the original "gptq" checkpoint format; "gptq_v2" stores
  them as they are); `g_idx` int32 (in,): each input channel's group (act-order checkpoints
  permute it).
- AWQ (AutoAWQ's GEMM layout): `qweight` int32 (in, out/8) and `qzeros` int32 (groups, out/8),
  eight codes per int32 along the output dimension in the order 0, 2, 4, 6, 1, 3, 5, 7; zeros as
  they are; g(i) = i // group_size.

What this module does not do: read checkpoints (engine.loading) or place layers.
"""

from __future__ import annotations

import torch

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # output column 8c + AWQ_ORDER[k] is nibble k of int32 c
_AWQ_UNDO = tuple(AWQ_ORDER.index(j) for j in range(8))  # nibble holding output column 8c + j
CHUNK_ROWS = 1024  # input channels de-quantised per step (multiple of 8)


def _nibbles(packed: torch.Tensor) -> torch.Tensor:
    """int32 (..., n) -> (..., n, 8) codes, lowest bits first."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=packed.device)
    return (packed[..., None] >> shifts) & 15


def zeros_of(kind: str, qzeros: torch.Tensor, v2: bool = False) -> torch.Tensor:
    """(groups, out/8) int32 -> (groups, out) zero points."""
    z = _nibbles(qzeros)
    if kind == "awq":
        return z[..., list(_AWQ_UNDO)].reshape(qzeros.shape[0], -1)
    z = z.reshape(qzeros.shape[0], -1)
    return z if v2 else z + 1


def dequantize_into(kind: str, sides: dict[str, torch.Tensor], qweight: torch.Tensor, out: torch.Tensor,
                    group_size: int = 0, v2: bool = False) -> None:
    """Fill `out` (out_features, in_features), any dtype, from a packed weight and its `scales`,
    `qzeros` (and `g_idx` for GPTQ). Without g_idx, group_size is in / scale rows."""
    n_out, n_in = out.shape
    scales = sides["scales"].float()  # (groups, out)
    zeros = zeros_of(kind, sides["qzeros"].view(torch.int32).reshape(scales.shape[0], -1), v2).float()
    if "g_idx" in sides:
        groups = sides["g_idx"].view(torch.int32).long()
    else:
        size = group_size or n_in // scales.shape[0]
        groups = torch.arange(n_in, device=out.device) // size
    words = qweight.view(torch.int32)
    for r in range(0, n_in, CHUNK_ROWS):
        end = min(n_in, r + CHUNK_ROWS)
        if kind == "gptq":  # codes along the input dimension
            q = _nibbles(words.reshape(n_in // 8, n_out)[r // 8:end // 8]).transpose(1, 2).reshape(end - r, n_out)
        else:  # awq: along the output dimension, interleaved
            q = _nibbles(words.reshape(n_in, n_out // 8)[r:end])[..., list(_AWQ_UNDO)].reshape(end - r, n_out)
        g = groups[r:end]
        w = (q.float() - zeros[g]) * scales[g]  # (rows, out)
        out[:, r:end].copy_(w.T)
