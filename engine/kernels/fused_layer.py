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
rotary table), or Qwen3-MoE, Mixtral and gpt-oss
layers whose routed experts are all packed with the one-token experts kernel
(PackedExperts._fused: the step and the pass run their router as transformers does, softmax,
top-k, renormalised, or gpt-oss's biased logits, top-k, softmax of those; each token's experts
summed in expert order, with gpt-oss's gate and biases, counting the routed tokens into each
PackedExperts.hits; a pass reads each woken expert once for all its tokens and logs the union
it woke), all resident on the CPU in fp32, attention full or over a sliding window (the layer's
own, as engine.model.family reads it: a WindowedCache's buffers, each window's layers from
their own first column) with gpt-oss's sinks where it has them, SiLU or GELU (tanh) MLPs,
every Linear of every layer a PackedLinear (minimums, where present, in groups of 16 or 32).
`takes(cache)` says per step whether the cache is a plain KVCache, or a WindowedCache of the
model's windows, of this shape. SPECCHAT_NO_FUSED=1 in the environment (read when a model is loaded) switches the path
off.

`pass_` runs several tokens the same way (qmatmul.c's `qm_pass_layers`): a tree's nodes under
their mask, or a chain (a prompt's chunk), each weight tile decoded once for all of them. A
draft-free tree on the starter then costs a few milliseconds more than a plain step, not the
general path's ~20 ms of Python and small operations, so trees pay on a CPU again.

What this module does not do: streamed layers, shared experts, hybrids, per-layer shapes or
GPUs (CausalLM.forward's general path runs those), or choose which weights are packed.
"""

from __future__ import annotations

import ctypes
import itertools
import logging
import os
import time
import weakref
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn

from engine.kernels.build import kernels
from engine.kernels.governor import governor
from engine.kernels.experts import PackedExperts
from engine.kernels.linear import PackedLinear, QmLinear
from engine.model.cache import KVCache
from engine.model.window_cache import WindowedCache

if TYPE_CHECKING:
    from engine.model.causal_lm import CausalLM

log = logging.getLogger(__name__)

_keys = itertools.count()
FAMILIES = {"llama": "Llama", "mistral": "Mistral", "qwen2": "Qwen2", "qwen3": "Qwen3", "gemma3_text": "Gemma3"}
# the MLP gates the step runs (qm_layer.act), by the config's activation name
ACTS = {"silu": 0, "gelu_pytorch_tanh": 1}
# MoE families whose routed layers the step runs too (router: softmax, top-k, renormalised where the
# config says; no shared expert): model type -> (class prefix, whether the top-k is renormalised)
MOE_FAMILIES = {"qwen3_moe": "Qwen3Moe", "mixtral": "Mixtral", "gpt_oss": "GptOss", "glm4_moe": "Glm4Moe"}
# an MoE layer's shared expert (GLM-4.5), a dense MLP beside the routed experts: qm_layer's gate/up/down
SHARED = (("gate", "mlp.shared_experts.gate_proj"), ("up", "mlp.shared_experts.up_proj"),
          ("down", "mlp.shared_experts.down_proj"))
LINEARS = (("q", "self_attn.q_proj"), ("k", "self_attn.k_proj"), ("v", "self_attn.v_proj"),
           ("o", "self_attn.o_proj"), ("gate", "mlp.gate_proj"), ("up", "mlp.up_proj"), ("down", "mlp.down_proj"))


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
                ("routed_scale", ctypes.c_float)]


class View(ctypes.Structure):
    """qmatmul.c's qm_view: a layer's K/V buffers, their capacity, and which window (-1: none)."""
    _fields_ = [("keys", ctypes.c_void_p), ("values", ctypes.c_void_p), ("capacity", ctypes.c_int64),
                ("window", ctypes.c_int64), ("rope", ctypes.c_int64)]


def disabled() -> bool:
    """SPECCHAT_NO_FUSED=1 (anything but empty or 0): every model keeps the general path."""
    return os.environ.get("SPECCHAT_NO_FUSED", "").strip() not in ("", "0")


class FusedDecoder:
    """The fused plain decoding step of one CausalLM (see the module docstring)."""

    def __init__(self, model: CausalLM, lib: ctypes.CDLL) -> None:
        # the model's outer modules, not the model (which holds this object: no reference cycle)
        self.embed, self.rotary, self.norm, self.device = model.embed, model.rotary, model.norm, model.device
        attn: Any = model.layers[0].self_attn
        cfg = model.config
        self.heads = int(cfg.num_attention_heads)
        self.kv_heads = int(cfg.num_key_value_heads)
        self.head_dim = int(attn.head_dim)
        self.hidden = int(cfg.hidden_size)
        self.scale = float(attn.scaling)
        self.layers = (Layer * len(model.layers))()
        self._held: list[object] = []  # what the structs point into, alive as long as they are
        layer: Any
        # an MoE's routed layers (the step counts their routed tokens into each PackedExperts.hits)
        moe: list[PackedExperts] = [e for layer in model.layers
                                    if isinstance(e := getattr(layer.get_submodule("mlp"), "experts", None), PackedExperts)]
        self.moe = bool(moe)
        self._experts = moe
        # gpt-oss: its cos/sin are half a head wide (each frequency rotates x[i] with x[i + D/2])
        self.half_rotary = cfg.model_type == "gpt_oss"
        # the values of a head its rotary tables rotate (GLM-4.5: the first half; the rest pass)
        self.rotary_dim = _rotary_width(model) * (2 if self.half_rotary else 1)
        # sliding windows: each layer's index into the model's window sizes (-1: full attention)
        self.windows: list[int] = list(model.windows)
        self.window_of = [self.windows.index(k.window) if k.window is not None else -1 for k in model.kinds]
        self.layer_windows = tuple(k.window for k in model.kinds)
        # rotary tables: one per layer type where the family has several (Gemma 3: local and global)
        self.rope_types: list[str] | None = sorted(set(model.layer_types)) if model.family.rotary_per_type else None
        self.rope_of = [self.rope_types.index(t) for t in model.layer_types] if self.rope_types else [0] * len(model.layers)
        for layer, struct in zip(model.layers, self.layers):
            block = getattr(layer.mlp, "experts", None)
            if isinstance(block, PackedExperts):
                experts = block
                assert experts._fused is not None
                router = _router(layer.mlp)
                self._held += [router.weight, experts._fused, experts.hits]
                struct.router = router.weight.data_ptr()
                struct.expert_gate_up = ctypes.addressof(experts._fused[0])
                struct.expert_down = ctypes.addressof(experts._fused[1])
                assert experts.hits.dtype == torch.int64 and experts.hits.is_contiguous()
                struct.hits = experts.hits.data_ptr()  # incremented in place (the tensor is never replaced)
                struct.experts, struct.top_k = experts.num_experts, int(router.top_k)
                struct.norm_topk = int(bool(getattr(router, "norm_topk_prob", True)))
                if cfg.model_type == "gpt_oss":  # its router: biased logits, top-k, softmax of those
                    struct.topk_softmax = 1
                    struct.router_bias = router.bias.data_ptr()
                    self._held.append(router.bias)
                if ROUTERS[type(router).__name__][1] == "sigmoid":  # GLM-4.5's: sigmoid scores, biased choice
                    struct.sigmoid_router = 1
                    struct.score_bias = router.e_score_correction_bias.data_ptr()
                    struct.routed_scale = float(router.routed_scaling_factor)
                    self._held.append(router.e_score_correction_bias)
                gate = experts._fused[2]
                if gate is not None:
                    struct.expert_gate = ctypes.addressof(gate)
            for field, path in _linears(layer):
                self._held.append(_fill_linear(getattr(struct, field), layer.get_submodule(path)))
            sa: Any = layer.self_attn
            sinks = getattr(sa, "sinks", None)
            if sinks is not None:
                self._held.append(sinks)
                struct.sinks = sinks.data_ptr()
            for name, norm in _norms(layer).items():
                if norm is not None:
                    weight = _norm_weight(norm)
                    self._held.append(weight)
                    setattr(struct, f"{name}_norm", weight.data_ptr())
                    setattr(struct, f"{name}_eps", _eps(norm))
            struct.act = ACTS[_activation(cfg)]
            struct.rotary_dim = self.rotary_dim if self.rotary_dim != self.head_dim else 0
        fn = lib.qm_decode_layers
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, *[ctypes.c_int64] * 6, ctypes.c_void_p, ctypes.c_float,
                       ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int]
        self._fn = fn
        many = lib.qm_pass_layers
        many.restype = ctypes.c_int
        many.argtypes = [ctypes.c_void_p, ctypes.c_void_p, *[ctypes.c_int64] * 7, ctypes.c_void_p, ctypes.c_void_p,
                         ctypes.c_float, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int]
        self._many = many
        # each cache's buffer addresses, read again when its buffers change (reserve() grew it)
        self._buffers: weakref.WeakKeyDictionary[KVCache, _Buffers] = weakref.WeakKeyDictionary()
        self._key = next(_keys)  # this model's steps, to the thread governor

    @classmethod
    def of(cls, model: CausalLM) -> FusedDecoder | None:
        """The fused path for `model`, or None where it does not qualify (logged at DEBUG)."""
        why = _refusal(model)
        if why is None:
            lib = kernels()
            why = ("no packed kernel library" if lib is None or not hasattr(lib, "qm_decode_layers")
                   or not hasattr(lib, "qm_pass_layers") else None)
        if why is not None:
            log.debug("fused decoding step off: %s", why)
            return None
        assert lib is not None
        return cls(model, lib)

    def takes(self, cache: KVCache) -> bool:
        """Whether a step on `cache` can run here: a plain KVCache of this model's shape, or a
        WindowedCache of its windows (and no expert of an MoE cached elsewhere:
        engine.kernels.expert_cache)."""
        return self._addresses(cache) is not None and not any(e.hot_ids for e in self._experts)

    def _addresses(self, cache: KVCache) -> _Buffers | None:
        """`cache`'s buffer addresses (kept per cache, read again when a buffer was replaced), or
        None when the cache is not one of this model's shape. Nothing shared is rewritten per
        step, so two caches may run at once."""
        windowed = type(cache) is WindowedCache
        if not (type(cache) is KVCache and not self.windows or windowed and self.windows) or cache.layer_shapes is not None:
            return None
        if windowed and cast(WindowedCache, cache).windows != self.layer_windows:
            return None
        known = self._buffers.get(cache)
        if known is not None and known.holds(cache):
            return known
        if (len(cache.keys) != len(self.layers) or cache.device.type != "cpu"
                or any(b.dtype != torch.float32 or b.dim() != 4 or tuple(b.shape[:2]) != (1, self.kv_heads)
                       or b.shape[3] != self.head_dim or not b.is_contiguous() for b in cache.keys + cache.values)):
            return None
        known = self._buffers[cache] = _Buffers(cache, self.window_of, self.rope_of)
        return known

    def _room(self, cache: KVCache, n: int) -> _Buffers:
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

    def _pieces(self, grab: tuple[int, ...]) -> list[tuple[int, int]]:
        """The runs of layers [a, b) between the layers whose inputs are kept (CausalLM.aux_inputs)."""
        n = len(self.layers)
        cuts = sorted({0, n, *(j for j in grab if 0 < j < n)})
        return list(zip(cuts, cuts[1:]))

    def _at(self, buffers: _Buffers, a: int) -> tuple[int, int]:
        """The addresses of layer a's struct and its view (a run from layer a)."""
        return (ctypes.addressof(self.layers) + a * ctypes.sizeof(Layer),
                ctypes.addressof(buffers.views) + a * ctypes.sizeof(View))

    def _rope(self, hidden: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin (tables, n, head_dim) in fp32 for the C rotation (x * cos + rotate_half(x) *
        sin): one table, or one per layer type (a view's `rope` picks it)."""
        if self.rope_types:
            pairs = [self.rotary(hidden, positions[None], t) for t in self.rope_types]
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
        chosen = governor()
        threads = chosen.threads()
        start = time.perf_counter()
        for a, b in self._pieces(grab):
            if a in grab and kept is not None:
                kept[a] = hidden[0].clone()
            layers, views = self._at(buffers, a)
            rc = self._fn(layers, views, b - a, self.hidden, self.heads, self.kv_heads, self.head_dim, cache.length,
                          spans, self.scale, cos.data_ptr(), sin.data_ptr(), hidden.data_ptr(), threads)
            if rc != 0:
                raise torch.OutOfMemoryError("The fused CPU decoding step could not allocate its scratch memory.")
        chosen.record(self._key, threads, time.perf_counter() - start)
        cache.commit(1)
        out: torch.Tensor = self.norm(hidden[0])  # (1, H)
        return out

    def pass_(self, input_ids: torch.Tensor, positions: torch.Tensor, cache: KVCache, allowed: torch.Tensor | None,
              grab: tuple[int, ...] = (), kept: dict[int, torch.Tensor] | None = None) -> torch.Tensor:
        """n tokens (a tree's nodes, or a chain) through every layer in one C call; their K/V
        appended to `cache` (reserved and positioned by the caller; `takes(cache)` true).
        allowed: (n, cache.length + n) bool, what each token attends to; None: a causal chain.
        The final normed hidden states (n, hidden), as CausalLM.forward returns them. `grab`,
        `kept`: as in `step`."""
        buffers = self._room(cache, int(input_ids.shape[0]))
        n, past = int(input_ids.shape[0]), cache.length
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
        threads = governor().threads()
        before = [e.hits.clone() for e in self._experts]  # the pass counts its routed tokens into hits
        for a, b in self._pieces(grab):
            if a in grab and kept is not None:
                kept[a] = hidden[0].clone()
            layers, views = self._at(buffers, a)
            rc = self._many(layers, views, b - a, self.hidden, self.heads, self.kv_heads, self.head_dim, past, n,
                            spans, masks, self.scale, cos.data_ptr(), sin.data_ptr(),
                            mask.data_ptr() if mask is not None else None, hidden.data_ptr(), threads)
            if rc != 0:
                raise torch.OutOfMemoryError("The fused CPU pass could not allocate its scratch memory.")
        for e, seen in zip(self._experts, before):  # the union each layer woke, for the tree's price
            e.logged(e.hits - seen, n)
        cache.commit(n)
        out: torch.Tensor = self.norm(hidden[0])  # (n, H)
        return out


class _Buffers:
    """One cache's K/V buffers as qm_view structs, and which buffers they are (weakly: a
    cache's buffers are replaced when it grows, a windowed layer's apart from the rest, and
    must be freed then)."""

    def __init__(self, cache: KVCache, window_of: list[int], rope_of: list[int]) -> None:
        n = len(cache.keys)
        self.views = (View * n)()
        for view, k, v, w, rope in zip(self.views, cache.keys, cache.values, window_of, rope_of):
            view.keys, view.values, view.capacity, view.window = k.data_ptr(), v.data_ptr(), int(k.shape[2]), w
            view.rope = rope
        self._refs = [weakref.ref(t) for t in (*cache.keys, *cache.values)]

    def holds(self, cache: KVCache) -> bool:
        """Whether these are still `cache`'s buffers."""
        return all(r() is t for r, t in zip(self._refs, (*cache.keys, *cache.values)))


def _norms(layer: nn.Module) -> dict[str, nn.Module | None]:
    """A decoder layer's RMSNorms by qm_layer's names: attn before attention, mlp before the MLP,
    Gemma 3's post_attn / post_mlp on their outputs (None where the layer has none)."""
    sa = getattr(layer, "self_attn", None)
    gemma = hasattr(layer, "pre_feedforward_layernorm")
    return {"attn": getattr(layer, "input_layernorm", None),
            "mlp": getattr(layer, "pre_feedforward_layernorm" if gemma else "post_attention_layernorm", None),
            "post_attn": getattr(layer, "post_attention_layernorm", None) if gemma else None,
            "post_mlp": getattr(layer, "post_feedforward_layernorm", None) if gemma else None,
            "q": getattr(sa, "q_norm", None), "k": getattr(sa, "k_norm", None)}


def _plus_one(norm: nn.Module) -> bool:
    """Whether an RMSNorm scales by 1 + weight (Gemma's) rather than by weight."""
    return type(norm).__name__.startswith("Gemma")


def _norm_weight(norm: nn.Module) -> torch.Tensor:
    """The fp32 factor the C norm multiplies by: the weight, or 1 + weight for Gemma's (computed
    in fp32 as Gemma3RMSNorm computes it)."""
    weight = cast(torch.Tensor, norm.weight).detach()
    return (1.0 + weight.float()).contiguous() if _plus_one(norm) else weight


def _eps(norm: nn.Module) -> float:
    return float(getattr(norm, "variance_epsilon", getattr(norm, "eps", 0.0)))


def _activation(cfg: Any) -> str:
    """The MLP's activation name (Gemma's config says hidden_activation)."""
    return str(getattr(cfg, "hidden_activation", None) or getattr(cfg, "hidden_act", None))


def _fill_linear(struct: QmLinear, module: nn.Module) -> tuple[object, ...]:
    """Point `struct` at a PackedLinear's weight and bias; returns what it points into."""
    assert isinstance(module, PackedLinear)
    struct.point_at(module.qweight, module.bias)
    return module.qweight, module.bias


def _router(block: nn.Module) -> Any:
    """An MoE block's router: gpt-oss's `router`, the others' `gate`."""
    return getattr(block, "router", None) or getattr(block, "gate", None)


# router class -> the block's modules beside it, and whether it is gpt-oss's (biased logits, top-k,
# softmax of those; its experts' own gate and biases)
ROUTERS = {"Qwen3MoeTopKRouter": ({"experts", "gate"}, "softmax"), "MixtralTopKRouter": ({"experts", "gate"}, "softmax"),
           "GptOssTopKRouter": ({"experts", "router"}, "gpt_oss"),
           "Glm4MoeTopkRouter": ({"experts", "gate", "shared_experts"}, "sigmoid")}


def _routed_refusal(block: nn.Module, hidden: int) -> str | None:
    """Why an MoE block cannot run in the step (its router and experts as the C code reads them),
    or None."""
    experts, router = getattr(block, "experts", None), _router(block)
    known = ROUTERS.get(type(router).__name__)
    if known is None or set(vars(block).get("_modules", {})) != known[0]:
        return "a router or block other than softmax top-k"
    if (not isinstance(experts, PackedExperts) or experts._fused is None
            or (experts._fused[2] is not None) != (known[1] == "gpt_oss")):
        return "routed experts the one-call kernel does not run"
    weight = getattr(router, "weight", None)
    if (not isinstance(weight, torch.Tensor) or weight.dtype != torch.float32 or not weight.is_contiguous()
            or tuple(weight.shape) != (experts.num_experts, hidden) or weight.device.type != "cpu"):
        return "router weight"
    bias = getattr(router, "bias", None)
    if known[1] == "gpt_oss" and not _vector(bias, experts.num_experts):
        return "router bias"
    if known[1] == "sigmoid" and (not _vector(getattr(router, "e_score_correction_bias", None), experts.num_experts)
                                  or int(getattr(router, "num_group", 0)) != int(getattr(router, "topk_group", -1))):
        return "router score bias, or expert groups left out"  # (groups all kept: the choice is over every expert)
    if not 0 < int(getattr(router, "top_k", 0)) <= experts.num_experts:
        return "router top_k"
    return None


def _refusal(model: CausalLM) -> str | None:
    """Why `model` cannot take the fused step, or None when it can."""
    if disabled():
        return "SPECCHAT_NO_FUSED"
    cfg = model.config
    prefix = FAMILIES.get(cfg.model_type) or MOE_FAMILIES.get(cfg.model_type)
    if prefix is None:
        return f"model type {cfg.model_type}"
    routed = cfg.model_type in MOE_FAMILIES
    if model.streamer is not None or model.device.type != "cpu" or model.dtype != torch.float32:
        return "not resident on the CPU in fp32"
    if any(k.mixer != "attention" or k.gated or k.shared_experts and cfg.model_type != "glm4_moe"
           or k.ffn != "dense" and not routed for k in model.kinds) or any(s is not None for s in model.linear):
        return "a layer other than attention (full or windowed) and a dense or routed MLP"
    if model.per_layer_inputs or model.family.layer_inputs or model.kv_shapes:
        return "per-layer inputs or shapes"
    if not model.layers:
        return "no decoder layers"
    if cfg.model_type != "gpt_oss" and _activation(cfg) not in ACTS:
        return f"activation {_activation(cfg)}"
    if getattr(cfg, "attn_logit_softcapping", None) is not None:
        return "attention logits soft-capped"
    heads, kv_heads = int(cfg.num_attention_heads), int(cfg.num_key_value_heads)
    layer: Any
    for layer, kind in zip(model.layers, model.kinds):
        attn: Any = getattr(layer, "self_attn", None)
        mlp = type(getattr(layer, "mlp", None)).__name__
        if type(layer).__name__ != f"{prefix}DecoderLayer" or type(attn).__name__ != f"{prefix}Attention" \
                or mlp not in (f"{prefix}MLP", f"{prefix}SparseMoeBlock", f"{prefix}MoE"):
            return f"layer modules {type(layer).__name__}"
        moe = mlp.endswith(("SparseMoeBlock", "MoE")) or cfg.model_type == "gpt_oss"
        if moe:
            why = _routed_refusal(layer.mlp, cfg.hidden_size)
            if why is not None:
                return why
        # the window the module applies: its own, or (Mistral's) its config's for every layer
        own = getattr(attn, "sliding_window", None) if hasattr(attn, "sliding_window") \
            else getattr(getattr(attn, "config", None), "sliding_window", None)
        if (own or None) != kind.window or not isinstance(getattr(attn, "head_dim", None), int):
            return "a sliding window other than the layer's, or an unknown head size"
        sinks = getattr(attn, "sinks", None)
        if kind.sinks != (sinks is not None) or sinks is not None and (
                sinks.dtype != torch.float32 or tuple(sinks.shape) != (heads,) or not sinks.is_contiguous()):
            return "attention sinks"
        d = attn.head_dim
        if d % 2 or heads % kv_heads:
            return "head sizes"
        named = _norms(layer)
        norms = [n for n in named.values() if n is not None]
        if named["attn"] is None or named["mlp"] is None or any(
                not type(n).__name__.endswith("RMSNorm") or not (hasattr(n, "variance_epsilon") or hasattr(n, "eps"))
                or n.weight.dtype != torch.float32 or _plus_one(n) != (cfg.model_type == "gemma3_text") for n in norms):
            return "norm modules"
        if moe and (named["post_attn"] is not None or named["post_mlp"] is not None):
            return "post-norms around routed experts"
        want = {"q": (heads * d, cfg.hidden_size), "k": (kv_heads * d, cfg.hidden_size),
                "v": (kv_heads * d, cfg.hidden_size), "o": (cfg.hidden_size, heads * d),
                "gate": (cfg.intermediate_size, cfg.hidden_size), "up": (cfg.intermediate_size, cfg.hidden_size),
                "down": (cfg.hidden_size, cfg.intermediate_size)}
        shared = getattr(layer.mlp, "shared_experts", None)
        if shared is not None:
            width = int(getattr(shared, "intermediate_size", 0))
            want.update(gate=(width, cfg.hidden_size), up=(width, cfg.hidden_size), down=(cfg.hidden_size, width))
        for field, path in _linears(layer):
            lin = layer.get_submodule(path)
            if not isinstance(lin, PackedLinear):
                return f"{path} is not packed"
            w = lin.qweight
            if (w.out_features, w.in_features) != want[field]:
                return f"{path} shape"
            if w.mins is not None and w.group not in (16, 32) or w.group % 8:
                return f"{path} groups of {w.group}"
            if lin.bias is not None and lin.bias.dtype != torch.float32:
                return f"{path} bias dtype"
    probe = torch.zeros(1, 1, cfg.hidden_size)
    at = torch.zeros(1, 1, dtype=torch.long)
    # the tables' width: a head's (gpt-oss's: half, see __init__), or GLM-4.5's partial rotary
    widths = {attn.head_dim // 2} if cfg.model_type == "gpt_oss" else \
        set(range(2, attn.head_dim + 1, 2)) if cfg.model_type == "glm4_moe" else {attn.head_dim}
    seen = set()
    for t in (sorted(set(model.layer_types)) if model.family.rotary_per_type else [None]):
        cos, sin = model.rotary(probe, at, t) if t is not None else model.rotary(probe, position_ids=at)
        seen.add(cos.shape[-1])
        if cos.shape[-1] not in widths or sin.shape != cos.shape:
            return "a partial rotary embedding"
    if len(seen) != 1:
        return "rotary tables of different widths"
    return None


def _rotary_width(model: CausalLM) -> int:
    """The width of the model's rotary tables (one for all layer types: _refusal)."""
    t = sorted(set(model.layer_types))[0] if model.family.rotary_per_type else None
    probe, at = torch.zeros(1, 1, int(model.config.hidden_size)), torch.zeros(1, 1, dtype=torch.long)
    cos, _ = model.rotary(probe, at, t) if t is not None else model.rotary(probe, position_ids=at)
    return int(cos.shape[-1])


def _linears(layer: nn.Module) -> tuple[tuple[str, str], ...]:
    """A layer's packed Linears by qm_layer's fields: attention's, then the dense MLP's, an MoE
    layer's shared expert's (GLM-4.5), or none beside routed experts."""
    mlp = getattr(layer, "mlp", None)
    if isinstance(getattr(mlp, "experts", None), PackedExperts) or type(getattr(mlp, "router", None)).__name__ in ROUTERS:
        return LINEARS[:4] + (SHARED if getattr(mlp, "shared_experts", None) is not None else ())
    return LINEARS


def _vector(t: object, n: int) -> bool:
    """Whether t is an fp32 (n,) tensor on the CPU, laid out plainly."""
    return (isinstance(t, torch.Tensor) and t.dtype == torch.float32 and tuple(t.shape) == (n,)
            and t.is_contiguous() and t.device.type == "cpu")
