"""A decoder-only transformers model driven layer by layer.

Why not call the Hugging Face model's forward: (1) SpecExec needs arbitrary tree masks and
positions on top of a cache it prunes itself (transformers 5.x caches only append);
(2) the logits of a 2,048-token tree over a 128k vocabulary are 1 GB in fp32, so the head is
applied only to the rows verification asks for; (3) the offloaded target (engine.offload) streams
its decoder layers, which needs the layer loop in our hands. The layer modules themselves are
transformers' own, so numerics match `model.generate` exactly.

Gemma 4's layers take more than the hidden states: a per-layer input embedding of each token
(computed here with the model's own `get_per_layer_inputs`/`project_per_layer_inputs`, so each
tree token gets its own), and a `shared_kv_states` dict through which a "store" layer hands its
whole K/V (the cache's entries through this pass) to the later "reuse" layers, which compute none
and never write the cache. A fresh dict per pass; a reuse layer keeps no K/V here (width 0).

Masks are additive float tensors (0 = attend, dtype-min = blocked): transformers passes a float
mask through unchanged to both eager and SDPA attention, whereas a bool mask means opposite
things to the two.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import psutil
import torch
from torch import nn

from engine.kernels.fused_layer import HYBRID_PASS_TOKENS, FusedDecoder, PassInterrupted, interrupt_every
from engine.model.cache import KVCache
from engine.model.family import family_of, layer_kinds, supported_types
from engine.model.hybrid_cache import HybridCache, LinearSpec
from engine.model.lean_step import LeanStep
from engine.model.linear_attention import install as install_linear
from engine.model.window_cache import WindowedCache
from engine.offload.streamer import LayerStreamer
from engine.shapes import ModelShape, Placement

if TYPE_CHECKING:
    from transformers import PreTrainedModel

SUPPORTED_MODEL_TYPES = supported_types()
FREE_MARGIN_BYTES = 512 << 20  # left to the allocator's fragmentation and the draft's pass
HOST_FREE_MARGIN_BYTES = 2 << 30  # left to the OS and the app
# passes of up to this many tokens take the fused C layers where the model qualifies (a longer
# prompt's chunk takes the general path: the C attention is a plain loop, SDPA's is blocked)
FUSED_PASS_TOKENS = 512


class CausalLM:
    """Wraps a loaded `*ForCausalLM` (llama-family layout: model.embed_tokens, model.layers,
    model.norm, model.rotary_emb, lm_head).

    `streamer` (engine.offload) runs the decoder layers when some of them are not resident
    (their modules in `hf_model` then stay on the meta device); `placement` says where they
    live (all resident on the model's device when not given)."""

    # the layers whose inputs a draft head reads besides the final hidden state (an EAGLE-3 head:
    # vLLM's numbering, j = the input of layer j, 0 the embedding), in the head's order; each pass
    # keeps them for `head_states` (read_layer_inputs)
    aux_inputs: tuple[int, ...] = ()
    _aux: torch.Tensor | None = None
    lean: LeanStep | None = None  # (heads built without __init__ have none)

    def __init__(self, hf_model: PreTrainedModel, streamer: LayerStreamer | None = None,
                 placement: Placement | None = None, fingerprint: str = "") -> None:
        self.hf_model: PreTrainedModel = hf_model.eval()
        self.streamer = streamer
        # what the KV this model computes depends on (weights, quantisation, dtype, device kind),
        # set by the loader; saved caches are keyed by it ("" = never saved)
        self.fingerprint = fingerprint
        cfg = hf_model.config
        self.config = cfg
        # the llama-family layout (transformers' modules name their children untyped)
        inner = hf_model.model
        self.inner: nn.Module = inner
        self.embed: nn.Embedding = inner.embed_tokens
        self.layers: list[nn.Module] = list(inner.layers)
        self.norm: nn.Module = inner.norm
        self.rotary: nn.Module = inner.rotary_emb
        self.head: nn.Module = hf_model.lm_head  # an nn.Linear, or engine.kernels' PackedLinear
        # what each decoder layer is (family.py): the masks a pass builds follow from it
        self.family = family_of(cfg.model_type)
        self.kinds = layer_kinds(cfg)
        self.layer_types: list[str] = list(getattr(cfg, "layer_types", None) or ["full_attention"] * len(self.kinds))
        self.windows = sorted({k.window for k in self.kinds if k.window is not None})
        # Gated DeltaNet layers verify trees through engine.model.linear_attention
        self.linear = [LinearSpec.of_config(cfg) if k.mixer == "linear" else None for k in self.kinds]
        self.per_layer_inputs = self.family.layer_inputs and bool(getattr(cfg, "hidden_size_per_layer_input", 0))
        self.kv_shapes = _kv_shapes(self.layers, cfg)
        # a streamed template serves every layer of its parameter layout: what else differs
        # between those layers (an index, a window, whether K/V are stored or reused) is set on
        # it before each call
        self._layer_attrs = _varying_attributes(self.layers)
        install_linear((layer for layer in self.layers if not _on_meta(layer)), cfg)
        softcap = getattr(cfg, "final_logit_softcapping", None)
        self.softcap: float | None = float(softcap) if softcap else None
        # the head's rows, not config.vocab_size: some checkpoints pad the embedding matrix
        self.shape = replace(ModelShape.from_config(cfg, cfg.model_type), vocab_size=self.head.out_features)
        # a table kept packed (engine.kernels.embedding) says its dtype and device itself
        table = self.embed if isinstance(getattr(self.embed, "dtype", None), torch.dtype) else self.embed.weight
        self.dtype: torch.dtype = table.dtype
        self.device: torch.device = table.device
        if placement is None:
            n = self.shape.num_layers
            layer_bytes = self.shape.layer_params * self.dtype.itemsize
            placement = Placement(n, n, 0, 0, layer_bytes, "none", str(self.device))
        self.placement = placement
        # plain decoding steps of a packed llama-family model on the CPU: one C call (None: not eligible)
        self.fused = FusedDecoder.of(self)
        # a GPU's decoding steps and small passes in fixed buffers, replayed as CUDA graphs (lean_step)
        self.lean = LeanStep.of(self) if self.fused is None else None
        self.interrupt: threading.Event | None = None  # a Stop checked between runs of layers (interruptible)

    def free_memory(self) -> int:
        """Bytes the next pass's activations may take on this model's device now: free GPU
        memory, or on a CPU the available RAM, less a margin for everything else."""
        if self.device.type == "cuda":
            free = torch.cuda.mem_get_info(self.device)[0]
            return max(0, free - FREE_MARGIN_BYTES)
        return max(0, psutil.virtual_memory().available - HOST_FREE_MARGIN_BYTES)

    def can_interrupt(self) -> bool:
        """Whether a pass of several tokens stops between runs of its layers inside
        `interruptible` (not a streamed one): a CPU prefill may then read larger chunks, as a Stop
        no longer waits for a whole one. A hybrid's Gated DeltaNet states are as they were after
        a stopped pass: the general path changes them only when the pass commits
        (HybridCache.abandon_pass drops what it left pending), the fused pass puts back those its
        runs advanced."""
        return self.streamer is None

    def tree_room(self) -> int | None:
        """The most tokens a tree pass runs in the fused C pass where that is bounded (a
        hybrid's: each node keeps its Gated DeltaNet states there; fused_layer.HYBRID_PASS_TOKENS),
        else None: the prefill then leaves a tree's pass no prompt tokens beyond it."""
        return HYBRID_PASS_TOKENS if self.fused is not None and self.fused.hybrid else None

    @contextmanager
    def interruptible(self, stop: threading.Event | None) -> Iterator[None]:
        """Within it, a pass checks `stop` between runs of its layers (the fused CPU pass's C
        calls, or the layer modules) and raises PassInterrupted, committing nothing, once it is
        set (engine.decoding.prefill)."""
        self.interrupt = stop if self.can_interrupt() else None
        try:
            yield
        finally:
            self.interrupt = None

    def read_layer_inputs(self, layers: tuple[int, ...]) -> None:
        """Keep the inputs of `layers` on every pass from now on (see `aux_inputs`)."""
        n = len(self.layers)
        if any(not 0 <= j < n for j in layers):
            raise ValueError(f"layer inputs {list(layers)} outside 0..{n - 1}")
        self.aux_inputs, self._aux = tuple(layers), None

    def head_states(self, hidden: torch.Tensor) -> torch.Tensor:
        """What a draft head reads of the last pass, row for row with the `hidden` it returned:
        `hidden` itself, or the kept layer inputs side by side (n, len(aux_inputs) * H)."""
        if not self.aux_inputs:
            return hidden
        assert self._aux is not None and self._aux.shape[0] == hidden.shape[0], "head_states of another pass"
        return self._aux

    def _keep(self, kept: dict[int, torch.Tensor]) -> None:
        self._aux = torch.cat([kept[j] for j in self.aux_inputs], dim=-1) if self.aux_inputs else None

    def new_cache(self, capacity: int = 256) -> KVCache:
        s = self.shape
        if any(spec is not None for spec in self.linear):
            return HybridCache(s.num_layers, s.num_kv_heads, s.head_dim, self.dtype, self.device, capacity, self.linear)
        if self.windows:  # sliding layers hold their window plus the tree (window_cache)
            return WindowedCache(s.num_layers, s.num_kv_heads, s.head_dim, self.dtype, self.device, capacity,
                                 self.kv_shapes, [k.window for k in self.kinds])
        return KVCache(s.num_layers, s.num_kv_heads, s.head_dim, self.dtype, self.device, capacity, self.kv_shapes)

    def mask_value(self) -> float:
        return torch.finfo(self.dtype).min

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # (n,) tokens of this pass
        positions: torch.Tensor,  # (n,) absolute positions
        cache: KVCache,
        allowed: torch.Tensor | None,  # (n, cache.length + n) bool; None = causal chain
    ) -> torch.Tensor:
        """Run the decoder over n new tokens, append their K/V to `cache`, return the final
        normed hidden states (n, hidden). Call `logits()` on the rows you need."""
        n = input_ids.shape[0]
        past = cache.length
        if allowed is None:  # committed text from `past` on: sliding layers may drop what they left behind
            cache.settled(past)
        cache.reserve(n)
        positions = positions.to(self.device)
        cache.set_positions(positions)
        grab = self.aux_inputs
        kept: dict[int, torch.Tensor] = {}
        if self.fused is not None and n <= FUSED_PASS_TOKENS and self.fused.takes(cache, n, allowed):
            # a token that sees the whole cache (a hybrid's: committed text, folded into its states)
            one = n == 1 and (allowed is None or not self.fused.hybrid and bool(allowed.all()))
            if one:
                out = self.fused.step(input_ids, positions, cache, grab, kept)
            else:
                out = self.fused.pass_(input_ids, positions, cache, allowed, grab, kept, self.interrupt)
            self._keep(kept)
            return out
        if self.lean is not None and self.lean.takes(cache, n, allowed):
            out = self.lean.step(input_ids, positions, cache, allowed, grab, kept)
            self._keep(kept)
            return out
        if isinstance(cache, HybridCache):
            cache.begin_pass(allowed, n)
        # one token that sees the whole cache (a plain decoding step) needs no mask: SDPA's masked
        # CPU kernel costs 0.12 ms a layer more, a tenth of the starter's step
        full: torch.Tensor | None = None
        if n > 1 or (allowed is not None and not bool(allowed.all())):
            if allowed is None:
                allowed = causal_allowed(past, n, self.device)
            full = self._additive(allowed.to(self.device))
        # sliding windows: the tree mask intersected with the window along each node's own path;
        # a node's ancestors sit at consecutive positions, so the window is a position difference.
        # A window's layers hold the entries from cache.held_from(w) on: their masks start there.
        windowed: dict[int, torch.Tensor | None] = {}
        for w in self.windows:
            first = cache.held_from(w)
            keys = cache.positions_through(n)[first:]  # positions of the entries these layers hold
            near = (positions[:, None] - keys[None, :]) < w  # (n, held + n)
            if bool(near.all()):
                windowed[w] = full[..., first:] if full is not None else None
            else:
                base = allowed.to(self.device) if allowed is not None else causal_allowed(past, n, self.device)
                windowed[w] = self._additive(base[:, first:] & near)
        masks = [windowed[k.window] if k.window is not None else full for k in self.kinds]
        pos = positions[None]  # (1, n)
        ids = input_ids.to(self.device)[None]  # (1, n)
        hidden = self.embed(ids)  # (1, n, H)
        extras: list[dict[str, Any]] = [{}] * len(self.kinds)  # one empty dict unless filled below
        if self.family.layer_inputs:
            extras = [{} for _ in self.kinds]
            shared: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}  # layer type -> a store layer's K/V
            for extra in extras:
                extra["shared_kv_states"] = shared
        if self.per_layer_inputs:
            inner: Any = self.inner
            per_layer = inner.project_per_layer_inputs(hidden, inner.get_per_layer_inputs(ids, hidden))  # (1, n, L, P)
            for i, extra in enumerate(extras):
                extra["per_layer_input"] = per_layer[:, :, i]
        if self.family.rotary_per_type:
            ropes = {t: self.rotary(hidden, pos, t) for t in set(self.layer_types)}
            rope_of = [ropes[t] for t in self.layer_types]
        else:
            rope = self.rotary(hidden, position_ids=pos)
            rope_of = [rope] * len(self.kinds)
        if self.streamer is None:
            every = interrupt_every(len(self.layers))
            for i, layer in enumerate(self.layers):
                if self.interrupt is not None and i and i % every == 0 and self.interrupt.is_set():
                    # nothing committed (a routed layer run before keeps its counts: statistics)
                    if isinstance(cache, HybridCache):
                        cache.abandon_pass()
                    raise PassInterrupted(f"stopped before layer {i}")
                if i in grab:
                    kept[i] = hidden[0]
                hidden = layer(hidden, attention_mask=masks[i], position_ids=pos, past_key_values=cache,
                               position_embeddings=rope_of[i], **extras[i])
                if isinstance(hidden, tuple):  # older layer signatures return (hidden, ...)
                    hidden = hidden[0]
        else:
            def call(layer: nn.Module, index: int, h: torch.Tensor) -> torch.Tensor:
                if index in grab:
                    kept[index] = h[0]
                # a streamed template serves every layer index of its kind (setattr: nn.Module's
                # stubs type attribute writes as Tensor | Module)
                for name, attr, value in self._layer_attrs[index]:
                    setattr(layer.get_submodule(name), attr, value)
                out = layer(h, attention_mask=masks[index], position_ids=pos, past_key_values=cache,
                            position_embeddings=rope_of[index], **extras[index])
                return out[0] if isinstance(out, tuple) else out

            hidden = self.streamer.run(hidden, call)
        self._keep(kept)
        cache.commit(n)
        return self.norm(hidden[0])  # (n, H)

    def _additive(self, allowed: torch.Tensor) -> torch.Tensor:
        """(n, m) bool -> (1, 1, n, m) additive float mask (0 = attend, dtype-min = blocked)."""
        mask = torch.zeros(allowed.shape, dtype=self.dtype, device=self.device)
        mask.masked_fill_(~allowed, self.mask_value())
        return mask[None, None]

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(k, H) final hidden states -> (k, V) fp32 logits (soft-capped where the family does:
        Gemma's cap * tanh(logits / cap))."""
        out = self.head(hidden).float()
        if self.softcap is not None:
            out = torch.tanh(out / self.softcap) * self.softcap
        return out


def _on_meta(layer: nn.Module) -> bool:
    """A streamed layer's module stays on the meta device (its streamer runs templates)."""
    return any(p.is_meta for p in layer.parameters())


def _kv_shapes(layers: list[nn.Module], cfg: Any) -> list[tuple[int, int]] | None:
    """Each attention layer's (kv heads, head dim) as its module has them, where layers differ
    (Gemma 4); width 0 for a layer that reuses another's K/V. None: uniform (or not known)."""
    shapes: list[tuple[int, int]] = []
    for layer in layers:
        attn = getattr(layer, "self_attn", None)
        dim, groups = getattr(attn, "head_dim", None), getattr(attn, "num_key_value_groups", None)
        if not isinstance(dim, int) or not isinstance(groups, int) or groups < 1:
            return None  # a linear layer (hybrid_cache keeps its own shapes) or an unknown module
        heads = cfg.num_attention_heads // groups
        shapes.append((heads, 0 if getattr(attn, "is_kv_shared_layer", False) else dim))
    return shapes if len(set(shapes)) > 1 else None


_PLAIN = (bool, int, float, str, type(None))


def _varying_attributes(layers: list[nn.Module]) -> list[list[tuple[str, str, object]]]:
    """For each layer: (submodule, attribute, value) of the plain attributes that are not the
    same in every layer (layer_idx; Gemma 4's window, head_dim, K/V store or reuse)."""
    found: list[dict[tuple[str, str], object]] = []
    for layer in layers:
        found.append({(name, attr): value for name, module in layer.named_modules()
                      for attr, value in vars(module).items()
                      if not attr.startswith("_") and isinstance(value, _PLAIN)})
    missing = object()
    keys = {k for f in found for k in f}
    varying = sorted(k for k in keys if len({repr(f.get(k, missing)) for f in found}) > 1)
    return [[(name, attr, f[(name, attr)]) for name, attr in varying if (name, attr) in f] for f in found]


def causal_allowed(past: int, n: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """(n, past + n) bool: token i of a chain sees the whole past and the chain up to itself."""
    cols = torch.arange(past + n, device=device)
    rows = torch.arange(n, device=device)[:, None] + past
    return cols[None, :] <= rows
