"""A plain decoding step on a GPU in fixed buffers, replayed as CUDA graphs: one launch for each
run of decoder layers between routed experts, instead of ~70 eager operations a layer.

Why: `specchat bench gpu` measured the general path's decoder layer at 0.86 ms of launches and
Python on an H200 host before any weight is read (one tiny layer at one token), and an MoE whose
routed experts run on the CPU (`--experts cpu`) pays that in each of its 48 layers every token:
~41 ms, which caps Qwen3-30B-A3B's projection at ~0.5x llama.cpp's measured figure on an 8 GB card
(`bench plan --moe`). A step here is the same modules and functions (transformers' norms,
projections, rotary and SDPA attention, the model's router and experts), over buffers whose
shapes do not change between steps, so a CUDA graph can hold each run of layers:

- the token's K/V is written at a slot given by a device tensor (`index_copy_`), and attention
  reads the cache's whole capacity under a boolean mask of its valid entries (set per step,
  outside the graphs), so no shape depends on the cache's length;
- the embedding and the rotary cos/sin are computed eagerly once a step and copied into the
  graphs' inputs;
- a segment ends at an MoE layer's router: its normed input, top-k experts and weights come out,
  the experts run eagerly (PackedExperts: the hot set on the GPU, the rest packed on the CPU,
  as in the general path) and their sum is the next segment's input.

Graphs are captured per cache buffer set (a cache that grew has new buffers: captured again) and
dropped with it. Capture can fail (an operation a graph cannot hold, out of memory): the step
then runs the same functions eagerly and says why once. On the CPU nothing is captured and the
step is those functions run eagerly: the tests run it there against the general path and
transformers' own decoding, so the logic the GPU replays is the logic the CPU tests.

Qualifies (`LeanStep.of`): llama, mistral and qwen2/qwen3 dense layers and Qwen3-MoE / Mixtral
MoE layers, all resident on one CUDA device (no streamer), attention full (no sliding windows or
sinks), SDPA attention, full-width rotary. A step that must keep layer inputs for a draft head
(`grab`) or sees a mask takes the general path. SPECCHAT_NO_LEAN=1 switches the path off;
SPECCHAT_NO_GRAPHS=1 keeps it eager.

What this module does not do: passes of several tokens (trees, prompts: the general path), or
the fused C step on the CPU (engine.kernels.fused_layer), which a CPU model takes instead.
"""

from __future__ import annotations

import logging
import os
import sys
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from engine.model.cache import KVCache

if TYPE_CHECKING:
    from engine.model.causal_lm import CausalLM

log = logging.getLogger(__name__)

DENSE_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen3"})
MOE_TYPES = frozenset({"qwen3_moe", "mixtral"})


def _switched_off(name: str) -> bool:
    return os.environ.get(name, "").strip() not in ("", "0")


def refusal(model: CausalLM) -> str | None:
    """Why `model` cannot take the lean step (None: it can). Device aside: `LeanStep.of` checks it."""
    cfg = model.config
    kind = getattr(cfg, "model_type", "")
    if kind not in DENSE_TYPES | MOE_TYPES:
        return f"model type {kind!r}"
    if _switched_off("SPECCHAT_NO_LEAN"):
        return "SPECCHAT_NO_LEAN"
    if model.streamer is not None:
        return "layers are streamed"
    if model.windows or model.family.layer_inputs or model.per_layer_inputs or model.family.rotary_per_type:
        return "sliding windows or per-layer inputs"
    if getattr(cfg, "_attn_implementation", "sdpa") != "sdpa":
        return f"attention {cfg._attn_implementation!r}, not sdpa"
    if any(p.is_meta for p in model.hf_model.parameters()):
        return "layers on the meta device"
    modeling = sys.modules.get(type(model.layers[0]).__module__)
    if modeling is None or not callable(getattr(modeling, "apply_rotary_pos_emb", None)):
        return "no apply_rotary_pos_emb in the layers' module"
    layer: Any  # transformers' decoder layers: their submodules by name
    for i, layer in enumerate(model.layers):
        a = getattr(layer, "self_attn", None)
        if a is None or not all(hasattr(a, n) for n in ("q_proj", "k_proj", "v_proj", "o_proj", "head_dim", "scaling")):
            return f"layer {i}: not a q/k/v/o attention"
        if getattr(a, "sliding_window", None) or hasattr(a, "sinks"):
            return f"layer {i}: sliding window or sinks"
        if not hasattr(layer, "input_layernorm") or not hasattr(layer, "post_attention_layernorm"):
            return f"layer {i}: not a pre-norm layer"
        mlp = layer.mlp
        if _routed(mlp):
            if kind not in MOE_TYPES or hasattr(mlp, "shared_expert"):
                return f"layer {i}: an MoE block this step does not run"
        elif not all(hasattr(mlp, n) for n in ("gate_proj", "up_proj", "down_proj", "act_fn")):
            return f"layer {i}: not a gated MLP"
    return None


