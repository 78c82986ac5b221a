"""Gemma 4's assistant model (`gemma4_assistant`) as a draft: loaded from its safetensors,
drafting trees from the target's hidden states and the target's own K/V.

What the assistant is (transformers' Gemma4AssistantForCausalLM and its candidate generator,
generation/candidate_generator.py): a few Gemma 4 decoder layers of their own width whose
attention has queries only. Every layer reads the keys and values the target computed in its
last full-attention layer or its last sliding-window layer before the target's own K/V-sharing
layers (the "store" layers of Gemma4TextConfig.kv_sharing_modes), by layer type: it keeps no
cache of its own. One step, for token x_p at position p: u = pre_projection(cat([embed(x_p),
h_{p-1}])) with the TARGET's scaled embedding and h_{p-1} the hidden state before x_p (the
target's final normed one for committed text, the assistant's own projected output at a tree
node's parent); u passes the layers, the final norm gives the state the assistant's lm_head
(tied to its own embedding; or the centroid-masked embedder when `use_ordered_embeddings`)
turns into x_{p+1}'s logits, and post_projection of it is the next step's h. No soft-cap.

What the reference does that this module follows: the query sits at the position of the last
committed token for every drafted depth (the references lock position_ids for the whole drafting
round), and drafted tokens never get K/V entries, so a tree needs no mask of its own: every node
sees the committed text only, and depends on its ancestors through h alone. Where it differs:
the reference slices the target's K/V to the sequence length, which after a partly accepted round
includes the target's entry for the rejected draft token at the root's position; here a query at
p sees the target's entries at positions < p (full layers) and p - window < pos < p (sliding
layers): exactly what the target has committed, nothing stale. Losslessness never depends on it.

How the target's K/V reach the assistant: the engine hands a draft head the target's hidden
states after each pass that commits tokens, and the cache that pass writes
(head_draft.hidden_sink(draft cache, target cache) -> bind_target, then HeadCache.observe); the
assistant's cache keeps a weak reference to it. Until bound (a copied or restored cache), `knows`
says no and the engine decodes the step without drafting, which binds it.

transformers 5.23 cannot build Gemma4AssistantForCausalLM (its text config's kv_sharing_modes
raises when every layer is shared), so the layers are built with no sharing and then switched to
reading the shared K/V, their unused key/value projections dropped.

What this module does not do: find an assistant or check that it fits (assistant_spec.py), decide
when the engine hands hidden states over (generation.py), or price it (draft_choice.py).
"""

from __future__ import annotations

import copy
import hashlib
import logging
import weakref
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from engine.errors import UsageError
from engine.loading.checkpoint import Checkpoint
from engine.model.assistant_spec import (
    ASSISTANT_TYPE,
    CONFIG_ERRORS,
    layer_class,
    problem_of,
    producers,
    read_config,
    text_config,
    text_of,
)
from engine.model.cache import KVCache
from engine.model.causal_lm import CausalLM
from engine.model.family import LayerKind
from engine.model.head_draft import HeadCache, HeadDraft
from engine.shapes import ModelShape

log = logging.getLogger(__name__)


# ---- the target's cache, as its last pass wrote it ------------------------------------------------
class AssistantCache(HeadCache):
    """A draft head's cache with no K/V of its own (width 0): per entry the assistant's output
    (`own`, a child's input) and whether its input was known; by position the target's hidden
    states; and the target's cache it reads, bound by `bind_target` (head_draft.hidden_sink)."""

    def __init__(self, hidden: int, dtype: torch.dtype, device: torch.device | str, capacity: int) -> None:
        self._target: weakref.ref[KVCache] | None = None
        self.anchor = -1  # position of the last committed token read: where every tree node queries
        super().__init__(1, 0, hidden, dtype, device, capacity)

    def bind_target(self, target: KVCache) -> None:
        self._target = weakref.ref(target)

    def target_cache(self) -> KVCache | None:
        return self._target() if self._target is not None else None

    def knows(self, position: int) -> bool:
        return super().knows(position) and self.target_cache() is not None

    def like(self, capacity: int) -> AssistantCache:
        return AssistantCache(self.hidden_size, self.dtype, self.device, capacity)

    def copy_prefix(self, length: int, spare: int = 0) -> AssistantCache:
        out = super().copy_prefix(length, spare)
        assert isinstance(out, AssistantCache)
        out._target = None  # a copy pairs with another target cache: bound again by its next pass
        return out


