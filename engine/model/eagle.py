"""An EAGLE-3 head (eagle_spec.py finds and checks one) run as a draft.

One step, for the token x_p at position p: f = fc(cat(the target's inputs of its layers
`aux`, at position p - 1)) for committed text, or the head's own output at the node's parent
for a tree node (the "hidden" a child reads, one level deeper); then

    e = input_layernorm(embed(x_p)), g = hidden_norm(f), r = f (or g: norm_before_residual)
    a = attention(cat([e, g]))              q, k, v read 2 x hidden; the head's own one-layer K/V
    h = r + a;  h = h + mlp(post_attention_layernorm(h))
    the next token: lm_head(norm(h)) over the draft vocabulary, id i at target id i + d2t[i]
    what a child reads: h (before the norm)

as vLLM's and SGLang's EAGLE-3 drafters compute it. The target keeps the inputs of those layers
on every pass (CausalLM.read_layer_inputs, head_states), and the engine hands them over with
the committed tokens, as it hands an MTP head the final hidden states: `EagleCache.observe`
fuses them through fc once and keeps them by position. Tokens outside the draft vocabulary get
no probability from the head (the target still verifies every token, so text is unchanged).

The head is a HeadDraft (head_draft.py: its cache, tree waves and hand-over) with its own
layer, rotary table (the head's rope settings), lm_head and, when stored, embedding.

What this module does not do: find or check the head (eagle_spec.py), or price it against the
other drafts (engine.decoding.draft_choice: an "assistant", with the EAGLE-3 prior).
"""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path
from typing import Any

import torch
from torch import nn

from engine.errors import UnsupportedModel
from engine.loading.checkpoint import Checkpoint
from engine.model.assistant_spec import text_of
from engine.model.causal_lm import CausalLM
from engine.model.eagle_spec import eagle_spec, read_config
from engine.model.family import LayerKind
from engine.model.head_draft import HeadCache, HeadDraft

log = logging.getLogger(__name__)


class EagleCache(HeadCache):
    """A HeadCache whose trail keeps fc(the target's layer inputs) by position."""

    def __init__(self, num_kv_heads: int, head_dim: int, hidden: int, dtype: torch.dtype,
                 device: torch.device | str, capacity: int = 256, fuse: nn.Module | None = None) -> None:
        assert fuse is not None, "an EAGLE-3 cache fuses the target's states through the head's fc"
        self.fuse = fuse
        super().__init__(num_kv_heads, head_dim, hidden, dtype, device, capacity)

    @torch.inference_mode()
    def observe(self, start: int, hidden: torch.Tensor) -> None:
        """The target's layer inputs side by side (n, k x target width) of committed positions."""
        self._store(start, self.fuse(hidden.to(device=self.device, dtype=self.dtype)))

    def like(self, capacity: int) -> EagleCache:
        return EagleCache(self.num_kv_heads, self.head_dim, self.hidden_size, self.dtype, self.device, capacity,
                          self.fuse)


