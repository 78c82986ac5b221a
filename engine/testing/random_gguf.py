"""Random GGUF files of chosen sizes, where the bytes and their layout, not the values, set the
pace (the benchmarks' synthetic models): a Llama (`synthetic_gguf`, TinyLlama's proportions or
others), a Qwen3-MoE as llama.cpp's qwen3moe stores it (`synthetic_moe_gguf`), a gpt-oss and a
Qwen3.5-MoE hybrid (`synthetic_gpt_oss_gguf`, `synthetic_qwen35_gguf`), and a Gemma 4 MoE
(`synthetic_gemma4_gguf`). Tensors are
random blocks (gguf_write.random_tensor: random codes, fp16 scales setting weights of about
0.02), written one at a time; the tokenizer is the tiny one of engine.testing.synthetic.

`SYNTHETIC_MOE` has Qwen3-30B-A3B's layer (hidden 2048, 32 query and 4 K/V heads of 128, 128
experts of width 768, 8 routed per token, its 151,936-token vocabulary) in 8 of its 48 layers,
so it fits a small machine's RAM (about 3.6 GB in Q4_K_M); a token reads what one of the real
model's does in 8 layers. Its router is random floats. Its routing is not spread evenly: the
states of a random model's tokens are much alike, so consecutive tokens share most experts
(`specchat bench offload --moe`: 64 tokens wake 21 of 128 experts a layer, where evenly spread
routing would wake 126). A real model's union lies between the two.

What this module does not do: write anything meaningful to read (engine.testing.synthetic's tiny
models are the ones tests compare text with).
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import TypedDict

import numpy as np
from transformers import AutoTokenizer

from engine.testing.gguf_write import Q, random_tensor, write_gguf
from engine.testing.synthetic import SyntheticShape, _gguf_vocab, tiny_tokenizer_files


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


# gpt-oss-20b's layer (hidden 2880, 64 query and 8 K/V heads of 64, 32 experts of width 2880, 4 a
# token, MXFP4 experts) in 4 of its 24 layers, a 32,000-token vocabulary (its own has 201,088)
SYNTHETIC_GPT_OSS: MoEShape = dict(hidden=2880, layers=4, vocab=32000, heads=64, kv_heads=8, head_dim=64, experts=32,
                                   top_k=4, expert_width=2880)


def synthetic_gpt_oss_gguf(path: Path, hidden: int, layers: int, vocab: int, heads: int, kv_heads: int, head_dim: int,
                           experts: int, top_k: int, expert_width: int, dense_type: str = "Q8_0", seed: int = 0,
                           window: int = 128) -> Path:
    """A random gpt-oss GGUF as llama.cpp converts one: experts in MXFP4 (random codes, exponents
    near 2^-7), attention, embeddings and head in `dense_type`, biases, sinks and norms F32,
    `window`-token windows on even layers (gpt-oss's 128), YaRN. One tensor in memory at a time.
    Idempotent."""
    if path.is_file():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    q, kv = heads * head_dim, kv_heads * head_dim
    shapes: dict[str, tuple[int, ...]] = {
        "input_layernorm.weight": (hidden,), "self_attn.q_proj.weight": (q, hidden), "self_attn.q_proj.bias": (q,),
        "self_attn.k_proj.weight": (kv, hidden), "self_attn.k_proj.bias": (kv,),
        "self_attn.v_proj.weight": (kv, hidden), "self_attn.v_proj.bias": (kv,),
        "self_attn.o_proj.weight": (hidden, q), "self_attn.o_proj.bias": (hidden,), "self_attn.sinks": (heads,),
        "post_attention_layernorm.weight": (hidden,), "mlp.router.weight": (experts, hidden),
        "mlp.router.bias": (experts,),
        "mlp.experts.gate_proj": (experts, expert_width, hidden), "mlp.experts.gate_proj.bias": (experts, expert_width),
        "mlp.experts.up_proj": (experts, expert_width, hidden), "mlp.experts.up_proj.bias": (experts, expert_width),
        "mlp.experts.down_proj": (experts, hidden, expert_width), "mlp.experts.down_proj.bias": (experts, hidden)}
    tensors: list[tuple[str, tuple[int, ...], Q]] = [("model.embed_tokens.weight", (vocab, hidden), Q[dense_type])]
    for i in range(layers):
        for name, shape in shapes.items():
            qtype = (Q.MXFP4 if name.startswith("mlp.experts.") and not name.endswith(".bias")
                     else Q.F32 if len(shape) == 1 or name.endswith(".bias") or name.startswith("mlp.router")
                     else Q[dense_type])
            tensors.append((f"model.layers.{i}.{name}", shape, qtype))
    tensors += [("model.norm.weight", (hidden,), Q.F32), ("lm_head.weight", (vocab, hidden), Q[dense_type])]
    kinds = {name: (shape, qtype) for name, shape, qtype in tensors}
    rng = np.random.default_rng(seed)

    def value(name: str) -> np.ndarray:
        shape, qtype = kinds[name]
        if qtype == Q.MXFP4:  # ggml's blocks: an exponent byte, 16 bytes of two codes each
            blocks = rng.integers(0, 256, (int(np.prod(shape)) // 32, 17), dtype=np.uint8)
            blocks[:, 0] = rng.integers(118, 123, blocks.shape[0])
            return blocks.reshape(*shape[:-1], shape[-1] // 32 * 17)
        if name.endswith(("mlp.router.weight",)):
            return rng.normal(0.0, 1.0 / np.sqrt(hidden), shape).astype(np.float32)
        if name.endswith((".bias", "self_attn.sinks")):
            return rng.normal(0.0, 0.02, shape).astype(np.float32)
        return random_tensor(qtype, shape, rng)

    config = dict(hidden_size=hidden, intermediate_size=expert_width, num_hidden_layers=layers,
                  num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
                  max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=150000.0, vocab_size=vocab,
                  num_local_experts=experts, num_experts_per_tok=top_k, moe_intermediate_size=expert_width,
                  sliding_window=window, rope_scaling={"rope_type": "yarn", "factor": 32.0,
                                                   "original_max_position_embeddings": 4096})
    part = path.with_name(path.name + ".part")
    write_gguf(part, "gpt-oss", config, synthetic_vocab(), tensors, value, name=path.stem)
    os.replace(part, path)
    return path


class HybridShape(MoEShape):
    linear_k_heads: int
    linear_v_heads: int
    linear_head_dim: int


# Qwen3.6-35B-A3B's layers (hidden 2048; Gated DeltaNet with 16 key and 32 value heads of 128, a
# conv of 4; every fourth layer gated attention, 16 query and 2 K/V heads of 256, a quarter of each
# rotated; 256 experts of width 512, 8 routed, a shared expert of 512 under its gate) in 4 of its 40
# layers (three Gated DeltaNet, one attention, as the model alternates them), a 32,000-token
# vocabulary (its own has 248,320)
SYNTHETIC_QWEN35: HybridShape = dict(hidden=2048, layers=4, vocab=32000, heads=16, kv_heads=2, head_dim=256,
                                     linear_k_heads=16, linear_v_heads=32, linear_head_dim=128, experts=256, top_k=8,
                                     expert_width=512)


def synthetic_qwen35_gguf(path: Path, hidden: int, layers: int, vocab: int, heads: int, kv_heads: int, head_dim: int,
                          linear_k_heads: int, linear_v_heads: int, linear_head_dim: int, experts: int, top_k: int,
                          expert_width: int, layer_types: tuple[str, ...] = ("Q4_K/Q6_K",), seed: int = 0,
                          arch: str = "qwen35moe") -> Path:
    """A random Qwen3.5-MoE GGUF as llama.cpp stores one (qwen35moe): every fourth layer gated
    full attention, the rest Gated DeltaNet (its conv squeezed, A as -exp(A_log), the b and a
    rows, the conv, norms, router and shared expert's gate F32), routed and shared experts and
    the other matrices in `layer_types` (as synthetic_moe_gguf's). `arch` "qwen3next": a
    Qwen3-Next file instead (the same layers; b and a in one `ssm_ba`, per key head [b, a]; no
    mrope sections). One tensor in memory at a time. Idempotent."""
    if path.is_file():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    kd, vd = linear_k_heads * linear_head_dim, linear_v_heads * linear_head_dim
    conv = 2 * kd + vd
    attention: dict[str, tuple[int, ...]] = {
        "self_attn.q_proj.weight": (2 * heads * head_dim, hidden), "self_attn.k_proj.weight": (kv_heads * head_dim, hidden),
        "self_attn.v_proj.weight": (kv_heads * head_dim, hidden), "self_attn.o_proj.weight": (hidden, heads * head_dim),
        "self_attn.q_norm.weight": (head_dim,), "self_attn.k_norm.weight": (head_dim,)}
    linear: dict[str, tuple[int, ...]] = {  # GGUF's own names where gguf-py's table has none
        "linear_attn.in_proj_qkv.weight": (conv, hidden), "linear_attn.in_proj_z.weight": (vd, hidden),
        "ssm_beta.weight": (linear_v_heads, hidden), "ssm_alpha.weight": (linear_v_heads, hidden),
        "ssm_conv1d.weight": (conv, 4), "ssm_a": (linear_v_heads,), "ssm_dt.bias": (linear_v_heads,),
        "ssm_norm.weight": (linear_head_dim,), "linear_attn.out_proj.weight": (hidden, vd)}
    if arch == "qwen3next":  # (all by their GGUF names: gguf-py's qwen3next table names them otherwise)
        linear = {"attn_qkv.weight": (conv, hidden), "attn_gate.weight": (vd, hidden),
                  "ssm_ba.weight": (2 * linear_v_heads, hidden),
                  **{k: v for k, v in linear.items() if k.startswith("ssm") and k not in ("ssm_beta.weight", "ssm_alpha.weight")},
                  "ssm_out.weight": (hidden, vd)}
    ffn: dict[str, tuple[int, ...]] = {
        "post_attention_layernorm.weight": (hidden,), "mlp.gate.weight": (experts, hidden),
        "mlp.experts.gate_proj": (experts, expert_width, hidden), "mlp.experts.up_proj": (experts, expert_width, hidden),
        "mlp.experts.down_proj": (experts, hidden, expert_width), "mlp.shared_expert.gate_proj.weight": (expert_width, hidden),
        "mlp.shared_expert.up_proj.weight": (expert_width, hidden),
        "mlp.shared_expert.down_proj.weight": (hidden, expert_width), "mlp.shared_expert_gate.weight": (1, hidden)}
    tensors: list[tuple[str, tuple[int, ...], Q]] = [("model.embed_tokens.weight", (vocab, hidden), Q.Q4_K)]
    for i in range(layers):
        main, _, side = layer_types[i % len(layer_types)].partition("/")
        mixer = attention if i % 4 == 3 else {(f"blk.{i}.{k}" if k.startswith(("ssm", "attn_")) else k): v
                                               for k, v in linear.items()}
        for name, shape in {"input_layernorm.weight": (hidden,), **mixer, **ffn}.items():
            full = name if name.startswith("blk.") else f"model.layers.{i}.{name}"
            small = (len(shape) == 1 or name.endswith(("mlp.gate.weight", "shared_expert_gate.weight"))
                     or "ssm_" in name and not name.endswith("ssm_out.weight"))
            qtype = Q.F32 if small else Q[side] if side and name.endswith(("v_proj.weight", "down_proj")) else Q[main]
            tensors.append((full, shape, qtype))
    tensors += [("model.norm.weight", (hidden,), Q.F32), ("lm_head.weight", (vocab, hidden), Q.Q6_K)]
    kinds = {name: (shape, qtype) for name, shape, qtype in tensors}
    rng = np.random.default_rng(seed)

    def value(name: str) -> np.ndarray:
        shape, qtype = kinds[name]
        if name.endswith(".ssm_a"):  # -exp(A_log): negative, as every checkpoint's
            return -rng.uniform(0.5, 8.0, shape).astype(np.float32)
        if qtype == Q.F32 and (len(shape) == 1 and "norm" in name):
            return (1.0 + rng.normal(0.0, 0.02, shape)).astype(np.float32)
        if qtype == Q.F32:
            return rng.normal(0.0, 1.0 / np.sqrt(shape[-1]), shape).astype(np.float32)
        return random_tensor(qtype, shape, rng)

    config = dict(hidden_size=hidden, intermediate_size=expert_width, num_hidden_layers=layers,
                  num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim, rotary_dim=head_dim // 4,
                  max_position_embeddings=262144, rms_norm_eps=1e-6, rope_theta=10_000_000.0, vocab_size=vocab,
                  num_experts=experts, num_experts_per_tok=top_k, moe_intermediate_size=expert_width)
    keys: dict[str, object] = {
        "ssm.conv_kernel": 4, "ssm.state_size": linear_head_dim, "ssm.group_count": linear_k_heads,
        "ssm.time_step_rank": linear_v_heads, "ssm.inner_size": vd, "full_attention_interval": 4,
        "expert_shared_feed_forward_length": expert_width}
    if arch != "qwen3next":
        keys["rope.dimension_sections"] = [11, 11, 10, 0]
    part = path.with_name(path.name + ".part")
    write_gguf(part, arch, config, synthetic_vocab() if arch == "qwen3next" else {**synthetic_vocab(), "pre": "qwen35"},
               tensors, value, name=path.stem, keys=keys)
    os.replace(part, path)
    return path


# Qwen3-Next-80B-A3B's layers in 4 of its 48 (as SYNTHETIC_QWEN35's: the same mixers, 512 experts, 10 routed;
# its vocabulary has 151,936 tokens): synthetic_qwen35_gguf(..., arch="qwen3next")
SYNTHETIC_QWEN3NEXT: HybridShape = {**SYNTHETIC_QWEN35, "experts": 512, "top_k": 10}


class Gemma4Shape(MoEShape):
    global_head_dim: int
    global_kv_heads: int
    intermediate: int
    window: int


# Gemma 4 26B-A4B's layers (hidden 2816; 16 query heads of 256 and 8 K/V heads on the sliding layers,
# 16 of 512 and 2 K/V heads, keys as values, on the full ones; an MLP of 2112 beside 128 experts of 704,
# 8 routed: 25.2 B weights in all, 3.8 B a token) in 6 of its 30 layers, its pattern (five sliding, then
# one full), a 32,000-token vocabulary (its own has 262,144, tied to the embeddings as here)
SYNTHETIC_GEMMA4: Gemma4Shape = dict(hidden=2816, layers=6, vocab=32000, heads=16, kv_heads=8, head_dim=256,
                                     global_head_dim=512, global_kv_heads=2, intermediate=2112, experts=128, top_k=8,
                                     expert_width=704, window=1024)


# a small dense Gemma 4 with per-layer inputs, after its E2B (hidden 1536, 8 query heads and one K/V
# head, an MLP of 6144, twice as wide where a layer reuses K/V, per-layer inputs of 256): 12 layers,
# with shared=6 the last 6 reusing layers 4's and 5's K/V as llama.cpp expects (the last layer before
# them full); proportions of our choosing, not a checkpoint's; Q4_K as above
SYNTHETIC_GEMMA4_DENSE: Gemma4Shape = dict(hidden=1536, layers=12, vocab=32000, heads=8, kv_heads=1, head_dim=256,
                                           global_head_dim=512, global_kv_heads=1, intermediate=6144, experts=0,
                                           top_k=0, expert_width=0, window=512)


def synthetic_gemma4_gguf(path: Path, hidden: int, layers: int, vocab: int, heads: int, kv_heads: int, head_dim: int,
                          global_head_dim: int, global_kv_heads: int, intermediate: int, experts: int, top_k: int,
                          expert_width: int, window: int, per_layer: int = 0, shared: int = 0, seed: int = 0) -> Path:
    """A random Gemma 4 MoE GGUF as llama.cpp's converter writes one (gemma4; the metadata of
    tests/engine/loading/test_gguf_gemma4.py's converter): every sixth layer full attention with
    keys as values and the proportional rotary of a quarter of its heads (a `rope_freqs` of ones,
    then 1e30), the rest sliding windows of `window`; Q4_K_M-like types (q/k/o, gate/up and the
    experts' gate_up Q4_K; v Q6_K; the down projections, 2112 and 704 wide, Q8_0, llama.cpp's
    fallback where a row is no multiple of 256), norms, router and scales F32, tied embeddings
    Q6_K. `experts` 0: a dense model, as Gemma 4's small ones, with `per_layer` > 0 their per-layer
    inputs (a table of layers x per_layer values a token, Q8_0, and its projection) and `shared`
    last layers reusing the K/V of the last earlier layer of their type, their MLPs twice as wide.
    One tensor in memory at a time. Idempotent."""
    if path.is_file():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    full = [i % 6 == 5 for i in range(layers)]
    tensors: list[tuple[str, tuple[int, ...], Q]] = [
        ("rope_freqs.weight", (global_head_dim // 2,), Q.F32), ("token_embd.weight", (vocab, hidden), Q.Q6_K),
        ("output_norm.weight", (hidden,), Q.F32)]
    if per_layer:
        tensors += [("per_layer_token_embd.weight", (vocab, layers * per_layer), Q.Q8_0),
                    ("per_layer_model_proj.weight", (layers * per_layer, hidden), Q.Q8_0),
                    ("per_layer_proj_norm.weight", (per_layer,), Q.F32)]
    widths = [intermediate * (2 if i >= layers - shared else 1) for i in range(layers)]
    for i in range(layers):
        d, kv = (global_head_dim, global_kv_heads) if full[i] else (head_dim, kv_heads)
        b = f"blk.{i}"
        shapes: dict[str, tuple[tuple[int, ...], Q]] = {
            "layer_output_scale.weight": ((1,), Q.F32), "attn_q.weight": ((heads * d, hidden), Q.Q4_K),
            "attn_k.weight": ((kv * d, hidden), Q.Q4_K), "attn_v.weight": ((kv * d, hidden), Q.Q6_K),
            "attn_output.weight": ((hidden, heads * d), Q.Q4_K), "attn_q_norm.weight": ((d,), Q.F32),
            "attn_k_norm.weight": ((d,), Q.F32),
            **{f"{n}.weight": ((hidden,), Q.F32) for n in ("attn_norm", "post_attention_norm", "ffn_norm", "post_ffw_norm",
                                                          "pre_ffw_norm_2", "post_ffw_norm_1", "post_ffw_norm_2")},
            "ffn_gate.weight": ((widths[i], hidden), Q.Q4_K), "ffn_up.weight": ((widths[i], hidden), Q.Q4_K),
            "ffn_down.weight": ((hidden, widths[i]), Q.Q8_0), "ffn_gate_inp.weight": ((experts, hidden), Q.F32),
            "ffn_gate_inp.scale": ((hidden,), Q.F32), "ffn_down_exps.scale": ((experts,), Q.F32),
            "ffn_gate_up_exps.weight": ((experts, 2 * expert_width, hidden), Q.Q4_K),
            "ffn_down_exps.weight": ((experts, hidden, expert_width), Q.Q8_0)}
        if full[i]:  # keys as values
            del shapes["attn_v.weight"]
        if i >= layers - shared:  # another layer's K/V
            for name in ("attn_k.weight", "attn_v.weight", "attn_k_norm.weight"):
                shapes.pop(name, None)
        if not experts:
            for name in [n for n in shapes if "exps" in n or "gate_inp" in n or n.endswith(("_1.weight", "_2.weight"))]:
                del shapes[name]
        if per_layer:
            shapes.update({"inp_gate.weight": ((per_layer, hidden), Q.Q8_0), "proj.weight": ((hidden, per_layer), Q.Q8_0),
                           "post_norm.weight": ((hidden,), Q.F32)})
        tensors += [(f"{b}.{name}", shape, qtype) for name, (shape, qtype) in shapes.items()]
    kinds = {name: (shape, qtype) for name, shape, qtype in tensors}
    rng = np.random.default_rng(seed)
    rotated = global_head_dim // 8  # a quarter of the head's values: global_head_dim / 4 / 2 frequencies

    def value(name: str) -> np.ndarray:
        shape, qtype = kinds[name]
        if name == "rope_freqs.weight":
            return np.array([1.0] * rotated + [1e30] * (shape[0] - rotated), np.float32)
        if name.endswith(("norm.weight", ".scale", "layer_output_scale.weight")):  # factors about 1
            return (1.0 + rng.normal(0.0, 0.02, shape)).astype(np.float32)
        if qtype == Q.F32:  # the router
            return rng.normal(0.0, 1.0 / np.sqrt(shape[-1]), shape).astype(np.float32)
        return random_tensor(qtype, shape, rng)

    keys: dict[str, object] = {
        "block_count": layers, "context_length": 131072, "embedding_length": hidden, "feed_forward_length": widths if shared else intermediate,
        "attention.head_count": heads, "attention.head_count_kv": [global_kv_heads if f else kv_heads for f in full],
        "rope.freq_base": 1_000_000.0, "rope.freq_base_swa": 10_000.0, "attention.layer_norm_rms_epsilon": 1e-6,
        "attention.key_length": global_head_dim, "attention.value_length": global_head_dim,
        "attention.key_length_swa": head_dim, "attention.value_length_swa": head_dim, "attention.sliding_window": window,
        "attention.shared_kv_layers": shared, "embedding_length_per_layer_input": per_layer,
        "attention.sliding_window_pattern": [not f for f in full], "rope.dimension_count": global_head_dim,
        "rope.dimension_count_swa": head_dim, "final_logit_softcapping": 30.0}
    if experts:
        keys.update({"expert_count": experts, "expert_used_count": top_k, "expert_feed_forward_length": expert_width})
    config = dict(num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads, vocab_size=vocab)
    part = path.with_name(path.name + ".part")
    write_gguf(part, "gemma4", config, synthetic_vocab(), tensors, value, name=path.stem, keys=keys, common=False)
    os.replace(part, path)
    return path


# TinyLlama-1.1B's proportions: where memory bandwidth, not the interpreter, sets a CPU's pace (bench peer)
SYNTHETIC_1B: SyntheticShape = dict(hidden=2048, intermediate=5632, layers=22, vocab=32000, heads=32, kv_heads=4)
SYNTHETIC_GGUF_BIG: SyntheticShape = dict(hidden=4096, intermediate=11008, layers=12, vocab=32000, heads=32, kv_heads=8)  # ~1.5 GB
SYNTHETIC_GGUF_SMALL: SyntheticShape = dict(hidden=1024, intermediate=2816, layers=6, vocab=8000, heads=16, kv_heads=4)  # ~55 MB


def synthetic_vocab() -> dict:
    """The tiny tokenizer's vocabulary as a GGUF stores it (write_gguf pads it to a model's size)."""
    with tempfile.TemporaryDirectory() as tmp:
        tiny_tokenizer_files(Path(tmp))
        return _gguf_vocab(Path(tmp), AutoTokenizer.from_pretrained(tmp, trust_remote_code=False))


def synthetic_gguf(path: Path, hidden: int, intermediate: int, layers: int, vocab: int, heads: int, kv_heads: int,
                   layer_types: tuple[str, ...] = ("Q4_K/Q6_K",), embed_type: str = "Q4_K", head_type: str = "Q6_K",
                   seed: int = 0) -> Path:
    """A random Llama GGUF of a chosen size (types as in tiny_gguf; the default is a Q4_K_M
    file), of random blocks: weights of a sane magnitude whose values mean nothing, written
    as fast as random bytes, one tensor in memory at a time. Idempotent."""
    if path.is_file():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    vocab_meta = synthetic_vocab()
    kv = kv_heads * (hidden // heads)
    shapes: dict[str, tuple[int, ...]] = {
        "input_layernorm": (hidden,), "self_attn.q_proj": (hidden, hidden), "self_attn.k_proj": (kv, hidden),
        "self_attn.v_proj": (kv, hidden), "self_attn.o_proj": (hidden, hidden),
        "post_attention_layernorm": (hidden,), "mlp.gate_proj": (intermediate, hidden),
        "mlp.up_proj": (intermediate, hidden), "mlp.down_proj": (hidden, intermediate)}
    tensors: list[tuple[str, tuple[int, ...], Q]] = [("model.embed_tokens.weight", (vocab, hidden), Q[embed_type])]
    for i in range(layers):
        main, _, side = layer_types[i % len(layer_types)].partition("/")
        for name, shape in shapes.items():
            qtype = Q.F32 if len(shape) == 1 else Q[side] if side and name in ("self_attn.v_proj", "mlp.down_proj") \
                else Q[main]
            tensors.append((f"model.layers.{i}.{name}.weight", shape, qtype))
    tensors += [("model.norm.weight", (hidden,), Q.F32), ("lm_head.weight", (vocab, hidden), Q[head_type])]
    kinds = {name: (shape, qtype) for name, shape, qtype in tensors}
    rng = np.random.default_rng(seed)

    def value(name: str) -> np.ndarray:
        return random_tensor(kinds[name][1], kinds[name][0], rng)

    config = dict(hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
                  num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=4096,
                  rms_norm_eps=1e-5, rope_theta=10000.0, vocab_size=vocab)
    part = path.with_name(path.name + ".part")
    write_gguf(part, "llama", config, vocab_meta, tensors, value, name=path.stem)
    os.replace(part, path)
    return path
