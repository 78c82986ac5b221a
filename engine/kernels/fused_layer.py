"""A plain decoding step through every decoder layer in one C call (qmatmul.c's
`qm_decode_layers`), for llama-family models whose Linears are all PackedLinear on the CPU.

Why: a step of a small model (the starter: 30 layers, hidden 576) spends as long in the Python
and the PyTorch operations around the packed products (~200 ctypes calls, ~30 small ops a
layer) as in the products themselves. Here the layers' weights and norms are handed to C once,
as an array of structs (a cache's buffer addresses once per cache, again after it grew), and a
step is: the embedding and the rotary cos/sin (the model's own modules), one C call, the final
norm.

`FusedDecoder.of(model)` says once, at load, whether a model qualifies: dense llama, mistral,
qwen2 (q/k/v biases), qwen3 (per-head q/k norms) or Gemma 3 layers (norms by 1 + w, the
attention's and MLP's outputs normed before each residual, a GELU gate, a local and a global
rotary table), or Qwen3-MoE, Mixtral, gpt-oss and GLM-4.5 layers whose routed experts are all
packed with the one-token experts kernel (PackedExperts._fused: the step and the pass run their
router as transformers does, softmax, top-k, renormalised, gpt-oss's biased logits, top-k,
softmax of those, or GLM-4.5's sigmoid scores chosen with their bias; each token's experts
summed in expert order, with gpt-oss's gate and biases, GLM-4.5's shared expert after them,
counting the routed tokens into each PackedExperts.hits; a pass reads each woken expert once
for all its tokens and logs the union it woke), or Qwen3.5 / Qwen3.6 hybrids (qwen3_5_text,
qwen3_5_moe_text: Gated DeltaNet layers whose conv and recurrent states live in a HybridCache,
gated attention, the MoE's shared expert under its sigmoid gate), or Gemma 4 (fused_gemma4.py),
all resident on the CPU in fp32, attention full or over a sliding window (the layer's own, as
engine.model.family reads it: a WindowedCache's buffers, each window's layers from their own
first column) with gpt-oss's sinks where it has them, SiLU or GELU (tanh) MLPs, every Linear of
every layer a PackedLinear (minimums, where present, in groups of 16 or 32).
`takes(cache)` says per step whether the cache is a plain KVCache, or a WindowedCache of the
model's windows, of this shape. engine.kernels.fused_rules says which models qualify.
SPECCHAT_NO_FUSED=1 in the environment (read when a model is loaded) switches the path off.

`pass_` runs several tokens the same way (qmatmul.c's `qm_pass_layers`): a tree's nodes under
their mask, or a chain (a prompt's chunk), each weight tile decoded once for all of them. A
draft-free tree on the starter then costs a few milliseconds more than a plain step, not the
general path's ~20 ms of Python and small operations, so trees pay on a CPU again.

A hybrid's step folds its token into each Gated DeltaNet layer's state in place (committed text,
on a cache with nothing pending: HybridCache.folded); its tree pass (up to HYBRID_PASS_TOKENS)
runs each node's delta rule from its parent's state, leaves the committed states as they were
and hands the cache each node's inputs as TreeGatedDeltaNet would (HybridCache.keep replays the
accepted path); a prompt's chunk (committed text, no mask) is folded into the states in place
as that many steps would (a Stop between runs of layers puts back the states it advanced); a pass
on pending entries keeps the general path's blocks.

What this module does not do: streamed layers or GPUs (CausalLM.forward's general path runs
those), or choose which weights are packed.
"""

from __future__ import annotations

import ctypes
import itertools
import logging
import threading
import time
import weakref
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn

from engine.kernels import fused_gemma4 as gemma4
from engine.kernels.build import kernels
from engine.kernels.governor import governor
from engine.kernels.experts import PackedExperts
from engine.kernels.fused_rules import (ACTS, LINEARS, ROUTERS, activation, dense_rows, experts_of, fill_delta,
                                       fill_linear, linears_of, norm_eps, norm_weight, norms_of, refusal, router_of,
                                       rotary_width)
