"""Real tiny models whose greedy answer is a known script, for end-to-end tests of what a model's
answers are parsed into (reasoning, answer, tool calls), which random tiny models never exercise:
their output is gibberish that never closes a <think> block.

`scripted_model(dest, script, template, ...)` writes a folder with a real 2-layer Llama
(LlamaForCausalLM from a LlamaConfig, safetensors) and a fast tokenizer in which every piece of
the script is one token. The model is a first-order chain: every decoder layer adds nothing to
the residual stream (o_proj and down_proj are zero), so the logits at a position are
lm_head(norm(embed[t])) and depend only on that position's token t. The embedding rows are
orthonormal vectors, one per script piece and one shared by every other token; lm_head's row for
a token is the sum of the vectors of the tokens it follows. So greedy decoding maps any token
outside the script (the end of any prompt) to the first piece, each piece to the next, and the
last piece to EOS, with a margin of `scale` logits. The pieces must be distinct (the chain has no
memory), and the prompt's last token must be no piece: the builder renders the template and
checks. Any decoder (plain, a draft tree, draft-free candidates) that is lossless returns exactly
the script. `noise` perturbs every weight (the zeros included), for a draft that agrees often but
not always.

What this module does not do: sampling is not scripted (temperature > 0 picks the script too, the
margin is large, but tests should not rely on it); a piece repeated in a script needs a merged
token instead (e.g. harmony's second "<|channel|>" inside "<|end|><|start|>assistant<|channel|>final<|message|>").
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from engine import paths


@dataclass(frozen=True)
class Script:
    """A scripted answer: its pieces (one token each, in order) and what a parser should read
    from it. `specials`: the template's marker tokens (special tokens, as real models have them);
    `eos`: the token that ends the answer (special), `stops`: further ending tokens."""

    name: str
    pieces: tuple[str, ...]
    reasoning: str
    answer: str
    template: str
    specials: tuple[str, ...]
    eos: str
    stops: tuple[str, ...] = ()


PROBE = [{"role": "user", "content": "hello"}]  # the conversation the builder checks the prompt's end with


def scripted_model(dest: Path, script: Script, hidden: int = 64, layers: int = 2, scale: float = 30.0,
                   noise: float = 0.0, seed: int = 0) -> Path:
    """Write the model of `script` into `dest` (created) and return it; see the module docstring."""
    pieces = list(script.pieces)
    if len(set(pieces)) != len(pieces):
        raise ValueError(f"script {script.name!r}: a piece repeats (the chain has no memory): merge it into a "
                         "longer token")
    if len(pieces) + 1 > hidden:
        raise ValueError(f"script {script.name!r}: {len(pieces)} pieces need hidden > {len(pieces)}")
    dest.mkdir(parents=True, exist_ok=True)
    tokenizer = _tokenizer(script)
    tokenizer.save_pretrained(dest)
    (dest / "chat_template.jinja").write_text(script.template)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(dest)

    ids = [tokenizer.convert_tokens_to_ids(p) for p in pieces]
    if any(tokenizer.decode([i]) != p for i, p in zip(ids, pieces)):
        raise ValueError(f"script {script.name!r}: a piece is not one token that decodes to itself")
    prompt = tokenizer.apply_chat_template(PROBE, add_generation_prompt=True, tokenize=True)["input_ids"]
    if prompt[-1] in ids:
        raise ValueError(f"script {script.name!r}: the prompt ends with the script piece "
                         f"{tokenizer.decode(prompt[-1:])!r}: the answer would start mid-script")
    eos = tokenizer.convert_tokens_to_ids(script.eos)
    model = _chain_model(len(tokenizer), ids, eos, hidden, layers, scale, noise, seed)
    model.generation_config = GenerationConfig(
        eos_token_id=[eos, *(tokenizer.convert_tokens_to_ids(s) for s in script.stops)],
        bos_token_id=tokenizer.bos_token_id, pad_token_id=tokenizer.pad_token_id)
    model.save_pretrained(dest)
    (dest / "script.json").write_text(json.dumps({"pieces": pieces, "reasoning": script.reasoning,
                                                  "answer": script.answer}, indent=1))
    return dest


def cached_scripted_model(script: Script, cache_dir: Path | None = None, noise: float = 0.0) -> Path:
    """`scripted_model` built once under the cache (same script, same folder: its name carries a
    hash of the script), published whole."""
    digest = hashlib.sha256(json.dumps(dataclasses.asdict(script), sort_keys=True).encode()).hexdigest()[:12]
    final = (cache_dir or paths.cache_dir()) / "scripted" / f"{script.name}-{digest}-n{noise:g}"
    if (final / "config.json").is_file():
        return final

    def build(tmp: Path) -> None:
        scripted_model(tmp, script, noise=noise)

    return paths.publish_folder(final, build)


def _tokenizer(script: Script) -> PreTrainedTokenizerFast:
    """Byte-level BPE with no merges (any text encodes, one token per byte), the template's
    markers as special tokens and each script piece as an added token, matched whole."""
    byte_chars = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(byte_chars)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", *(s for s in script.specials if s != "<|endoftext|>")]
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
    tok.add_tokens([AddedToken(p, special=False, normalized=False) for p in script.pieces if p not in specials])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|endoftext|>", eos_token=script.eos,
                                   pad_token="<|endoftext|>", unk_token="<|endoftext|>")
    fast.chat_template = script.template
    return fast


def _chain_model(vocab: int, ids: Sequence[int], eos: int, hidden: int, layers: int, scale: float,
                 noise: float, seed: int) -> LlamaForCausalLM:
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                         tie_word_embeddings=False, bos_token_id=None, eos_token_id=eos, pad_token_id=None)
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).eval()
    # one orthonormal direction per class: 0 = every token outside the script, 1 + i = piece i
    basis, _ = torch.linalg.qr(torch.randn(hidden, len(ids) + 1, generator=gen))  # (H, K)
    embed = basis[:, 0].expand(vocab, hidden).clone()  # (V, H)
    successor = {0: ids[0]} | {1 + i: (ids[i + 1] if i + 1 < len(ids) else eos) for i in range(len(ids))}
    for i, t in enumerate(ids):
        embed[t] = basis[:, 1 + i]
    head = torch.zeros(vocab, hidden)  # (V, H)
    for cls, nxt in successor.items():  # norm(e) = sqrt(H) e for a unit e: logits are scale at the successor
        head[nxt] += basis[:, cls] * scale / hidden ** 0.5
    with torch.no_grad():
        model.model.embed_tokens.weight.copy_(embed)
        model.lm_head.weight.copy_(head)
        for layer in model.model.layers:  # each layer adds nothing: the residual stream stays the embedding
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        if noise:
            for p in model.parameters():
                p.add_(torch.randn(p.shape, generator=gen) * noise)
    return model