def _parents(cache: KVCache, positions: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """(n,) each tree node's parent entry: the visible entry one position back (-1: none)."""
    n = positions.shape[0]
    cols = cache.positions_through(n)
    match = allowed & (cols[None, :] == positions[:, None] - 1)
    index = torch.arange(cols.shape[0], device=positions.device)
    return torch.where(match, index[None, :], -1).max(dim=1).values


class AssistantDraft(HeadDraft):
    """The assistant driven like a draft CausalLM (forward, logits, new_cache, shape, device,
    dtype). Built by load_assistant; neither CausalLM.__init__ nor HeadDraft.__init__ runs."""

    def __init__(self, target: CausalLM, layers: list[nn.Module], layer_types: list[str], windows: dict[str, int],
                 norm: nn.Module, rotary: nn.Module, pre: nn.Linear, post: nn.Linear, lm_head: torch.Tensor,
                 centroids: tuple[torch.Tensor, torch.Tensor, int] | None, config: Any, label: str,
                 fingerprint: str) -> None:
        self.target = target
        self.label = label
        self.hf_model = target.hf_model
        self.streamer = None
        self.fingerprint = fingerprint
        self.config = config  # the assistant's text config
        self.inner = target.inner
        self.embed = target.embed  # the target's scaled embedding, as the reference feeds it
        self.rotary = rotary
        self.head = target.head
        self.layers = layers
        self.assistant_types = layer_types
        self.sliding = windows  # layer type -> window (sliding types only)
        self.norm = norm.eval()
        self.pre_projection, self.post_projection = pre.eval(), post.eval()
        self.lm_head = lm_head  # (V, H_a)
        self.centroids = centroids  # (centroid weights (C, H_a), token ordering (V,), top k) or None
        self.family = target.family
        self.kinds = [LayerKind() for _ in layers]
        self.layer_types = ["full_attention"] * len(layers)
        self.windows = []
        self.linear = [None] * len(layers)
        self.per_layer_inputs = False
        self.kv_shapes = None
        self._layer_attrs = [[] for _ in layers]
        self.softcap = None
        self.num_kv_heads, self.head_dim = 1, 0
        self.shape = replace(ModelShape.from_config(config, "gemma4_text"), vocab_size=target.shape.vocab_size)
        self.dtype = target.dtype
        self.device = target.device
        self.placement = target.placement
        self.fused = None
        self.producers = producers(target.config)
        self.target_windows = {t: w for t, w in ((t, getattr(text_of(target.config), "sliding_window", None))
                                                for t in self.producers) if t == "sliding_attention" and w}

    def new_cache(self, capacity: int = 256) -> AssistantCache:
        return AssistantCache(int(self.target.shape.hidden_size), self.dtype, self.device, capacity)

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(k, H_a) the assistant's normed states -> (k, V) fp32 logits."""
        if self.centroids is None:
            return (hidden @ self.lm_head.T).float()
        weights, ordering, top = self.centroids
        chosen = torch.topk(hidden @ weights.T, top, dim=-1).indices  # (k, top) centroids
        tokens = ordering.view(weights.shape[0], -1)[chosen].flatten(1)  # (k, top * V / C)
        picked = torch.einsum("kh,knh->kn", hidden, self.lm_head[tokens]).float()
        out = torch.full((hidden.shape[0], self.lm_head.shape[0]), float(picked.min()) - 1.0, device=hidden.device)
        return out.scatter_(1, tokens, picked)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, cache: KVCache,
                allowed: torch.Tensor | None) -> torch.Tensor:
        """Read n tokens: append an entry each to `cache`; return their normed states (n, H_a).
        A committed chain (allowed None) is read for its last token only (the next tree's
        root: no other row of a chain is ever drafted from); its other rows come back as zeros.
        Tree nodes are read in waves, parents first, each querying at the root's position."""
        assert isinstance(cache, AssistantCache), "the assistant drafts with its own cache (new_cache)"
        n, past, device = input_ids.shape[0], cache.length, self.device
        cache.reserve(n)
        positions = positions.to(device)
        cache.set_positions(positions)
        total = past + n
        slots = torch.arange(past, total, device=device)
        cache.seen[past:total] = False
        ids = input_ids.to(device)
        out = torch.zeros((n, int(self.config.hidden_size)), dtype=self.dtype, device=device)
        if allowed is None:
            cache.anchor = int(positions[-1])
            h_in, ok = cache.inputs_at(positions[-1:] - 1)
            own, normed = self._rows(cache, ids[-1:], positions[-1:], h_in)
            cache.own[total - 1 :] = own
            cache.seen[total - 1 :] = ok
            out[-1:] = normed
        else:
            assert cache.anchor >= 0, "tree nodes come after their root's chain"
            parent = _parents(cache, positions, allowed.to(device))
            done = torch.zeros(n, dtype=torch.bool, device=device)
            while not bool(done.all()):
                ready = torch.where(parent >= past, done[(parent - past).clamp(min=0)], True)
                wave = (~done & ready).nonzero()[:, 0]
                assert wave.numel() > 0, "a node's parent comes after it"
                p = parent[wave].clamp(min=0)
                ok = (parent[wave] >= 0) & cache.seen[p]
                h_in = cache.own[p].masked_fill(~ok[:, None], 0)
                query = torch.full_like(wave, cache.anchor)
                own, normed = self._rows(cache, ids[wave], query, h_in)
                cache.own[slots[wave]] = own
                cache.seen[slots[wave]] = ok
                out[wave] = normed
                done[wave] = True
        cache.commit(n)
        return out

    def _target_kv(self, cache: AssistantCache) -> dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] | None:
        """By layer type: the target's keys, values (1, H_kv, m, D) and their positions (m,), as
        its cache holds them now (a sliding layer's from its held_from on)."""
        target = cache.target_cache()
        if target is None:
            return None
        out = {}
        for t, i in self.producers.items():
            w = self.target_windows.get(t)
            first = target.held_from(w) if w is not None else 0
            held = target.length - first
            out[t] = (target.keys[i][:, :, :held], target.values[i][:, :, :held],
                      target.positions[first : target.length])
        return out

    def _rows(self, cache: AssistantCache, ids: torch.Tensor, query: torch.Tensor,
              h_in: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The assistant over r rows (token, input state, query position): (own output (r, H),
        normed state (r, H_a)). Rows see the target's entries before their query position."""
        r = ids.shape[0]
        kv = self._target_kv(cache)
        if kv is None:  # not bound to a target pass yet: nothing to read
            return (torch.zeros((r, h_in.shape[-1]), dtype=self.dtype, device=self.device),
                    torch.zeros((r, int(self.config.hidden_size)), dtype=self.dtype, device=self.device))
        x = self.pre_projection(torch.cat([self.embed(ids[None]), h_in[None].to(self.dtype)], dim=-1))  # (1, r, H_a)
        pos = query[None]  # (1, r)
        masks, shared = {}, {}
        for t, (k, v, held) in kv.items():
            see = held[None, :] < query[:, None]  # (r, m)
            if t in self.target_windows:
                see &= held[None, :] > query[:, None] - self.target_windows[t]
            mask = torch.zeros(see.shape, dtype=self.dtype, device=self.device)
            masks[t] = mask.masked_fill_(~see, torch.finfo(self.dtype).min)[None, None]
            shared[t] = (k, v)
        ropes = {t: self.rotary(x, pos, t) for t in set(self.assistant_types)}
        for layer, t in zip(self.layers, self.assistant_types):
            h = layer(x, None, shared_kv_states=shared, position_embeddings=ropes[t], attention_mask=masks[t],
                      position_ids=pos)
            x = h[0] if isinstance(h, tuple) else h
        normed = self.norm(x)[0]  # (r, H_a)
        return self.post_projection(normed), normed


def load_assistant(folder: Path, target: CausalLM) -> AssistantDraft:
    """The assistant in `folder` (config.json + safetensors; nothing in it runs code) as a draft
    for the loaded `target`. UsageError when it does not fit the target."""
    from transformers.models.gemma4.modeling_gemma4 import Gemma4RMSNorm, Gemma4TextRotaryEmbedding

    folder = Path(folder)
    config = read_config(folder)
    if config is None:
        raise UsageError(f"{folder} is not a Gemma 4 assistant (its config.json has no model_type "
                         f"'{ASSISTANT_TYPE}').")
    try:
        problem = problem_of(config, target.config)
    except CONFIG_ERRORS as exc:
        problem = f"its config.json cannot be read ({exc})"
    if problem:
        raise UsageError(f"The assistant in {folder} cannot draft for this model: {problem}. Pick the assistant "
                         "published with this model, or another draft.")
    cfg = text_config(config)
    cfg._attn_implementation = getattr(text_of(target.config), "_attn_implementation", None) or "sdpa"
    device, dtype = target.device, target.dtype
    cls = layer_class()
    layers: list[nn.Module] = []
    with torch.device("meta"):
        for i in range(int(cfg.num_hidden_layers)):
            layer = cls(cfg, i)
            attn: Any = layer.get_submodule("self_attn")
            for name in ("k_proj", "v_proj", "k_norm", "v_norm"):
                if hasattr(attn, name):
                    delattr(attn, name)
            attn.is_kv_shared_layer, attn.store_full_length_kv = True, False
            layers.append(layer)
    ckpt = Checkpoint(folder, copy.deepcopy(config))
    h, b = int(cfg.hidden_size), int(config.get("backbone_hidden_size", 1536))
    try:
        def tensor(name: str, shape: tuple[int, ...], kind: torch.dtype = dtype) -> torch.Tensor:
            if not ckpt.has(name):
                raise UsageError(f"The assistant in {folder} has no tensor {name}; its files are incomplete.")
            if tuple(ckpt.shape(name)) != shape:
                raise UsageError(f"The assistant's tensor {name} in {folder} is {list(ckpt.shape(name))}, not "
                                 f"{list(shape)} as its config says.")
            return ckpt.load(name, kind, device)

        with torch.inference_mode():
            for i, layer in enumerate(layers):
                layer.to_empty(device=device)
                for name, t in [*layer.named_parameters(), *layer.named_buffers(recurse=True)]:
                    if name.endswith("inv_freq") or name.endswith("embed_scale"):
                        continue
                    full = f"model.layers.{i}.{name}"
                    if name == "layer_scalar" and not ckpt.has(full):
                        t.data = torch.ones_like(t, device=device, dtype=dtype)
                        continue
                    t.data = tensor(full, tuple(t.shape))
                layer.eval()
            norm = Gemma4RMSNorm(h, eps=float(cfg.rms_norm_eps)).to(device=device, dtype=dtype)
            norm.weight.data = tensor("model.norm.weight", (h,))
            embed = tensor("model.embed_tokens.weight", (int(cfg.vocab_size), h))
            tied = config.get("tie_word_embeddings", True) or not ckpt.has("lm_head.weight")
            lm_head = embed if tied else tensor("lm_head.weight", (int(cfg.vocab_size), h))
            pre = nn.Linear(2 * b, h, bias=False, device=device, dtype=dtype)
            pre.weight.data = tensor("pre_projection.weight", (h, 2 * b))
            post = nn.Linear(h, b, bias=False, device=device, dtype=dtype)
            post.weight.data = tensor("post_projection.weight", (b, h))
            centroids = None
            if config.get("use_ordered_embeddings"):
                c = int(config.get("num_centroids", 2048))
                centroids = (tensor("masked_embedding.centroids.weight", (c, h)),
                             tensor("masked_embedding.token_ordering", (int(cfg.vocab_size),), torch.long),
                             int(config.get("centroid_intermediate_top_k", 32)))
            rotary = Gemma4TextRotaryEmbedding(cfg, device=device)
        digest = hashlib.sha256(repr(sorted((n, ckpt.shape(n)) for n in ckpt.names)).encode())
    finally:
        ckpt.close()
    windows = {"sliding_attention": int(cfg.sliding_window)}
    fingerprint = f"{target.fingerprint}+assistant-{digest.hexdigest()[:16]}" if target.fingerprint else ""
    label = f"Gemma 4 assistant ({cfg.num_hidden_layers} layers, {folder.name})"
    draft = AssistantDraft(target, layers, list(cfg.layer_types), windows, norm, rotary, pre, post, lm_head,
                           centroids, cfg, label, fingerprint)
    log.info("draft: %s", label)
    return draft