from engine.kernels.linear import QmLinear
from engine.kernels.fused_views import Buffers, View, node_inputs, pending_outputs, state_fits
from engine.model.cache import KVCache
from engine.model.hybrid_cache import HybridCache
from engine.model.linear_state import LinearLayerState, LinearPending
from engine.model.window_cache import WindowedCache

if TYPE_CHECKING:
    from engine.model.causal_lm import CausalLM

log = logging.getLogger(__name__)

_keys = itertools.count()
# a hybrid's tree passes up to this many tokens take the C pass: it keeps every node's recurrent
# state (dk x dv a value head) while it runs, where the general path's block form keeps none
HYBRID_PASS_TOKENS = 64
class Layer(ctypes.Structure):
    """qmatmul.c's qm_layer."""
    _fields_ = [*((name, QmLinear) for name, _ in LINEARS),
                ("attn_norm", ctypes.c_void_p), ("mlp_norm", ctypes.c_void_p), ("q_norm", ctypes.c_void_p),
                ("k_norm", ctypes.c_void_p),
                ("attn_eps", ctypes.c_float), ("mlp_eps", ctypes.c_float), ("q_eps", ctypes.c_float),
                ("k_eps", ctypes.c_float),
                ("router", ctypes.c_void_p), ("expert_gate_up", ctypes.c_void_p), ("expert_down", ctypes.c_void_p),
                ("hits", ctypes.c_void_p), ("experts", ctypes.c_int64), ("top_k", ctypes.c_int64),
                ("norm_topk", ctypes.c_int64),
                ("sinks", ctypes.c_void_p), ("router_bias", ctypes.c_void_p), ("expert_gate", ctypes.c_void_p),
                ("topk_softmax", ctypes.c_int64),
                ("post_attn_norm", ctypes.c_void_p), ("post_mlp_norm", ctypes.c_void_p), ("post_attn_eps", ctypes.c_float),
                ("post_mlp_eps", ctypes.c_float), ("act", ctypes.c_int64),
                ("rotary_dim", ctypes.c_int64), ("sigmoid_router", ctypes.c_int64), ("score_bias", ctypes.c_void_p),
                ("routed_scale", ctypes.c_float),
                ("attn_gate", ctypes.c_int64), ("shared_gate", ctypes.c_void_p),
                ("lin_qkv", QmLinear), ("lin_z", QmLinear),
                *((name, ctypes.c_void_p) for name in ("lin_ba", "conv_w", "conv_b", "neg_a", "dt_bias", "gnorm")),
                ("gnorm_eps", ctypes.c_float),
                *((name, ctypes.c_int64) for name in ("lin_kh", "lin_vh", "lin_dk", "lin_dv", "kernel", "lin_tiled")),
                *((name, ctypes.c_int64) for name in ("layer_head_dim", "layer_kv_heads", "kv_same", "v_norm", "rope_width")),
                *((name, ctypes.c_float) for name in ("v_eps", "layer_scale", "router_root", "router_eps", "pre_experts_eps",
                                                      "post_experts_eps", "post_mlp1_eps")),
                *((name, ctypes.c_void_p) for name in ("router_scale", "expert_scale", "pre_experts_norm",
                                                       "post_experts_norm", "post_mlp1_norm")),
                *((name, ctypes.c_int64) for name in ("kv_reuse", "ple_dim", "ple_stride")), ("ple_gate", QmLinear),
                ("ple_out", QmLinear), ("ple_proj", ctypes.c_void_p), ("ple_norm", ctypes.c_void_p), ("ple_eps", ctypes.c_float)]


INTERRUPT_RUNS = 8  # an interruptible pass's runs of layers: a Stop waits for one (CausalLM.interruptible)


