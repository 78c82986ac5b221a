"""A checkpoint's own draft head (Qwen3-Next / Qwen3.5 MTP, GLM-4.5 NextN) run as a draft model.

One MTP step, for the token x_p at position p: e = norm_e(embed(x_p)), g = norm_h(h_{p-1}),
u = fc(cat([e, g])) (embedding first in every family: vLLM's qwen3_next_mtp and glm4_moe_mtp),
u passes one decoder layer (the family's own transformers class, its own one-layer KV cache),
and the head's final norm then the target's lm_head give the distribution of x_{p+1}. h_{p-1}
is the hidden state of the token before: for committed text the TARGET's final normed hidden
state at p - 1 (what CausalLM.forward returns); for a tree node, the head's own output at its
parent, one level deeper. Which output recurses follows the references: Qwen's MTP feeds the
normed output (the one the lm_head reads), NextN the output before its `shared_head.norm`.
The references place the pair (x_p, h_{p-1}) at rotary position p - 1; here it sits at p, a
uniform shift, which rotary attention cannot tell apart (scores depend on differences only).

`HeadDraft` is a CausalLM as far as the decoding loop sees (forward, logits, new_cache, shape,
device, dtype): grow_tree, grow_static_tree and prune_to_accepted drive it unchanged. What it
needs besides tokens lives in its `HeadCache`: per entry the hidden state it produced (a
child's input) and whether its own input was known; per position the target's hidden states of
committed tokens, handed over by the engine after each target pass (`HeadCache.observe`). An
entry whose input was not known (position 0, text restored from a saved cache) is masked out
of attention, as the references never hold one; a tree batch whose nodes' parents are in the
same batch (a context chain) is read in waves, parents first, since a child's input is its
parent's output.

What this module does not do: find or read the head's tensors (heads.py), or decide when the
engine hands hidden states over (engine.decoding.generation).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from engine.model.cache import KVCache
from engine.model.causal_lm import CausalLM, causal_allowed
from engine.model.family import LayerKind
from engine.shapes import ModelShape

if TYPE_CHECKING:
    from transformers import PretrainedConfig


class HeadCache(KVCache):
    """The head's one-layer K/V, plus per entry its output hidden state (`own`, what a child
    reads) and whether the entry is valid (`seen`: its input hidden state was known), plus by
    position the target's hidden states of committed tokens (`trail`, `known`).

    Entries follow keep/truncate like any cache; the trail is by position and is cut only where
    the committed text changes (`forget_from`: a new turn that edits the conversation)."""

    def __init__(self, num_kv_heads: int, head_dim: int, hidden: int, dtype: torch.dtype,
                 device: torch.device | str, capacity: int = 256) -> None:
        self.hidden_size = hidden
        dev = torch.device(device)
        self.own = torch.empty((0, hidden), dtype=dtype, device=dev)
        self.seen = torch.zeros(0, dtype=torch.bool, device=dev)
        self.trail = torch.empty((0, hidden), dtype=dtype, device=dev)  # (positions, H) target hidden states
        self.known = torch.zeros(0, dtype=torch.bool, device=dev)
        self.trail_length = 0  # positions [0, trail_length) may be known; later ones are not
        self._wave: torch.Tensor | None = None  # slots a wave writes (HeadDraft.forward)
        self._end = 0
        super().__init__(1, num_kv_heads, head_dim, dtype, device, capacity)

    @torch.inference_mode()
    def _grow(self, capacity: int) -> None:
        super()._grow(capacity)
        own = torch.empty((capacity, self.hidden_size), dtype=self.dtype, device=self.device)
        seen = torch.zeros(capacity, dtype=torch.bool, device=self.device)
        own[: self.length] = self.own[: self.length]
        seen[: self.length] = self.seen[: self.length]
        self.own, self.seen = own, seen

    def bind_target(self, target: KVCache) -> None:
        """The target's cache the next passes write (only a head that reads it keeps it)."""

    # ---- the target's hidden states of committed tokens, by position ----------------------------
    def observe(self, start: int, hidden: torch.Tensor) -> None:
        """The target's final hidden states (n, H) of committed positions start.. start+n-1 (a
        target pass read them); what was kept from `start` on is replaced. (An EAGLE-3 head's
        cache takes the target's layer inputs instead and keeps them fused: eagle.py.)"""
        self._store(start, hidden)

    @torch.inference_mode()
    def _store(self, start: int, hidden: torch.Tensor) -> None:
        """Keep (n, H) rows as the trail's positions start.. start+n-1."""
        n = hidden.shape[0]
        end = start + n
        if end > self.trail.shape[0]:
            size = max(end, 2 * self.trail.shape[0], 64)
            trail = torch.empty((size, self.hidden_size), dtype=self.dtype, device=self.device)
            known = torch.zeros(size, dtype=torch.bool, device=self.device)
            trail[: self.trail_length] = self.trail[: self.trail_length]
            known[: self.trail_length] = self.known[: self.trail_length]
            self.trail, self.known = trail, known
        self.known[self.trail_length : start] = False  # a gap: never seen
        self.trail[start:end] = hidden.to(device=self.device, dtype=self.dtype)
        self.known[start:end] = True
        self.trail_length = end

    def knows(self, position: int) -> bool:
        return 0 <= position < self.trail_length and bool(self.known[position])

    def forget_from(self, position: int) -> None:
        """The committed text changes from `position` on: its hidden states are stale."""
        self.trail_length = max(0, min(self.trail_length, position))

    def inputs_at(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(n, H) the target's hidden states at `positions` (zeros where unknown), (n,) known."""
        inside = (positions >= 0) & (positions < self.trail_length)
        at = positions.clamp(0, max(self.trail_length - 1, 0))
        ok = inside & self.known[at] if self.trail_length else inside
        rows = self.trail[at] if self.trail_length else torch.zeros((positions.shape[0], self.hidden_size),
                                                                    dtype=self.dtype, device=self.device)
        return rows.masked_fill(~ok[:, None], 0), ok

    # ---- entries ---------------------------------------------------------------------------------
    @torch.inference_mode()
    def blank(self, n: int) -> None:
        """Append n invalid entries (text whose hidden states are not known: a restored file)."""
        self.reserve(n)
        end = self.length + n
        self.keys[0][:, :, self.length : end] = 0
        self.values[0][:, :, self.length : end] = 0
        self.positions[self.length : end] = torch.arange(self.length, end, device=self.device)
        self.seen[self.length : end] = False
        self.length = end

    def begin_wave(self, slots: torch.Tensor | None, end: int) -> None:
        self._wave, self._end = slots, end

    def update(self, key: torch.Tensor, value: torch.Tensor, layer_idx: int, *args: object,
               **kwargs: object) -> tuple[torch.Tensor, torch.Tensor]:
        """During a wave: write its entries at their own slots, return every entry up to the
        pass's end (those not written yet are zeros, masked)."""
        if self._wave is None:
            return super().update(key, value, layer_idx, *args, **kwargs)
        k_buf, v_buf = self.keys[0], self.values[0]
        k_buf[:, :, self._wave] = key
        v_buf[:, :, self._wave] = value
        return k_buf[:, :, : self._end], v_buf[:, :, : self._end]

    @torch.inference_mode()
    def keep(self, indices: torch.Tensor) -> None:
        indices = indices.to(self.device)
        n = indices.numel()
        self.own[:n] = self.own.index_select(0, indices)
        self.seen[:n] = self.seen.index_select(0, indices)
        super().keep(indices)

    def like(self, capacity: int) -> HeadCache:
        return HeadCache(self.num_kv_heads, self.head_dim, self.hidden_size, self.dtype, self.device, capacity)

    @torch.inference_mode()
    def copy_prefix(self, length: int, spare: int = 0) -> HeadCache:
        out = super().copy_prefix(length, spare)
        assert isinstance(out, HeadCache)
        out.own[:length] = self.own[:length]
        out.seen[:length] = self.seen[:length]
        if self.trail_length:
            out._store(0, self.trail[: self.trail_length])
            out.known[: self.trail_length] = self.known[: self.trail_length]
        return out

    @torch.inference_mode()
    def to(self, device: torch.device | str) -> HeadCache:
        device = torch.device(device)
        if device != self.device:
            self.own = self.own[: self.length].to(device)
            self.seen = self.seen[: self.length].to(device)
            self.trail = self.trail[: self.trail_length].to(device)
            self.known = self.known[: self.trail_length].to(device)
        super().to(device)
        return self

    def nbytes(self) -> int:
        return super().nbytes() + (self.own.numel() + self.trail.numel()) * self.own.element_size()


def hidden_sink(cache: KVCache | None, target: KVCache | None = None) -> Callable[[int, torch.Tensor], None] | None:
    """Where the engine hands the target's hidden states of committed tokens: the head's cache,
    or None for any other draft (nothing to keep, nothing spent). `target`: the cache the pass
    writes, for a head that reads the target's K/V (a Gemma 4 assistant binds to it)."""
    if not isinstance(cache, HeadCache):
        return None
    if target is not None:
        cache.bind_target(target)
    return cache.observe


class HeadDraft(CausalLM):
    """A head from the checkpoint, driven like a draft CausalLM: it shares the target's
    embedding, rotary table and lm_head (and its device and dtype), and owns its fc, norms and
    one decoder layer. Built by heads.load_head; CausalLM.__init__ is not run (there is no
    transformers model of the head), the attributes the engine reads are set here."""

    def __init__(self, target: CausalLM, layer: nn.Module, fc: nn.Linear, norm_embedding: nn.Module,
                 norm_hidden: nn.Module, norm: nn.Module, config: PretrainedConfig, recurse_normed: bool,
                 zero_first_embedding: bool, label: str, fingerprint: str) -> None:
        # no super().__init__: the loop reads the attributes below, nothing builds a transformers model
        self.target = target
        self.label = label
        self.hf_model = target.hf_model  # the model whose embedding and lm_head the head reads
        self.streamer = None
        self.fingerprint = fingerprint
        self.config = config  # the target's config with one full-attention layer (heads.py)
        self.inner = target.inner
        self.embed = target.embed
        self.rotary = target.rotary
        self.head = target.head
        self.layers = [layer]
        self.layer = layer.eval()
        self.fc = fc.eval()
        self.norm_embedding, self.norm_hidden = norm_embedding.eval(), norm_hidden.eval()
        self.norm = norm.eval()
        self.recurse_normed = recurse_normed
        self.zero_first_embedding = zero_first_embedding
        self.family = target.family
        self.kinds = [LayerKind(gated=target.family.gated_attention)]
        self.layer_types = ["full_attention"]
        self.windows = []
        self.linear = [None]
        self.per_layer_inputs = False
        self.kv_shapes = None
        self._layer_attrs = [[]]
        self.softcap = target.softcap
        attn: Any = layer.get_submodule("self_attn")
        self.num_kv_heads = config.num_attention_heads // int(attn.num_key_value_groups)
        self.head_dim = int(attn.head_dim)
        self.shape = replace(ModelShape.from_config(config, config.model_type),
                             vocab_size=target.shape.vocab_size)
        self.dtype = target.dtype
        self.device = target.device
        self.placement = target.placement
        self.fused = None

    def free_memory(self) -> int:
        return self.target.free_memory()

    def new_cache(self, capacity: int = 256) -> HeadCache:
        return HeadCache(self.num_kv_heads, self.head_dim, self.shape.hidden_size, self.dtype, self.device, capacity)

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # (n,) tokens of this pass
        positions: torch.Tensor,  # (n,) absolute positions
        cache: KVCache,
        allowed: torch.Tensor | None,  # (n, cache.length + n) bool; None = a chain of committed tokens
    ) -> torch.Tensor:
        """Read n tokens (see the module docstring), append their entries to `cache`; return
        their normed hidden states (n, H), which `logits` turns into the next token's."""
        assert isinstance(cache, HeadCache), "a head drafts with its own cache (new_cache)"
        n, past = input_ids.shape[0], cache.length
        device = self.device
        cache.reserve(n)
        positions = positions.to(device)
        cache.set_positions(positions)
        total = past + n
        slots = torch.arange(past, total, device=device)
        cache.keys[0][:, :, past:total] = 0  # a wave sees entries written later as zeros, masked
        cache.values[0][:, :, past:total] = 0
        cache.seen[past:total] = False
        if allowed is None:  # committed text: each token's input is the target's hidden state before it
            allowed = causal_allowed(past, n, device)
            parent = torch.full((n,), -1, dtype=torch.long, device=device)
        else:  # tree nodes: the input is the head's own output at the parent (the visible entry one position back)
            allowed = allowed.to(device)
            cols = cache.positions_through(n)  # (total,)
            match = allowed & (cols[None, :] == positions[:, None] - 1)
            index = torch.arange(total, device=device)
            parent = torch.where(match, index[None, :], -1).max(dim=1).values  # (n,)
        out = torch.empty((n, self.shape.hidden_size), dtype=self.dtype, device=device)
        done = torch.zeros(n, dtype=torch.bool, device=device)
        chain = bool((parent < 0).all())
        while not bool(done.all()):
            if chain:
                wave = torch.arange(n, device=device)
            else:
                parent_done = torch.where(parent >= past, done[(parent - past).clamp(min=0)], True)
                wave = (~done & parent_done).nonzero()[:, 0]
            assert wave.numel() > 0, "a node's parent comes after it"
            if chain:
                h_in, ok = cache.inputs_at(positions - 1)
            else:
                p = parent[wave]
                ok = (p >= 0) & cache.seen[p.clamp(min=0)]
                h_in = cache.own[p.clamp(min=0)].masked_fill(~ok[:, None], 0)
            own, normed = self._wave(cache, input_ids.to(device)[wave], positions[wave], slots[wave], ok, h_in,
                                     allowed[wave], total)
            cache.own[slots[wave]] = own
            out[wave] = normed
            done[wave] = True
        cache.begin_wave(None, 0)
        cache.commit(n)
        return out

    def _wave_mask(self, cache: HeadCache, slots: torch.Tensor, ok: torch.Tensor, allowed: torch.Tensor,
                   total: int) -> torch.Tensor:
        """Mark the wave's entries valid where their inputs were known; (r, total) additive mask
        over the valid entries each row may see (a row always sees itself)."""
        cache.seen[slots] = ok
        visible = allowed & cache.seen[:total][None, :]
        visible[torch.arange(slots.shape[0], device=slots.device), slots] = True
        mask = torch.zeros(visible.shape, dtype=self.dtype, device=self.device)
        mask.masked_fill_(~visible, self.mask_value())
        return mask

    def _wave(self, cache: HeadCache, ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
              ok: torch.Tensor, h_in: torch.Tensor, allowed: torch.Tensor,
              total: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer pass over rows whose inputs are ready: returns (own output, normed output)."""
        mask = self._wave_mask(cache, slots, ok, allowed, total)
        emb = self.embed(ids)  # (r, H)
        if self.zero_first_embedding:  # NextN: the references zero the embedding of their position 0
            emb = emb.masked_fill((positions == 1)[:, None], 0)
        x = self.fc(torch.cat([self.norm_embedding(emb), self.norm_hidden(h_in)], dim=-1))[None]  # (1, r, H)
        pos = positions[None]
        cache.begin_wave(slots, total)
        h = self.layer(x, attention_mask=mask[None, None], position_ids=pos, past_key_values=cache,
                       position_embeddings=self.rotary(x, position_ids=pos))
        h = (h[0] if isinstance(h, tuple) else h)[0]  # (r, H)
        normed = self.norm(h)
        return (normed if self.recurse_normed else h), normed
