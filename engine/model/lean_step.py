"""Decoding steps and small passes on a GPU in fixed buffers, replayed as CUDA graphs: one launch
for each run of decoder layers between routed experts, instead of ~70 eager operations a layer.

Why: `specchat bench gpu` measured the general path's decoder layer at 0.86 ms of launches and
Python on an H200 host before any weight is read (one tiny layer at one token), and an MoE whose
routed experts run on the CPU (`--experts cpu`) pays that in each of its 40-48 layers every token,
which caps the Qwen3.6-35B-A3B projection at ~0.5x llama.cpp's measured figure on an 8 GB card
(`bench plan --moe`, whose second table prices that cost); a resident draft pays it in every
level of every tree it grows. A pass here calls the decoder layers themselves, as the general
path does, over buffers whose shapes do not change between passes, so a CUDA graph can hold each
run of layers:

- a pass of n tokens runs as a bucket of B = the least power of two >= n (up to MAX_TOKENS): the
  pads repeat the first token at the last position, attend only to themselves (a row that sees
  nothing is NaN on some kernels), write their K/V past the pass's own columns, are never
  committed, and never reach the routed experts;
- the layers' cache is a `Slots` (lean_slots.py): attention's `update` writes the bucket's K/V
  at columns given by a device tensor (`index_copy_`) and hands back the cache's first W
  columns, read under a boolean mask (the tree's `allowed`, or the chain's causal one, set per pass outside the
  graphs), W a multiple of max(MIN_COLUMNS, an eighth of the text's power of two) past the pass
  (columns_for), so no shape depends on the cache's length and attention reads at most a quarter
  more than it needs however far the cache grew for trees (each W has its own graphs); a Gated
  DeltaNet layer (Qwen3.5 / Qwen3.6 / Qwen3-Next) reads its committed state and folds a single
  token of committed text into it in place (linear_attention.advance), as the general path's
  commit does, or, in a tree on committed text, reads the tree's tables (fixed, filled before
  the pass; the pads are roots of their own) and hands each node's inputs to the cache until the
  accepted path is known, as the general path's layers do;
- the embedding and the rotary cos/sin are computed eagerly once a pass and copied into the
  graphs' inputs;
- a segment ends with an MoE layer: its routed experts are a stand-in that keeps their input,
  experts and weights and gives zeros, so the layer's output is the residual plus whatever else
  the block adds (a shared expert); the real experts then run eagerly on the pass's own tokens
  (PackedExperts: the hot set on the GPU, the rest packed on the CPU, as in the general path)
  and their sum goes into the next segment's input. Where the block has a shared expert, the sum
  is taken in another order than transformers' (residual + shared, then + routed): a rounding
  difference, like the masked attention kernel's.

Graphs are captured per cache buffer set, bucket and W, at the third pass over them (CAPTURE_AT: a
capture costs about three eager passes, and each answer's caches are new), again when a cache
grew (new buffers), and dropped with the cache. Capture can fail (an operation a graph cannot hold, out of
memory): the passes then run the same calls eagerly and say why once; where it is a hybrid's tree
that fails, only its trees go back to the general path (its steps keep their graphs). On the CPU nothing is
captured and a pass is those calls run eagerly: the tests run it there against the general path
and transformers' own decoding, so the logic the GPU replays is the logic the CPU tests.

Qualifies (`LeanStep.of`): the families in FAMILIES, all layers resident on one CUDA device (no
streamer), no sliding windows or per-layer inputs, SDPA attention. A pass longer than MAX_TOKENS
takes the general path, and so do a hybrid's chains of committed text longer than one token
(prompt chunks) and its trees over an earlier pass's pending nodes (a draft's tree grown level by
level). The layer inputs a draft head reads (EAGLE-3: CausalLM.read_layer_inputs) come out of the
segments as outputs too. SPECCHAT_NO_LEAN=1 switches the path off; SPECCHAT_NO_GRAPHS=1 keeps it
eager.

A pass of several tokens checks the model's Stop (CausalLM.interruptible) between segments, as
the general path does between runs of layers: an MoE's segments are its layers, and their experts
may be on the CPU. While a segment runs eagerly or is captured, its MoE layer's `mlp.experts` is
the stand-in: one model's passes must not run in two threads at once (the engine runs one
generation at a time: engine.serving.scheduler); a replay touches no module.

What this module does not do: the fused C step and pass on the CPU (engine.kernels.fused_layer),
which a CPU model takes instead.
"""

