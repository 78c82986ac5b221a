"""An accepted path replayed through a Gated DeltaNet layer's recurrent state on the CPU, in C
(qmatmul.c's qm_delta_replay): what HybridCache.keep does after every verified tree of a Qwen3.5 /
Qwen3.6 / Qwen3-Next model, once per linear layer.

PyTorch's block form (engine/model/linear_attention._chain_rule) costs about 1 ms a layer for a
path of one to a few tokens on 2 cores, its triangular solve and per-operation overhead on a
state of 2 MB (32 value heads of 128 x 128): a third of a decoding step of a CPU MoE, paid on
every tree pass. The C rule reads each head's state once per token and runs the same delta rule
as the fused step and tree pass, so the replayed state is the one the pass computed for the path.

What this module does not do: the conv state (a copy, linear_attention.advance keeps it), GPU
tensors, or dtypes other than fp32 states (those take the block form).
"""

from __future__ import annotations

import ctypes
from typing import Any

import torch

from engine.kernels.build import kernels
from engine.kernels.governor import governor

_ARGS = [ctypes.c_void_p, *[ctypes.c_int64] * 4, ctypes.c_int, ctypes.c_int64, *[ctypes.c_void_p] * 4, ctypes.c_int]


def _function() -> Any:
    """qm_delta_replay with its argument types, declared once per loaded library (keep runs this
    once a linear layer on every tree pass); None without a library that has it."""
    lib = kernels()
    fn = getattr(lib, "qm_delta_replay", None) if lib is not None else None
    if fn is not None and fn.argtypes is None:
        fn.restype, fn.argtypes = ctypes.c_int, _ARGS
    return fn


@torch.inference_mode()
def replay(recurrent: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor, g: torch.Tensor,
           tiled: bool) -> bool:
    """Advance `recurrent` (1, H_v, dk, dv) fp32 in place along a path of L nodes: k (L, H_k, dk)
    post-conv keys (not normalised), v (L, H_v, dv), beta and g (L, H_v); `tiled`: value head h
    reads key head h % H_k (else h // (H_v / H_k)). False, and nothing changed, where the C
    kernel cannot take it (no kernel library, not the CPU, not an fp32 contiguous state)."""
    fn = _function()
    if (fn is None or recurrent.device.type != "cpu" or recurrent.dtype != torch.float32
            or not recurrent.is_contiguous() or recurrent.dim() != 4):
        return False
    _, vh, dk, dv = recurrent.shape
    steps, kh = int(k.shape[0]), int(k.shape[1])
    if (tuple(k.shape) != (steps, kh, dk) or tuple(v.shape) != (steps, vh, dv) or tuple(beta.shape) != (steps, vh)
            or tuple(g.shape) != (steps, vh) or kh < 1 or vh % kh):
        return False
    k, v, beta, g = (t.to(torch.float32).contiguous() for t in (k, v, beta, g))
    if fn(recurrent.data_ptr(), vh, kh, dk, dv, int(tiled), steps, k.data_ptr(), v.data_ptr(), beta.data_ptr(),
          g.data_ptr(), governor().threads()) != 0:
        raise MemoryError("no memory for a Gated DeltaNet replay's scratch")
    return True
