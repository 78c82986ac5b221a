"""The cache side of the fused CPU step and pass (engine/kernels/fused_layer.py): qmatmul.c's
qm_view per layer (a cache's K/V buffers, a hybrid's Gated DeltaNet states and a pass's pending
outputs), kept per cache and read again when the cache replaced a buffer or a state."""

from __future__ import annotations

import ctypes
import weakref
from typing import Any

import torch

from engine.model.cache import KVCache
from engine.model.hybrid_cache import HybridCache, LinearSpec
from engine.model.linear_state import LinearLayerState, NodeInputs


class View(ctypes.Structure):
    """qmatmul.c's qm_view: a layer's K/V buffers, their capacity, and which window (-1: none);
    a Gated DeltaNet layer's conv and recurrent states."""
    _fields_ = [("keys", ctypes.c_void_p), ("values", ctypes.c_void_p), ("capacity", ctypes.c_int64),
                ("window", ctypes.c_int64), ("rope", ctypes.c_int64), ("conv", ctypes.c_void_p), ("rec", ctypes.c_void_p),
                ("pend_x", ctypes.c_void_p), ("pend_mix", ctypes.c_void_p), ("pend_bg", ctypes.c_void_p)]


class Buffers:
    """One cache's K/V buffers as qm_view structs, and which buffers they are (weakly: a
    cache's buffers are replaced when it grows, a windowed layer's apart from the rest, and
    must be freed then)."""

    def __init__(self, cache: KVCache, window_of: list[int], rope_of: list[int], kv_of: list[int] | None = None) -> None:
        """`kv_of`: the layer whose buffers each layer's view reads (Gemma 4's K/V-reusing layers
        read an earlier layer's); None: its own."""
        n = len(cache.keys)
        self.views = (View * n)()
        keys, values = cache.keys, cache.values
        if kv_of is not None:
            keys, values = [keys[j] for j in kv_of], [values[j] for j in kv_of]
        for view, k, v, w, rope in zip(self.views, keys, values, window_of, rope_of):
            view.keys, view.values, view.capacity, view.window = k.data_ptr(), v.data_ptr(), int(k.shape[2]), w
            view.rope = rope
        for i, state in _states(cache).items():  # a hybrid's Gated DeltaNet states, updated in place by a step
            self.views[i].conv, self.views[i].rec = state.conv.data_ptr(), state.recurrent.data_ptr()
        self._refs = [weakref.ref(t) for t in _tensors(cache)]

    def holds(self, cache: KVCache) -> bool:
        """Whether these are still `cache`'s buffers (and states: a HybridCache replaces them
        when it goes back to a snapshot)."""
        now = _tensors(cache)
        return len(now) == len(self._refs) and all(r() is t for r, t in zip(self._refs, now))


def _states(cache: KVCache) -> dict[int, LinearLayerState]:
    return cache.states if isinstance(cache, HybridCache) else {}


def _tensors(cache: KVCache) -> list[torch.Tensor]:
    return [*cache.keys, *cache.values, *(t for _, s in sorted(_states(cache).items()) for t in s.tensors())]


def state_fits(state: LinearLayerState | None, spec: Any) -> bool:
    """Whether a Gated DeltaNet layer's state is fp32 and contiguous, of its spec's shape."""
    return state is not None and all(
        t.dtype == torch.float32 and t.is_contiguous() and t.device.type == "cpu" and tuple(t.shape) == shape
        for t, shape in ((state.conv, (1, spec.conv_dim, spec.kernel - 1)),
                         (state.recurrent, (1, spec.num_v_heads, spec.head_k_dim, spec.head_v_dim))))


def pending_outputs(linear: list[LinearSpec | None], buffers: Buffers,
                    n: int) -> dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Per Gated DeltaNet layer (`linear`: each layer's state shape, None for attention), the
    tensors its C pass writes each token's inputs into (qm_view's pend_*): pre-conv inputs, conv
    outputs, beta and g."""
    out = {}
    for i, spec in enumerate(linear):
        if spec is not None:
            out[i] = (torch.empty(n, spec.conv_dim), torch.empty(n, spec.conv_dim), torch.empty(n, 2 * spec.num_v_heads))
            view = buffers.views[i]
            view.pend_x, view.pend_mix, view.pend_bg = (t.data_ptr() for t in out[i])
    return out


def node_inputs(spec: LinearSpec | None, x: torch.Tensor, mix: torch.Tensor, bg: torch.Tensor) -> NodeInputs:
    """A Gated DeltaNet layer's tree-pass outputs as the general path hands them to the cache
    (TreeGatedDeltaNet)."""
    assert spec is not None
    n, h = int(x.shape[0]), spec.num_v_heads
    kd = (spec.conv_dim - h * spec.head_v_dim) // 2
    return NodeInputs(x, mix[:, kd : 2 * kd].reshape(n, -1, spec.head_k_dim).contiguous(),
                      mix[:, 2 * kd :].reshape(n, h, spec.head_v_dim).contiguous(), bg[:, :h].contiguous(),
                      bg[:, h:].contiguous())