from __future__ import annotations

import functools
import logging
import os
import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from engine.kernels.fused_layer import PassInterrupted
from engine.model.cache import KVCache
from engine.model.cuda_graphs import CudaGraphs
from engine.model.hybrid_cache import HybridCache
from engine.model.lean_slots import Slots

if TYPE_CHECKING:
    from engine.model.causal_lm import CausalLM

log = logging.getLogger(__name__)

# decoder layers the general path calls as layer(h, attention_mask, position_ids, past_key_values,
# position_embeddings) and that read only update() (and a hybrid's linear-cache calls) on the cache
FAMILIES = frozenset({"llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "mixtral", "glm4_moe", "qwen3_5_text",
                      "qwen3_5_moe_text", "qwen3_next"})


# attention reads the first W columns of the cache: W the least multiple of max(MIN_COLUMNS, an
# eighth of the text's power of two) past the pass's last entry, so at most a quarter more than a
# pass needs however large the cache grew for trees (a masked column is still read), and about
# eight W's, each with its own graphs, each time the text doubles
MIN_COLUMNS = 256
# a pass of n tokens (a tree's nodes, a draft's level, a chain) runs as a bucket of the least power
# of two >= n, the rest padding (each pad attends to itself only and is never committed); longer
# passes take the general path (their compute, not launches, sets their time)
MAX_TOKENS = 256
# a bucket's graphs are captured at its CAPTURE_AT-th pass over the same buffers, not its first: a
# capture costs about three eager passes, and a new cache (each answer has its own) would pay
# that for every bucket a draft's levels touch once
CAPTURE_AT = 3


def bucket_for(n: int) -> int:
    return 1 << (n - 1).bit_length()