class EagleLayer(nn.Module):
    """The head's decoder layer: Llama attention whose q, k, v read 2 x hidden, a Llama MLP, and
    three RMS norms (the embedding's, the hidden state's, the MLP's)."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        from transformers.models.llama.modeling_llama import LlamaAttention, LlamaMLP, LlamaRMSNorm

        h, eps = int(config.hidden_size), float(config.rms_norm_eps)
        self.self_attn = LlamaAttention(config, 0)
        attn: Any = self.self_attn
        bias = bool(getattr(config, "attention_bias", False))
        for name in ("q_proj", "k_proj", "v_proj"):
            old: nn.Linear = getattr(attn, name)
            setattr(attn, name, nn.Linear(2 * h, old.out_features, bias=bias))
        self.mlp = LlamaMLP(config)
        self.input_layernorm = LlamaRMSNorm(h, eps=eps)
        self.hidden_norm = LlamaRMSNorm(h, eps=eps)
        self.post_attention_layernorm = LlamaRMSNorm(h, eps=eps)


class EagleDraft(HeadDraft):
    """An EAGLE-3 head driven like a draft CausalLM (see the module docstring). Built by load_eagle."""

    def __init__(self, target: CausalLM, layer: EagleLayer, fc: nn.Linear, norm: nn.Module, config: Any,
                 lm_head: nn.Linear, targets: torch.Tensor | None, embed: nn.Embedding | None,
                 norm_before_residual: bool, label: str, fingerprint: str) -> None:
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        super().__init__(target, layer, fc, layer.input_layernorm, layer.hidden_norm, norm, config,
                         recurse_normed=False, zero_first_embedding=False, label=label, fingerprint=fingerprint)
        if embed is not None:
            self.embed = embed
        self.rotary = LlamaRotaryEmbedding(config).to(target.device)
        self.kinds = [LayerKind()]
        self.softcap = None
        self.lm_head = lm_head.eval()
        self.targets = targets  # (draft vocabulary,) target ids; None: the same vocabulary
        self.norm_before_residual = norm_before_residual

    def new_cache(self, capacity: int = 256) -> EagleCache:
        return EagleCache(self.num_kv_heads, self.head_dim, self.shape.hidden_size, self.dtype, self.device, capacity,
                          self.fc)

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(k, H) normed outputs -> (k, V) fp32 logits over the target's vocabulary (-inf for the
        tokens the draft vocabulary leaves out)."""
        z = self.lm_head(hidden).float()
        if self.targets is None:
            return z
        out = z.new_full((z.shape[0], self.shape.vocab_size), float("-inf"))
        out[:, self.targets] = z
        return out

    def _wave(self, cache: HeadCache, ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
              ok: torch.Tensor, h_in: torch.Tensor, allowed: torch.Tensor,
              total: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One pass of the head's layer over rows whose inputs are ready: (own output, normed output)."""
        mask = self._wave_mask(cache, slots, ok, allowed, total)
        layer: Any = self.layer
        g = layer.hidden_norm(h_in)
        residual = g if self.norm_before_residual else h_in
        x = torch.cat([layer.input_layernorm(self.embed(ids)), g], dim=-1)[None]  # (1, r, 2H)
        pos = positions[None]
        cache.begin_wave(slots, total)
        a = layer.self_attn(x, position_embeddings=self.rotary(x, position_ids=pos), attention_mask=mask[None, None],
                            past_key_values=cache)[0][0]  # (r, H)
        h = residual + a
        h = h + layer.mlp(layer.post_attention_layernorm(h))
        return h, self.norm(h)


def load_eagle(folder: Path, target: CausalLM) -> EagleDraft:
    """The EAGLE-3 head in `folder` as a draft for the loaded `target` (which from now on keeps
    the inputs of the layers the head reads). UnsupportedModel when it does not fit."""
    folder = Path(folder)
    spec = eagle_spec(folder, text_of(target.config))
    if spec is None:
        raise UnsupportedModel(f"{folder} holds no EAGLE-3 head (its config.json names no Eagle3 architecture).")
    if spec.problem:
        raise UnsupportedModel(f"The EAGLE-3 head in {folder} cannot draft for this model: {spec.problem}. Load the "
                               "model without it or pick another draft.")
    config = read_config(folder)
    assert config is not None
    cfg = head_config(config, target)
    device, dtype = target.device, target.dtype
    ckpt = Checkpoint(folder, {})
    try:
        def load(role: str, dt: torch.dtype = dtype) -> torch.Tensor:
            name = spec.stored(role)
            assert name is not None, role
            return ckpt.load(name, dt, device)

        with torch.device("meta"):
            layer = EagleLayer(cfg)
        layer.to_empty(device=device)
        with torch.inference_mode():
            for name, p in layer.named_parameters():
                p.data = load(name)
            h, v = int(cfg.hidden_size), int(target.shape.vocab_size)
            fc = nn.Linear(len(spec.aux) * int(text_of(target.config).hidden_size), h, bias=False, device=device,
                           dtype=dtype)
            fc.weight.data = load("fc.weight")
            norm = type(layer.hidden_norm)(h, eps=float(cfg.rms_norm_eps)).to(device=device, dtype=dtype)
            norm.weight.data = load("norm.weight")
            lm_head = nn.Linear(h, int(cfg.draft_vocab_size), bias=False, device=device, dtype=dtype)
            lm_head.weight.data = load("lm_head.weight")
            targets = _targets(load("d2t", torch.int64) if spec.stored("d2t") else None, v)
            embed = None
            if spec.stored("embed_tokens.weight"):
                embed = nn.Embedding(v, h, device=device, dtype=dtype)
                embed.weight.data = load("embed_tokens.weight")
        digest = hashlib.sha256(repr([(n, ckpt.shape(n), str(ckpt.dtype(n))) for _, n in spec.names]
                                     + [spec.aux]).encode())
    finally:
        ckpt.close()
    target.read_layer_inputs(spec.aux)
    fingerprint = f"{target.fingerprint}+eagle3-{digest.hexdigest()[:16]}" if target.fingerprint else ""
    log.info("draft: the %s, reading the model's layers %s", spec.label, list(spec.aux))
    return EagleDraft(target, layer.eval(), fc.eval(), norm.eval(), cfg, lm_head, targets, embed,
                      bool(config.get("norm_before_residual", False)), spec.label, fingerprint)


def head_config(config: dict[str, Any], target: CausalLM) -> Any:
    """A LlamaConfig of the head's layer (the target's vocabulary, one layer, eager attention)."""
    from transformers import LlamaConfig

    keys = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
            "rms_norm_eps", "rope_theta", "rope_scaling", "rope_parameters", "max_position_embeddings",
            "attention_bias", "hidden_act", "draft_vocab_size")
    fields = {k: config[k] for k in keys if config.get(k) is not None}
    fields.setdefault("draft_vocab_size", int(target.shape.vocab_size))
    cfg = LlamaConfig(**{**fields, "num_hidden_layers": 1, "vocab_size": int(target.shape.vocab_size),
                         "mlp_bias": False})
    cfg._attn_implementation = "sdpa"
    return cfg


def _targets(d2t: torch.Tensor | None, vocab: int) -> torch.Tensor | None:
    """Target ids of the draft vocabulary (i + d2t[i]), checked; None when there is no map."""
    if d2t is None:
        return None
    ids = torch.arange(d2t.shape[0], device=d2t.device) + d2t
    if bool(((ids < 0) | (ids >= vocab)).any()) or torch.unique(ids).numel() != ids.numel():
        raise UnsupportedModel("The EAGLE-3 head's d2t map sends draft tokens outside the model's vocabulary or two "
                               "to one token: its files are damaged or belong to another model.")
    return None if ids.numel() == vocab and bool((d2t == 0).all()) else ids

