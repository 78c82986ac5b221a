"""Tiny vision-language wrappers (Gemma 3, Qwen3.5, Qwen3.5-MoE) built with transformers' own
classes and saved by their save_pretrained: the key layout, vision tower and config nesting
of the real releases, at test size."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from transformers import (
    AutoModelForImageTextToText,
    AutoTokenizer,
    Gemma3Config,
    PretrainedConfig,
    Qwen3_5Config,
    Qwen3_5MoeConfig,
    SiglipVisionConfig,
)

from engine.testing.synthetic import TINY_FAMILIES, tiny_tokenizer_files

PAD = 8  # unused embedding rows past the tokenizer, where the image tokens live
COMMON = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=2048)
QWEN_VISION = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=14)


KINDS = ("gemma3", "qwen3_5", "qwen3_5_moe")


def _wrapper_config(kind: str, vocab: int, ids: dict, tie: bool | None) -> PretrainedConfig:
    images: dict[str, Any] = dict(image_token_id=vocab - 1, video_token_id=vocab - 2,
                                  vision_start_token_id=vocab - 3, vision_end_token_id=vocab - 4)
    outer: dict[str, Any] = {} if tie is None else {"tie_word_embeddings": tie}
    if kind == "gemma3":
        text = dict(TINY_FAMILIES["gemma3_text"], **COMMON, **ids, vocab_size=vocab, final_logit_softcapping=None,
                    layer_types=["sliding_attention", "full_attention"] * 2)
        text.pop("sliding_window_pattern")
        vision = SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                    image_size=28, patch_size=14)
        return Gemma3Config(text_config=text, vision_config=vision.to_dict(), mm_tokens_per_image=4,
                            image_token_index=vocab - 1, boi_token_index=vocab - 2, eoi_token_index=vocab - 3,
                            **outer)
    qwen = dict(TINY_FAMILIES["qwen3_5_text"])
    if kind == "qwen3_5":
        return Qwen3_5Config(text_config=dict(qwen, **COMMON, **ids, vocab_size=vocab, tie_word_embeddings=False),
                             vision_config=QWEN_VISION, **images, **outer)
    moe = dict(qwen, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48, shared_expert_intermediate_size=48)
    return Qwen3_5MoeConfig(text_config=dict(moe, **COMMON, **ids, vocab_size=vocab, tie_word_embeddings=False),
                            vision_config=QWEN_VISION, **images, **outer)


def tiny_wrapper(folder: Path, kind: str, tie: bool | None = None) -> Path:
    """A tiny random vision-language model of `kind` saved by transformers (its own key layout),
    with the tiny tokenizer; `tie` sets the wrapper's own tie_word_embeddings."""
    tiny_tokenizer_files(folder)
    tok = AutoTokenizer.from_pretrained(folder)
    ids = dict(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    config = _wrapper_config(kind, len(tok) + PAD, ids, tie)
    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_config(config, dtype=torch.float32)
    # peaked logits (as tiny_model's), so greedy text is no tie-break; a tied head gets small
    # embeddings, else each position's own token dominates its logits
    vocab_std = 0.02 if config.tie_word_embeddings else 0.3
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim >= 2:
                p.normal_(0.0, vocab_std if p.shape[0] == config.get_text_config().vocab_size else 0.15)
    model.save_pretrained(folder)
    return folder