def columns_for(length: int, capacity: int) -> int:
    """The columns attention reads when its last new entry goes to column `length` of a cache of
    `capacity` entries."""
    step = max(MIN_COLUMNS, 1 << max(0, length.bit_length() - 3))
    return min(capacity, (length // step + 1) * step)  # (> length: that entry's column too)


def _switched_off(name: str) -> bool:
    return os.environ.get(name, "").strip() not in ("", "0")


def refusal(model: CausalLM) -> str | None:
    """Why `model` cannot take the lean step (None: it can). Device aside: `LeanStep.of` checks it."""
    cfg = model.config
    kind = getattr(cfg, "model_type", "")
    if kind not in FAMILIES:
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
    layer: Any  # transformers' decoder layers: their submodules by name
    for i, layer in enumerate(model.layers):
        if model.linear[i] is None and getattr(getattr(layer, "self_attn", None), "sliding_window", None):
            return f"layer {i}: a sliding window"
        if hasattr(getattr(layer, "self_attn", None), "sinks"):
            return f"layer {i}: attention sinks"
    return None


def _routed(layer: nn.Module) -> nn.Module | None:
    """The layer's routed experts module (None: a dense MLP)."""
    experts = getattr(getattr(layer, "mlp", None), "experts", None)
    return experts if isinstance(experts, nn.Module) else None


class _Held(nn.Module):
    """Stands in for a layer's routed experts inside a segment: keeps their inputs (the graph's
    outputs) and gives zeros, so the layer's output leaves the routed sum to be added after."""

    def __init__(self) -> None:
        super().__init__()
        self.inputs: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
                ) -> torch.Tensor:
        self.inputs = hidden_states, top_k_index, top_k_weights
        return torch.zeros_like(hidden_states)


@dataclass
class _Buffers:
    """The fixed tensors of one cache buffer set, bucket (B) and columns and, on a GPU, their
    graphs (one per segment)."""

    slots: Slots
    hidden: torch.Tensor  # (1, B, H): the embeddings in
    cos: torch.Tensor  # (1, B, rotary width)
    sin: torch.Tensor
    position: torch.Tensor  # (1, B) long
    mask: torch.Tensor  # (1, 1, B, columns) bool: what each token sees
    experts_out: torch.Tensor  # (1, B, H): the last MoE layer's routed sums, read by the next segment
    grab: tuple[int, ...] = ()  # the layers whose inputs come out (a draft head's)
    outs: list[dict[str, torch.Tensor]] = field(default_factory=list)  # each segment's outputs
    graphs: list[Any] | None = None  # torch.cuda.CUDAGraph per segment, once captured
    passes: int = 0  # passes run over these buffers


class LeanStep:
    """The lean steps and passes of one model (see the module's docstring)."""

    def __init__(self, model: CausalLM) -> None:
        self.model = model
        self.layers: list[Any] = list(model.layers)  # transformers' decoder layers: their submodules by name
        self.experts = [_routed(layer) for layer in self.layers]
        self.linear = [spec is not None for spec in model.linear]
        # segments: runs of layers, each ending with an MoE layer (or at the last layer)
        self.segments: list[tuple[int, int]] = []
        start = 0
        for i, experts in enumerate(self.experts):
            if experts is not None:
                self.segments.append((start, i + 1))
                start = i + 1
        self.segments.append((start, len(self.layers)))  # the dense rest and the final norm (maybe no layers)
        # each segment's last MoE layer's experts, run after it (None: the segment ends dense)
        self.ends = [self.experts[b - 1] if b > a else None for a, b in self.segments]
        self._held = _Held()
        self.graphed = model.device.type == "cuda" and not _switched_off("SPECCHAT_NO_GRAPHS")
        self.why_no_trees: str | None = None  # why a hybrid's trees left the lean step (their capture failed)
        self.why_eager: str | None = None if self.graphed else "not on a GPU" if model.device.type != "cuda" else \
            "SPECCHAT_NO_GRAPHS"
        # each cache's buffer addresses, and its fixed tensors (and graphs) by bucket, columns and grab
        self._buffers: weakref.WeakKeyDictionary[KVCache, tuple[tuple[int, ...], dict[tuple[Any, ...], _Buffers]]] = \
            weakref.WeakKeyDictionary()
        self.steps = 0
        self.replays = 0  # graph launches (tests and the benchmark read them)
        self.captures = 0
        self._backend: CudaGraphs | None = None  # the warm-ups' and captures' stream, once made

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

    def takes(self, cache: KVCache, n: int, allowed: torch.Tensor | None) -> bool:
        """Whether a pass of n tokens under `allowed` can run here: up to MAX_TOKENS on a KVCache
        of the model's device. A hybrid's on a HybridCache with nothing pending: one token of
        committed text, or a tree (`allowed` given) on committed text; its committed chains of
        several tokens (prompt chunks) and trees over an earlier pass's nodes take the general
        path."""
        if not 1 <= n <= MAX_TOKENS or cache.device.type != self.model.device.type:
            return False
        if any(self.linear):
            if type(cache) is not HybridCache or not cache.complete or not (n == 1 or allowed is not None):
                return False
            return self.why_no_trees is None or not self._tree(n, allowed)
        return type(cache) is KVCache

    def _tree(self, n: int, allowed: torch.Tensor | None) -> bool:
        """Whether a hybrid's pass is a tree (per-node inputs kept) rather than committed text."""
        return any(self.linear) and not (n == 1 and (allowed is None or bool(allowed.all())))

    # ---- the segments: the model's own decoder layers over the fixed buffers ----

    def _segment(self, s: int, bufs: _Buffers) -> None:
        """Segment s over `bufs`: its layers (an MoE layer's routed experts held back), then the
        final norm in the last; its outputs in bufs.outs[s] (the same tensors each replay, on a GPU)."""
        a, b = self.segments[s]
        h = bufs.hidden if s == 0 else bufs.outs[s - 1]["hidden"] + bufs.experts_out
        out: dict[str, torch.Tensor] = {}
        for i in range(a, b):
            if i in bufs.grab:
                out[f"input {i}"] = h
            layer = self.layers[i]
            mask = None if self.linear[i] else bufs.mask
            if self.experts[i] is None:
                h = layer(h, attention_mask=mask, position_ids=bufs.position, past_key_values=bufs.slots,
                          position_embeddings=(bufs.cos, bufs.sin))
            else:  # the last layer of the segment: its experts' inputs come out
                mlp = layer.mlp
                mlp.experts = self._held
                try:
                    h = layer(h, attention_mask=mask, position_ids=bufs.position, past_key_values=bufs.slots,
                              position_embeddings=(bufs.cos, bufs.sin))
                finally:
                    mlp.experts = self.experts[i]
                assert self._held.inputs is not None, f"layer {i}'s block did not call its experts"
                out.update(zip(("normed", "index", "weights"), self._held.inputs))
                self._held.inputs = None
            if isinstance(h, tuple):  # older layer signatures return (hidden, ...)
                h = h[0]
        out["hidden"] = h
        if s == len(self.segments) - 1:  # the dense rest (or no layers, after a last MoE layer)
            out["final"] = self.model.norm(h[0])
        if s < len(bufs.outs):
            bufs.outs[s] = out
        else:
            bufs.outs.append(out)

    # ---- buffers and graphs ----

    def _ready(self, cache: KVCache, cos: torch.Tensor, bucket: int, grab: tuple[int, ...], tree: bool) -> _Buffers:
        """`cache`'s fixed tensors for passes of `bucket` tokens reading `columns_for` columns,
        all made again when its buffers (or a hybrid's states) were replaced (kept per bucket and
        columns: a tree's levels grow the text and the kept path shrinks it back). A new buffer
        set has its unwritten columns zeroed: attention reads them under the mask, and a masked
        entry's weight is 0, but 0 x NaN is not (torch.empty's)."""
        columns = columns_for(cache.length + bucket - 1, cache.capacity)
        tensors = [*cache.keys, *cache.values]
        if isinstance(cache, HybridCache):
            tensors += [t for state in cache.states.values() for t in state.tensors()]
        key = (cache.capacity, len(tensors), *(t.data_ptr() for t in tensors))
        held = self._buffers.get(cache)
        if held is None or held[0] != key:
            with torch.inference_mode():
                for t in (*cache.keys, *cache.values):
                    t[:, :, cache.length :].zero_()
            held = self._buffers[cache] = (key, {})
        known = held[1].get((bucket, columns, grab, tree))
        if known is not None:
            return known
        with torch.inference_mode():
            device, dtype = cache.device, self.model.dtype
            hidden_size = self.model.embed.weight.shape[1]
            slot = torch.zeros(bucket, dtype=torch.long, device=device)
            bufs = _Buffers(Slots(cache, slot, columns, bucket if tree else None),
                            torch.zeros(1, bucket, hidden_size, dtype=dtype, device=device),
                            torch.zeros_like(cos), torch.zeros_like(cos),
                            torch.zeros(1, bucket, dtype=torch.long, device=device),
                            torch.zeros(1, 1, bucket, columns, dtype=torch.bool, device=device),
                            torch.zeros(1, bucket, hidden_size, dtype=dtype, device=device))
        bufs.grab = grab
        held[1][(bucket, columns, grab, tree)] = bufs
        return bufs

    def _capture(self, bufs: _Buffers, cache: KVCache) -> None:
        """Graphs of every segment over `bufs` (CudaGraphs). The warm-up runs write the pass's
        columns (which the replay writes again) and fold the token into a hybrid's states, so
        those are kept and put back. On failure the passes stay eager, said once."""
        states = [(t, t.clone()) for st in getattr(cache, "states", {}).values() for t in st.tensors()]
        try:
            if self._backend is None:
                self._backend = CudaGraphs(cache.device)
            backend = self._backend
            try:
                def every() -> None:
                    for s in range(len(self.segments)):
                        self._segment(s, bufs)

                for _ in range(2):  # allocations and lazy initialisation out of the capture
                    backend.warm(every)
                pool = backend.pool()
                bufs.graphs = [backend.capture(functools.partial(self._segment, s, bufs), pool)
                               for s in range(len(self.segments))]
                self.captures += 1
            finally:
                backend.settle()  # (a warm-up cut short by an error may still be running)
        except Exception as e:  # noqa: BLE001 - any failure to capture leaves the eager passes, which are correct
            why = f"{type(e).__name__}: {e}"
            bufs.graphs = None
            bufs.outs.clear()
            if bufs.slots.tree is not None:  # a hybrid's tree: its trees go back to the general path, its steps keep theirs
                self.why_no_trees = why
                log.warning("a hybrid model's tree passes run on the general path (%s)", why)
            else:
                self.graphed, self.why_eager = False, why
                log.warning("decoding steps run without CUDA graphs (%s)", why)
        finally:
            for t, saved in states:
                t.copy_(saved)

    @torch.inference_mode()
    def step(self, input_ids: torch.Tensor, positions: torch.Tensor, cache: KVCache,
             allowed: torch.Tensor | None = None, grab: tuple[int, ...] = (),
             kept: dict[int, torch.Tensor] | None = None) -> torch.Tensor:
        """n tokens (input_ids and positions of shape (n,)) through every layer under `allowed`
        ((n, length + n) bool; None: a chain after the cache), their K/V appended to `cache`
        (reserved and positioned by the caller; `takes` true), a hybrid's token folded into its
        states; the inputs of the layers in `grab` into `kept` (n, hidden) each. The final normed
        hidden states (n, hidden), as CausalLM.forward returns them."""
        model, device = self.model, self.model.device
        n, at = int(input_ids.shape[0]), cache.length
        bucket = bucket_for(n)
        cache.reserve(bucket)  # (the pads' columns: written, never committed)
        ids = input_ids.to(device)
        position = positions.to(device)
        if bucket > n:  # pads: the first token again, at the last position
            ids = torch.cat([ids, ids[:1].expand(bucket - n)])
            position = torch.cat([position, position[-1:].expand(bucket - n)])
        hidden = model.embed(ids[None])  # (1, B, H)
        cos, sin = model.rotary(hidden, position_ids=position[None])
        tree = self._tree(n, allowed)
        bufs = self._ready(cache, cos, bucket, tuple(sorted(set(grab))), tree)
        if tree:  # a hybrid's tree on committed text: each node's parent, the tables its layers read
            assert isinstance(cache, HybridCache)
            cache.begin_pass(allowed, n, tables=False)
            bufs.slots.set_tree(cache.parents[at : at + n] - at)
        bufs.hidden.copy_(hidden)
        bufs.cos.copy_(cos)
        bufs.sin.copy_(sin)
        bufs.position.copy_(position[None])
        if bucket == 1:
            bufs.slots.slot.fill_(at)
        else:
            bufs.slots.slot.copy_(torch.arange(at, at + bucket, device=device))
        self._mask(bufs.mask[0, 0], at, n, allowed)
        bufs.passes += 1
        if self.graphed and bufs.graphs is None and bufs.passes >= CAPTURE_AT:
            self._capture(bufs, cache)
        stop = model.interrupt if n > 1 else None  # a pass checks the Stop between segments (nothing committed)
        for s in range(len(self.segments)):
            if stop is not None and s and stop.is_set():
                if isinstance(cache, HybridCache):
                    cache.abandon_pass()  # (its states were only read)
                raise PassInterrupted(f"stopped before layer {self.segments[s][0]}")
            if bufs.graphs is not None:
                bufs.graphs[s].replay()
                self.replays += 1
            else:
                self._segment(s, bufs)
            out = bufs.outs[s]
            experts = self.ends[s]
            if experts is not None:  # an MoE layer: its routed experts (the pads' not), wherever they run
                routed = experts(out["normed"][:n], out["index"][:n], out["weights"][:n])
                bufs.experts_out[0, :n].copy_(routed.view(n, -1))
                if bucket > n:
                    bufs.experts_out[0, n:].zero_()
        final = bufs.outs[-1]["final"][:n]  # (the last segment always ends in the final norm)
        if kept is not None:
            for out in bufs.outs:
                for i in bufs.grab:
                    if f"input {i}" in out:
                        kept[i] = out[f"input {i}"][0, :n].clone()
        if tree:
            assert isinstance(cache, HybridCache)
            bufs.slots.hand_over(cache, n)  # each node's inputs, until the accepted path is known
            cache.commit(n)
        elif isinstance(cache, HybridCache):
            cache.folded(1)  # the linear layers folded the token into their states in place
        else:
            cache.commit(n)
        self.steps += 1
        return final.clone()  # (n, H): the graphs' output is overwritten by the next pass

    @staticmethod
    def _mask(mask: torch.Tensor, at: int, n: int, allowed: torch.Tensor | None) -> None:
        """(B, W) in place: row i < n the entries token i sees (`allowed`, or the cache and the
        chain before it); a pad only itself."""
        bucket = mask.shape[0]
        if n == 1 and (allowed is None or bool(allowed.all())):
            mask[0, : at + 1] = True
            mask[0, at + 1 :] = False
        else:
            mask.zero_()
            if allowed is None:
                mask[:n, :at] = True
                mask[:n, at : at + n] = torch.ones(n, n, dtype=torch.bool, device=mask.device).tril()
            else:
                mask[:n, : at + n] = allowed.to(mask.device)
        if bucket > n:
            pads = torch.arange(n, bucket, device=mask.device)
            mask[pads, at + pads] = True