def _routed(mlp: nn.Module) -> bool:
    return hasattr(mlp, "gate") and hasattr(mlp, "experts") and hasattr(getattr(mlp, "gate"), "top_k")


@dataclass
class _Buffers:
    """One cache buffer set's fixed tensors and, on a GPU, its graphs (one per segment)."""

    key: tuple[int, ...]
    hidden: torch.Tensor  # (1, 1, H): the embedding in, each segment's residual stream
    cos: torch.Tensor  # (1, 1, D)
    sin: torch.Tensor
    slot: torch.Tensor  # (1,) long: the new entry's column
    mask: torch.Tensor  # (1, 1, 1, capacity) bool: the valid entries and the new one
    experts_out: torch.Tensor  # (1, 1, H): the last MoE layer's routed sum, read by the next segment
    outs: list[dict[str, torch.Tensor]] = field(default_factory=list)  # each segment's outputs
    graphs: list[Any] | None = None  # torch.cuda.CUDAGraph per segment, once captured


class LeanStep:
    """The lean one-token step of one model (see the module's docstring)."""

    def __init__(self, model: CausalLM) -> None:
        self.model = model
        self.layers: list[Any] = list(model.layers)  # transformers' decoder layers: their submodules by name
        modeling = sys.modules[type(model.layers[0]).__module__]
        self._rotate: Callable[..., tuple[torch.Tensor, torch.Tensor]] = modeling.apply_rotary_pos_emb
        self.moe = [_routed(layer.mlp) for layer in self.layers]
        # segments: runs of layers, each ending after an MoE layer's router (or at the last layer)
        self.segments: list[tuple[int, int]] = []
        start = 0
        for i, routed in enumerate(self.moe):
            if routed:
                self.segments.append((start, i + 1))
                start = i + 1
        self.segments.append((start, len(self.layers)))  # the dense rest and the final norm (maybe no layers)
        self.graphed = model.device.type == "cuda" and not _switched_off("SPECCHAT_NO_GRAPHS")
        self.why_eager: str | None = None if self.graphed else "not on a GPU" if model.device.type != "cuda" else \
            "SPECCHAT_NO_GRAPHS"
        self._buffers: weakref.WeakKeyDictionary[KVCache, _Buffers] = weakref.WeakKeyDictionary()
        self.steps = 0
        self.replays = 0  # graph launches (tests and the benchmark read them)
        self.captures = 0

    @classmethod
    def of(cls, model: CausalLM, anywhere: bool = False) -> LeanStep | None:
        """The lean step for `model`, or None where it does not qualify (logged at DEBUG). Only a
        model on a CUDA device takes it unless `anywhere` (the CPU tests)."""
        why = refusal(model)
        if why is None and model.device.type != "cuda" and not anywhere:
            why = "not on a GPU"
        if why is not None:
            log.debug("lean step off: %s", why)
            return None
        return cls(model)

    def takes(self, cache: KVCache, n: int, allowed: torch.Tensor | None, grab: tuple[int, ...]) -> bool:
        """Whether this step can run: one token seeing the whole cache, a plain KVCache of the
        model's device, no layer inputs to keep."""
        if n != 1 or grab or type(cache) is not KVCache or cache.device.type != self.model.device.type:
            return False
        return allowed is None or bool(allowed.all())

    # ---- the segments: the same modules and functions as transformers' layers ----

    def _attention(self, i: int, h: torch.Tensor, bufs: _Buffers, keys: torch.Tensor,
                   values: torch.Tensor) -> torch.Tensor:
        layer = self.layers[i]
        a = layer.self_attn
        x = layer.input_layernorm(h)
        shape = (1, 1, -1, a.head_dim)
        q, k, v = a.q_proj(x).view(shape), a.k_proj(x).view(shape), a.v_proj(x).view(shape)
        if hasattr(a, "q_norm"):
            q, k = a.q_norm(q), a.k_norm(k)
        q, k = self._rotate(q.transpose(1, 2), k.transpose(1, 2), bufs.cos, bufs.sin)
        keys.index_copy_(2, bufs.slot, k)
        values.index_copy_(2, bufs.slot, v.transpose(1, 2))
        out, _ = sdpa_attention_forward(a, q, keys, values, bufs.mask, dropout=0.0, scaling=a.scaling)
        return h + a.o_proj(out.reshape(1, 1, -1))

    def _segment(self, s: int, bufs: _Buffers, cache: KVCache) -> None:
        """Segment s over `bufs`: its layers, then an MoE layer's router or the final norm; its
        outputs in bufs.outs[s] (the same tensors each replay, on a GPU)."""
        a, b = self.segments[s]
        h = bufs.hidden if s == 0 else bufs.outs[s - 1]["hidden"] + bufs.experts_out
        out: dict[str, torch.Tensor] = {}
        for i in range(a, b):
            h = self._attention(i, h, bufs, cache.keys[i], cache.values[i])
            layer = self.layers[i]
            x = layer.post_attention_layernorm(h)
            if self.moe[i]:  # the last layer of the segment: its router's choice comes out
                flat = x.view(-1, x.shape[-1])
                _, weights, index = layer.mlp.gate(flat)
                out.update(normed=flat, index=index, weights=weights)
            else:
                mlp = layer.mlp
                h = h + mlp.down_proj(mlp.act_fn(mlp.gate_proj(x)) * mlp.up_proj(x))
        out["hidden"] = h
        if s == len(self.segments) - 1:  # the dense rest (or no layers, after a last MoE layer)
            out["final"] = self.model.norm(h[0])
        if s < len(bufs.outs):
            bufs.outs[s] = out
        else:
            bufs.outs.append(out)

    # ---- buffers and graphs ----

    def _ready(self, cache: KVCache) -> _Buffers:
        """`cache`'s fixed tensors, made again when its buffers were replaced (it grew). New ones
        zero the cache's unwritten columns: attention reads the whole capacity under the mask,
        and a masked entry's weight is 0, but 0 x NaN is not."""
        key = (cache.capacity, len(cache.keys), *(t.data_ptr() for t in (*cache.keys, *cache.values)))
        known = self._buffers.get(cache)
        if known is not None and known.key == key:
            return known
        with torch.inference_mode():
            for t in (*cache.keys, *cache.values):
                t[:, :, cache.length :].zero_()
            device, dtype = cache.device, self.model.dtype
            hidden_size = self.model.embed.weight.shape[1]
            d = self.layers[0].self_attn.head_dim
            bufs = _Buffers(key, torch.zeros(1, 1, hidden_size, dtype=dtype, device=device),
                            torch.zeros(1, 1, d, dtype=dtype, device=device), torch.zeros(1, 1, d, dtype=dtype, device=device),
                            torch.zeros(1, dtype=torch.long, device=device),
                            torch.zeros(1, 1, 1, cache.capacity, dtype=torch.bool, device=device),
                            torch.zeros(1, 1, hidden_size, dtype=dtype, device=device))
        self._buffers[cache] = bufs
        return bufs

    def _capture(self, bufs: _Buffers, cache: KVCache) -> None:
        """CUDA graphs of every segment over `bufs` (inputs set for this step: the warm-up runs
        write only the new entry's column, which the replay writes again). On failure the step
        stays eager, said once."""
        try:
            side = torch.cuda.Stream(device=cache.device)
            side.wait_stream(torch.cuda.current_stream(cache.device))
            with torch.cuda.stream(side):
                for _ in range(2):  # allocations and lazy initialisation out of the capture
                    for s in range(len(self.segments)):
                        self._segment(s, bufs, cache)
            torch.cuda.current_stream(cache.device).wait_stream(side)
            pool = torch.cuda.graph_pool_handle()
            graphs = []
            for s in range(len(self.segments)):
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
                    self._segment(s, bufs, cache)
                graphs.append(graph)
            bufs.graphs = graphs
            self.captures += 1
        except Exception as e:  # noqa: BLE001 - any failure to capture leaves the eager step, which is correct
            self.graphed = False
            self.why_eager = f"{type(e).__name__}: {e}"
            bufs.graphs = None
            log.warning("decoding steps run without CUDA graphs (%s)", self.why_eager)

    @torch.inference_mode()
    def step(self, input_ids: torch.Tensor, positions: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """One token (input_ids and positions of shape (1,)) through every layer; its K/V appended
        to `cache` (reserved and positioned by the caller; `takes` true). The final normed hidden
        state (1, hidden), as CausalLM.forward returns it."""
        model = self.model
        bufs = self._ready(cache)
        at = cache.length
        hidden = model.embed(input_ids.to(model.device)[None])  # (1, 1, H)
        cos, sin = model.rotary(hidden, position_ids=positions.to(model.device)[None])
        bufs.hidden.copy_(hidden)
        bufs.cos.copy_(cos)
        bufs.sin.copy_(sin)
        bufs.slot.fill_(at)
        bufs.mask[..., : at + 1] = True
        bufs.mask[..., at + 1 :] = False
        if self.graphed and bufs.graphs is None:
            self._capture(bufs, cache)
        for s in range(len(self.segments)):
            if bufs.graphs is not None:
                bufs.graphs[s].replay()
                self.replays += 1
            else:
                self._segment(s, bufs, cache)
            out = bufs.outs[s]
            if "index" in out:  # an MoE layer: its routed experts, wherever they run
                layer = self.layers[self.segments[s][1] - 1]
                routed = layer.mlp.experts(out["normed"], out["index"], out["weights"])
                bufs.experts_out.copy_(routed.view_as(bufs.experts_out))
        final = bufs.outs[-1]["final"]  # (the last segment always ends in the final norm)
        cache.commit(1)
        self.steps += 1
        return final.clone()  # (1, H): the graphs' output is overwritten by the next step
