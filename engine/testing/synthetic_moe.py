"""A random MoE GGUF of a chosen size, as llama.cpp's qwen3moe stores Qwen3-MoE: for `specchat
bench offload --moe` and `specchat bench peer --moe`, where the experts' bytes and routing, not
the values, set the pace.

`SYNTHETIC_MOE` has Qwen3-30B-A3B's layer (hidden 2048, 32 query and 4 K/V heads of 128, 128
experts of width 768, 8 routed per token, its 151,936-token vocabulary) in 8 of its 48 layers,
so it fits a small machine's RAM (about 2.9 GB in Q4_K_M); a token reads what one of the
real model's does in 8 layers. The attention and expert matrices are random blocks
(gguf_write.random_blocks: random codes, fp16 scales setting weights of about 0.02); the router
is random floats. Its routing is not spread evenly: the states of a random model's tokens are
much alike, so consecutive tokens share most experts (`specchat bench offload --moe`: 64 tokens
wake 21 of 128 experts a layer, where evenly spread routing would wake 126). A real model's
union lies between the two.

What this module does not do: write a dense model (synthetic.synthetic_gguf) or anything
meaningful to read.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TypedDict

import numpy as np
from engine.testing.gguf_write import Q, random_tensor, write_gguf
from engine.testing.synthetic import synthetic_vocab


class MoEShape(TypedDict):
    hidden: int
    layers: int
    vocab: int
    heads: int
    kv_heads: int
    head_dim: int
    experts: int
    top_k: int
    expert_width: int


SYNTHETIC_MOE: MoEShape = dict(hidden=2048, layers=8, vocab=151936, heads=32, kv_heads=4, head_dim=128, experts=128,
                               top_k=8, expert_width=768)
# smaller proportions, at a size a test or a quick bench writes in a second
SYNTHETIC_MOE_SMALL: MoEShape = dict(hidden=256, layers=2, vocab=4096, heads=4, kv_heads=2, head_dim=64, experts=32,
                                     top_k=4, expert_width=256)


def synthetic_moe_gguf(path: Path, hidden: int, layers: int, vocab: int, heads: int, kv_heads: int, head_dim: int,
                       experts: int, top_k: int, expert_width: int, layer_types: tuple[str, ...] = ("Q4_K/Q6_K",),
                       embed_type: str = "Q4_K", head_type: str = "Q6_K", seed: int = 0) -> Path:
    """Write the random Qwen3-MoE GGUF (types as tiny_gguf's: "Q4_K/Q6_K" is a Q4_K_M layer, its
    attn_v and down experts in Q6_K), one tensor in memory at a time. Idempotent."""
    if path.is_file():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    vocab_meta = synthetic_vocab()
    q, kv = heads * head_dim, kv_heads * head_dim
    shapes: dict[str, tuple[int, ...]] = {
        "input_layernorm.weight": (hidden,), "self_attn.q_proj.weight": (q, hidden),
        "self_attn.k_proj.weight": (kv, hidden), "self_attn.v_proj.weight": (kv, hidden),
        "self_attn.o_proj.weight": (hidden, q), "self_attn.q_norm.weight": (head_dim,),
        "self_attn.k_norm.weight": (head_dim,), "post_attention_layernorm.weight": (hidden,),
        "mlp.gate.weight": (experts, hidden), "mlp.experts.gate_proj": (experts, expert_width, hidden),
        "mlp.experts.up_proj": (experts, expert_width, hidden), "mlp.experts.down_proj": (experts, hidden, expert_width)}
    tensors: list[tuple[str, tuple[int, ...], Q]] = [("model.embed_tokens.weight", (vocab, hidden), Q[embed_type])]
    for i in range(layers):
        main, _, side = layer_types[i % len(layer_types)].partition("/")
        for name, shape in shapes.items():
            if len(shape) == 1 or name == "mlp.gate.weight":  # norms and the router: F32, as llama.cpp keeps them
                qtype = Q.F32
            else:
                qtype = Q[side] if side and name in ("self_attn.v_proj.weight", "mlp.experts.down_proj") else Q[main]
            tensors.append((f"model.layers.{i}.{name}", shape, qtype))
    tensors += [("model.norm.weight", (hidden,), Q.F32), ("lm_head.weight", (vocab, hidden), Q[head_type])]
    kinds = {name: (shape, qtype) for name, shape, qtype in tensors}
    rng = np.random.default_rng(seed)

    def value(name: str) -> np.ndarray:
        shape, qtype = kinds[name]
        if name.endswith("mlp.gate.weight"):  # the router: random floats
            return rng.normal(0.0, 1.0 / np.sqrt(hidden), shape).astype(np.float32)
        return random_tensor(qtype, shape, rng)

    config = dict(hidden_size=hidden, intermediate_size=experts * expert_width // top_k, num_hidden_layers=layers,
                  num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
                  max_position_embeddings=4096, rms_norm_eps=1e-6, rope_theta=1_000_000.0, vocab_size=vocab,
                  num_experts=experts, num_experts_per_tok=top_k, moe_intermediate_size=expert_width)
    part = path.with_name(path.name + ".part")
    write_gguf(part, "qwen3moe", config, vocab_meta, tensors, value, name=path.stem)
    os.replace(part, path)
    return path