def interrupt_every(layers: int) -> int:
    """An interruptible pass over `layers` layers checks its Stop before every this many."""
    return -(-layers // INTERRUPT_RUNS)


class PassInterrupted(Exception):
    """A pass stopped between its runs of layers (its `stop` set): nothing of it was committed to
    the cache."""


class FusedDecoder:
    """The fused plain decoding step of one CausalLM (see the module docstring)."""

    def __init__(self, model: CausalLM, lib: ctypes.CDLL) -> None:
        # the model's outer modules, not the model (which holds this object: no reference cycle),
        # and where Gemma 4 has per-layer inputs its inner model, which computes them
        self.embed, self.rotary, self.norm, self.device = model.embed, model.rotary, model.norm, model.device
        self.inner = model.inner if model.per_layer_inputs else None
        attn: Any = next(layer.self_attn for layer in model.layers if hasattr(layer, "self_attn"))
        cfg = model.config
        self.heads = int(cfg.num_attention_heads)
        # Gemma 4: each layer's (K/V heads, head width), the call's being the first layer's
        self.gemma4 = cfg.model_type == "gemma4_text"
        self.shapes = gemma4.shapes(model) if self.gemma4 else None
        self.kv_of = gemma4.stores(model) if self.gemma4 else None  # (a K/V-reusing layer reads another's buffers)
        self.cache_shapes = [tuple(s) for s in model.kv_shapes] if model.kv_shapes else None
        self.kv_heads, self.head_dim = self.shapes[0] if self.shapes else (int(cfg.num_key_value_heads), int(attn.head_dim))
        self.hidden = int(cfg.hidden_size)
        self.scale = float(attn.scaling)
        self.layers = (Layer * len(model.layers))()
        self._held: list[object] = []  # what the structs point into, alive as long as they are
        layer: Any
        # an MoE's routed layers (the step counts their routed tokens into each PackedExperts.hits)
        moe: list[PackedExperts] = [e for layer in model.layers if isinstance(e := experts_of(layer), PackedExperts)]
        self.moe = bool(moe)
        self._experts = moe
        # gpt-oss: its cos/sin are half a head wide (each frequency rotates x[i] with x[i + D/2])
        self.half_rotary = cfg.model_type == "gpt_oss"
        # the values of a head its rotary tables rotate (GLM-4.5: the first half; the rest pass)
        self.rotary_dim = rotary_width(model) * (2 if self.half_rotary else 1)
        # sliding windows: each layer's index into the model's window sizes (-1: full attention)
        self.windows: list[int] = list(model.windows)
        self.window_of = [self.windows.index(k.window) if k.window is not None else -1 for k in model.kinds]
        self.layer_windows = tuple(k.window for k in model.kinds)
        # rotary tables: one per layer type where the family has several (Gemma 3: local and global)
        self.rope_types: list[str] | None = sorted(set(model.layer_types)) if model.family.rotary_per_type else None
        self.rope_of = [self.rope_types.index(t) for t in model.layer_types] if self.rope_types else [0] * len(model.layers)
        self.rope_width = max(d for _, d in self.shapes) if self.shapes else 0  # Gemma 4's tables padded to the widest
        # hybrids: each layer's Gated DeltaNet state shape (None: attention); see takes()
        self.linear = list(model.linear)
        self.hybrid = any(s is not None for s in self.linear)
        for layer, struct, kind in zip(model.layers, self.layers, model.kinds):
            experts = experts_of(layer)
            if isinstance(experts, PackedExperts):
                assert experts._fused is not None
                self._held += [experts._fused, experts.hits]
                struct.expert_gate_up = ctypes.addressof(experts._fused[0])
                struct.expert_down = ctypes.addressof(experts._fused[1])
                assert experts.hits.dtype == torch.int64 and experts.hits.is_contiguous()
                struct.hits = experts.hits.data_ptr()  # incremented in place (the tensor is never replaced)
                struct.experts = experts.num_experts
                if experts._fused[2] is not None:
                    struct.expert_gate = ctypes.addressof(experts._fused[2])
            if isinstance(experts, PackedExperts) and self.gemma4:  # its router: gemma4.fill
                struct.top_k = int(layer.router.config.top_k_experts)
            elif isinstance(experts, PackedExperts):
                router = router_of(layer.mlp)
                self._held.append(router.weight)
                struct.router = router.weight.data_ptr()
                struct.top_k = int(router.top_k)
                struct.norm_topk = int(bool(getattr(router, "norm_topk_prob", True)))
                mode = ROUTERS[type(router).__name__][1]
                if mode == "gpt_oss":  # its router: biased logits, top-k, softmax of those
                    struct.topk_softmax = 1
                    struct.router_bias = router.bias.data_ptr()
                    self._held.append(router.bias)
                elif mode == "sigmoid":  # GLM-4.5's: sigmoid scores, biased choice
                    struct.sigmoid_router = 1
                    struct.score_bias = router.e_score_correction_bias.data_ptr()
                    struct.routed_scale = float(router.routed_scaling_factor)
                    self._held.append(router.e_score_correction_bias)
            for field, path in linears_of(layer):
                self._held.append(fill_linear(getattr(struct, field), layer.get_submodule(path)))
            shared_gate = getattr(layer.mlp, "shared_expert_gate", None)
            if shared_gate is not None:  # Qwen3.5-MoE's shared expert, scaled by sigmoid(gate . x)
                rows = dense_rows(shared_gate)
                assert rows is not None
                self._held.append(rows)
                struct.shared_gate = rows.data_ptr()
            struct.attn_gate = int(kind.gated)
            if kind.mixer == "linear":
                self._held += fill_delta(struct, layer.linear_attn)
            sa: Any = getattr(layer, "self_attn", None)
            sinks = getattr(sa, "sinks", None)
            if sinks is not None:
                self._held.append(sinks)
                struct.sinks = sinks.data_ptr()
            for name, norm in norms_of(layer).items():
                if norm is not None:
                    weight = norm_weight(norm)
                    self._held.append(weight)
                    setattr(struct, f"{name}_norm", weight.data_ptr())
                    setattr(struct, f"{name}_eps", norm_eps(norm))
            struct.act = ACTS[activation(cfg)]
            struct.rotary_dim = self.rotary_dim if self.rotary_dim != self.head_dim else 0
            if self.gemma4:
                self._held += gemma4.fill(struct, layer, (self.kv_heads, self.head_dim), self.rope_width, len(self.layers))
        fn = lib.qm_decode_layers
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, *[ctypes.c_int64] * 6, ctypes.c_void_p, ctypes.c_float,
                       ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int]
        self._fn = fn
        many = lib.qm_pass_layers
        many.restype = ctypes.c_int
        many.argtypes = [ctypes.c_void_p, ctypes.c_void_p, *[ctypes.c_int64] * 7, ctypes.c_void_p, ctypes.c_void_p,
                         ctypes.c_float, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                         ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int]
        self._many = many
        # each cache's buffer addresses, read again when its buffers change (reserve() grew it)
        self._buffers: weakref.WeakKeyDictionary[KVCache, Buffers] = weakref.WeakKeyDictionary()
        self._key = next(_keys)  # this model's steps, to the thread governor

    @classmethod
    def of(cls, model: CausalLM) -> FusedDecoder | None:
        """The fused path for `model`, or None where it does not qualify (logged at DEBUG)."""
        why = refusal(model)
        if why is None:
            lib = kernels()
            why = ("no packed kernel library" if lib is None or not hasattr(lib, "qm_decode_layers")
                   or not hasattr(lib, "qm_pass_layers") else None)
        if why is not None:
            log.debug("fused decoding step off: %s", why)
            return None
        assert lib is not None
        return cls(model, lib)

    def takes(self, cache: KVCache, n: int = 1, allowed: torch.Tensor | None = None) -> bool:
        """Whether a step or pass of n tokens under `allowed` can run on `cache` here: a plain
        KVCache of this model's shape, or a WindowedCache of its windows (and no expert of an
        MoE cached elsewhere: engine.kernels.expert_cache). A hybrid's on a HybridCache with
        nothing pending: committed text (no mask: a plain decoding step, or a prompt's chunk,
        folded into the states), or a tree of up to HYBRID_PASS_TOKENS (its nodes' inputs handed
        back to the cache)."""
        if self.hybrid and not (isinstance(cache, HybridCache) and cache.complete and (
                allowed is None or n <= HYBRID_PASS_TOKENS)):
            return False
        return self._addresses(cache) is not None and not any(e.hot_ids for e in self._experts)

    def _addresses(self, cache: KVCache) -> Buffers | None:
        """`cache`'s buffer addresses (kept per cache, read again when a buffer was replaced), or
        None when the cache is not one of this model's shape. Nothing shared is rewritten per
        step, so two caches may run at once."""
        windowed = type(cache) is WindowedCache
        plain = type(cache) is (HybridCache if self.hybrid else KVCache)
        if not (plain and not self.windows or windowed and self.windows) or \
                cache.layer_shapes is not None and list(cache.layer_shapes) != self.cache_shapes:
            return None
        if windowed and cast(WindowedCache, cache).windows != self.layer_windows:
            return None
        known = self._buffers.get(cache)
        if known is not None and known.holds(cache):
            return known
        attention = [i for i, s in enumerate(self.linear) if s is None]  # (a hybrid's linear layers hold no K/V)
        want = self.cache_shapes or [(self.kv_heads, self.head_dim)] * len(self.layers)
        attention = [i for i in attention if want[i][1]]  # (a K/V-reusing layer holds none)
        if (len(cache.keys) != len(self.layers) or cache.device.type != "cpu"
                or any(b.dtype != torch.float32 or b.dim() != 4 or tuple(b.shape[:2]) != (1, want[i][0])
                       or b.shape[3] != want[i][1] or not b.is_contiguous()
                       for i in attention for b in (cache.keys[i], cache.values[i]))):
            return None
        if self.hybrid and any(not state_fits(cast(HybridCache, cache).states.get(i), s)
                               for i, s in enumerate(self.linear) if s is not None):
            return None
        known = self._buffers[cache] = Buffers(cache, self.window_of, self.rope_of, self.kv_of)
        return known

    def _room(self, cache: KVCache, n: int) -> Buffers:
        """The buffers of `cache` with room for n new entries in every layer (a windowed
        layer's buffers grow apart from the rest: WindowedCache.make_room)."""
        if isinstance(cache, WindowedCache):
            cache.make_room(n)
        buffers = self._addresses(cache)
        assert buffers is not None, "call takes(cache) first"
        return buffers

    def _spans(self, cache: KVCache, first: int | None) -> ctypes.Array | None:
        """(base, lo) for each window: the entry of its layers' buffer column 0 and the first
        column a token at position `first` reads (first None: 0, a pass's masks say); None
        without windows."""
        if not self.windows:
            return None
        assert isinstance(cache, WindowedCache)
        spans = (ctypes.c_int64 * (2 * len(self.windows)))()
        for i, w in enumerate(self.windows):
            base = cache.held_from(w)
            spans[2 * i] = base
            if first is not None:  # the held entries at positions the window has left (committed text: a prefix)
                spans[2 * i + 1] = int((cache.positions[base: cache.length] <= first - w).sum())
        return spans

    def _pieces(self, grab: tuple[int, ...], every: int = 0) -> list[tuple[int, int]]:
        """The runs of layers [a, b) between the layers whose inputs are kept (CausalLM.aux_inputs),
        and with `every`, cut at least every that many layers."""
        n = len(self.layers)
        cuts = sorted({0, n, *(j for j in grab if 0 < j < n), *(range(every, n, every) if every else ())})
        return list(zip(cuts, cuts[1:]))

    def _at(self, buffers: Buffers, a: int) -> tuple[int, int]:
        """The addresses of layer a's struct and its view (a run from layer a)."""
        return (ctypes.addressof(self.layers) + a * ctypes.sizeof(Layer),
                ctypes.addressof(buffers.views) + a * ctypes.sizeof(View))

    def _rope(self, hidden: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin (tables, n, head_dim) in fp32 for the C rotation (x * cos + rotate_half(x) *
        sin): one table, or one per layer type (a view's `rope` picks it)."""
        if self.rope_types:
            pairs = [self.rotary(hidden, positions[None], t) for t in self.rope_types]
            if self.rope_width:  # Gemma 4's: each type's table its heads' width, padded to the widest
                cos, sin = gemma4.padded([c for c, _ in pairs], self.rope_width), gemma4.padded([s for _, s in pairs], self.rope_width)
            else:
                cos, sin = torch.cat([c for c, _ in pairs]), torch.cat([s for _, s in pairs])
        else:
            cos, sin = self.rotary(hidden, position_ids=positions[None])
        if self.half_rotary:  # gpt-oss's halves rotate by the same frequencies
            cos, sin = torch.cat((cos, cos), dim=-1), torch.cat((sin, sin), dim=-1)
        return cos.float().contiguous(), sin.float().contiguous()

    def step(self, input_ids: torch.Tensor, positions: torch.Tensor, cache: KVCache, grab: tuple[int, ...] = (),
             kept: dict[int, torch.Tensor] | None = None) -> torch.Tensor:
        """One token (input_ids and positions of shape (1,)) through every layer; its K/V
        appended to `cache` (reserved and positioned by the caller; `takes(cache)` true). The
        final normed hidden state (1, hidden), as CausalLM.forward returns it. `grab`: layers
        whose inputs go into `kept` (by layer; the layers run in pieces between them)."""
        buffers = self._room(cache, 1)
        spans = self._spans(cache, int(positions[0]) if self.windows else None)
        hidden = self.embed(input_ids.to(self.device)[None]).float().contiguous()  # (1, 1, H)
        cos, sin = self._rope(hidden, positions)  # (1, 1, D) each
        ple = gemma4.layer_inputs(self.inner, input_ids, hidden)
        chosen = governor()
        threads = chosen.threads()
        start = time.perf_counter()
        for a, b in self._pieces(grab):
            if a in grab and kept is not None:
                kept[a] = hidden[0].clone()
            layers, views = self._at(buffers, a)
            rc = self._fn(layers, views, b - a, self.hidden, self.heads, self.kv_heads, self.head_dim, cache.length,
                          spans, self.scale, cos.data_ptr(), sin.data_ptr(), hidden.data_ptr(), gemma4.at(ple, a), threads)
            if rc != 0:
                raise torch.OutOfMemoryError("The fused CPU decoding step could not allocate its scratch memory.")
        chosen.record(self._key, threads, time.perf_counter() - start)
        if isinstance(cache, HybridCache):
            cache.folded(1)  # the C step folded the token into each Gated DeltaNet layer's state
        else:
            cache.commit(1)
        out: torch.Tensor = self.norm(hidden[0])  # (1, H)
        return out

    def pass_(self, input_ids: torch.Tensor, positions: torch.Tensor, cache: KVCache, allowed: torch.Tensor | None,
              grab: tuple[int, ...] = (), kept: dict[int, torch.Tensor] | None = None,
              stop: threading.Event | None = None) -> torch.Tensor:
        """n tokens (a tree's nodes, or a chain) through every layer in one C call (with `stop`,
        a C call a run of layers, PassInterrupted raised between runs once it is set); their K/V
        appended to `cache` (reserved and positioned by the caller; `takes(cache)` true).
        allowed: (n, cache.length + n) bool, what each token attends to; None: a causal chain.
        The final normed hidden states (n, hidden), as CausalLM.forward returns them. `grab`,
        `kept`: as in `step`."""
        buffers = self._room(cache, int(input_ids.shape[0]))
        n, past = int(input_ids.shape[0]), cache.length
        parents, pending = None, {}
        saved: dict[int, LinearLayerState] = {}
        fold = self.hybrid and allowed is None  # committed text: folded into the Gated DeltaNet states in place
        if self.hybrid:  # each node's parent (-1: the committed state), and where its inputs go
            assert isinstance(cache, HybridCache)
            pending = pending_outputs(self.linear, buffers, n)
            if fold:  # a Stop between runs puts back the states the runs before it advanced
                saved = {i: cache.states[i].clone() for i in pending} if stop is not None else {}
            else:
                cache.begin_pass(allowed, n, tables=False)
                parents = (cache.parents[past : past + n] - past).contiguous()
        mask = None
        if allowed is not None:
            assert tuple(allowed.shape) == (n, past + n), "allowed: (n, cache.length + n)"
            mask = allowed.to(device="cpu", dtype=torch.bool).contiguous()
        spans = self._spans(cache, None)
        masks, held = None, []
        if self.windows:  # each window's layers: the mask from their first column, within the window
            assert isinstance(cache, WindowedCache)
            base = mask if mask is not None else torch.ones(n, past + n, dtype=torch.bool).tril(past)
            at = positions.to("cpu")
            for w in self.windows:
                first = cache.held_from(w)
                near = (at[:, None] - cache.positions_through(n)[first:].to("cpu")[None, :]) < w
                held.append((base[:, first:] & near).contiguous())
            masks = (ctypes.c_void_p * len(held))(*(m.data_ptr() for m in held))
        hidden = self.embed(input_ids.to(self.device)[None]).float().contiguous()  # (1, n, H)
        cos, sin = self._rope(hidden, positions)  # (1, n, D) each
        ple = gemma4.layer_inputs(self.inner, input_ids, hidden)
        threads = governor().threads()
        before = [e.hits.clone() for e in self._experts]  # the pass counts its routed tokens into hits
        for a, b in self._pieces(grab, interrupt_every(len(self.layers)) if stop is not None else 0):
            if stop is not None and a > 0 and stop.is_set():  # nothing committed: the cache is as it was
                for e, seen in zip(self._experts, before):
                    e.hits.copy_(seen)
                for i, before_pass in saved.items():  # in place: the C views point at these tensors
                    now = cast(HybridCache, cache).states[i]
                    now.conv.copy_(before_pass.conv)
                    now.recurrent.copy_(before_pass.recurrent)
                raise PassInterrupted(f"stopped before layer {a}")
            if a in grab and kept is not None:
                kept[a] = hidden[0].clone()
            layers, views = self._at(buffers, a)
            rc = self._many(layers, views, b - a, self.hidden, self.heads, self.kv_heads, self.head_dim, past, n,
                            spans, masks, self.scale, cos.data_ptr(), sin.data_ptr(),
                            mask.data_ptr() if mask is not None else None,
                            parents.data_ptr() if parents is not None else None, hidden.data_ptr(), gemma4.at(ple, a),
                            threads)
            if rc != 0:
                raise torch.OutOfMemoryError("The fused CPU pass could not allocate its scratch memory.")
        for e, seen in zip(self._experts, before):  # the union each layer woke, for the tree's price
            e.logged(e.hits - seen, n)
        if fold:
            cast(HybridCache, cache).folded(n)
        else:
            for i, outputs in pending.items():  # kept by the cache until the accepted path is known
                assert isinstance(cache, HybridCache)
                cache.linear_pending(i, LinearPending(n, node_inputs(self.linear[i], *outputs), None))
            cache.commit(n)
        out: torch.Tensor = self.norm(hidden[0])  # (n, H)
        return out
