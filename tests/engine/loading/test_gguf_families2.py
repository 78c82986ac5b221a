"""GGUF files of gpt-oss, GLM-4.5, Qwen3.5, Qwen3.5-MoE and Qwen3-Next, written here as llama.cpp's
converter writes them, load and run what the transformers model they were converted from computes.

Each tiny model is built from transformers' own config class with random weights (sliding
windows shorter than the prompt, routed and shared experts, dense first layers, Gated DeltaNet
layers between gated full-attention ones), and converted by this file's converter, which
follows llama.cpp's convert_hf_to_gguf: gpt-oss's MXFP4 experts repacked into ggml's MXFP4
blocks (gate and up rows split out of the interleaved gate_up, the nibbles reordered), its sinks
and biases, YaRN and window in the metadata; GLM-4.5's experts stacked, its NextN layer counted
in block_count, its router bias as `exp_probs_b.bias`; the hybrids' norms stored plus one,
A_log as -exp(A_log), the convolution squeezed, Qwen3-Next's in_proj_qkvz split into qkv and z,
Qwen3.5's value heads re-tiled, an MTP layer after the decoder's. Matrices are stored in Q8_0,
embeddings in F16, the rest in F32; the reference model then holds the values the file holds
(each matrix de-quantised by gguf-py), so logits agree to float rounding and greedy text is
identical to transformers' generate. Gemma 4 is in test_gguf_gemma4.py."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf import GGUFReader, GGUFWriter
from gguf import quants as gq
from gguf.constants import TokenType
from test_gguf_families import assert_experts_cached_beside_cpu, assert_experts_on_cpu_beside_gpu, greedy, logits
from torch import nn
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    Glm4MoeConfig,
    GptOssConfig,
    PreTrainedTokenizerBase,
    Qwen3_5MoeTextConfig,
    Qwen3_5TextConfig,
    Qwen3NextConfig,
)

from engine.decoding.generation import Engine
from engine.errors import UnsupportedModel
from engine.kernels import build
from engine.kernels.experts import PackedExperts
from engine.loading.gguf import GGUFWeights, gguf_config, isolated
from engine.loading.load import load_model
from engine.loading.materialise import layer_buffers_as_parameters
from engine.loading.mxfp4 import dequantize_mxfp4
from engine.store import gguf_archs
from engine.store.gguf_header import read_header
from engine.testing.gguf_write import add_keys
from engine.testing.synthetic import _gguf_vocab, tiny_tokenizer_files

PROMPTS = ["Paris is the capital of the country where people", "def add(a, b):\n    return a + b\nfor i in"]
NEW_TOKENS = 16
WINDOW = 4  # shorter than every prompt


@pytest.fixture(autouse=True)
def _cache_dir(model_cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPECCHAT_CACHE_DIR", str(model_cache))


@pytest.fixture(scope="session")
def vocab(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, PreTrainedTokenizerBase]:
    """The tiny byte-level BPE tokenizer as GGUF metadata, and as transformers reads it."""
    folder = tmp_path_factory.mktemp("tokenizer")
    tiny_tokenizer_files(folder)
    tok = AutoTokenizer.from_pretrained(folder)
    return _gguf_vocab(folder, tok), tok


# ---- the converter --------------------------------------------------------------------------
Stored = dict[str, tuple[np.ndarray, Q]]  # GGUF name -> (values, or MXFP4 bytes; its type)


def write_gguf(path: Path, arch: str, keys: dict[str, Any], vocab: dict, tensors: Stored) -> Path:
    """A GGUF as llama.cpp writes one: `keys` under the architecture's prefix, the tokenizer, the
    tensors (Q8_0 quantised here by gguf-py; MXFP4 given as ggml's blocks)."""
    w = GGUFWriter(path, arch)
    w.add_name("tiny")
    add_keys(w, arch, keys)
    tokens = vocab["tokens"]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(vocab.get("pre", "default"))
    w.add_token_list(tokens)
    w.add_token_types([TokenType.CONTROL if t in vocab["special"] else TokenType.NORMAL for t in tokens])
    w.add_token_merges(vocab["merges"])
    w.add_bos_token_id(vocab["bos_id"])
    w.add_eos_token_id(vocab["eos_id"])
    w.add_pad_token_id(vocab["pad_id"])
    w.add_add_bos_token(False)
    w.add_chat_template(vocab["chat_template"])
    for name, (value, qtype) in tensors.items():
        if qtype == Q.F32:
            w.add_tensor(name, value.astype(np.float32))
        elif qtype == Q.F16:
            w.add_tensor(name, value.astype(np.float16))
        elif value.dtype == np.uint8:  # ggml blocks already (MXFP4, or a tensor copied from a file)
            w.add_tensor(name, value, raw_dtype=qtype)
        else:
            w.add_tensor(name, gq.quantize(value.astype(np.float32), qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def as_stored(p: torch.Tensor, qtype: Q) -> tuple[np.ndarray, Q]:
    """A parameter as the file stores it, with the parameter set to the file's values."""
    value = p.detach().float().numpy()
    if qtype == Q.F16:
        p.data.copy_(torch.from_numpy(value.astype(np.float16).astype(np.float32)))
    elif qtype == Q.Q8_0:  # blocks run along rows: the parameter's own rows, however they are split
        p.data.copy_(torch.from_numpy(gq.dequantize(gq.quantize(value, qtype), qtype).reshape(value.shape)))
    return value, qtype


def randomise(model: nn.Module, seed: int, std: float = 0.15) -> None:
    """Random weights of a size that makes a tiny model's logits peaked (norms around 1)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in list(model.named_parameters()) + list(model.named_buffers()):
            if not p.is_floating_point() or "rotary" in name or name.endswith("inv_freq"):
                continue
            noise = torch.randn(p.shape, generator=g)
            if "norm" in name:
                p.copy_(1 + 0.1 * noise)
            elif p.ndim == 1 or "bias" in name or "sinks" in name:
                p.copy_(0.05 * noise)
            else:
                p.copy_(std * noise)


def common_keys(config: Any, layers: int) -> dict[str, Any]:
    """What llama.cpp's TextModel writes for every architecture (a dense width where there is one)."""
    dense = {"feed_forward_length": config.intermediate_size} if hasattr(config, "intermediate_size") else {}
    return {**dense, "context_length": config.max_position_embeddings, "embedding_length": config.hidden_size,
            "block_count": layers,
            "attention.head_count": config.num_attention_heads,
            "attention.head_count_kv": config.num_key_value_heads, "attention.key_length": config.head_dim,
            "attention.value_length": config.head_dim,
            "rope.freq_base": float(config.rope_parameters["rope_theta"]),
            "attention.layer_norm_rms_epsilon": float(config.rms_norm_eps), "vocab_size": config.vocab_size}


def outer(model: Any) -> Stored:
    return {"token_embd.weight": as_stored(model.model.embed_tokens.weight, Q.F16),
            "output_norm.weight": as_stored(model.model.norm.weight, Q.F32),
            "output.weight": as_stored(model.lm_head.weight, Q.Q8_0)}


def attention(blk: str, attn: Any, biases: bool) -> Stored:
    out = {}
    for ours, theirs in (("attn_q", "q_proj"), ("attn_k", "k_proj"), ("attn_v", "v_proj"), ("attn_output", "o_proj")):
        linear = getattr(attn, theirs)
        out[f"{blk}.{ours}.weight"] = as_stored(linear.weight, Q.Q8_0)
        if biases and linear.bias is not None:
            out[f"{blk}.{ours}.bias"] = as_stored(linear.bias, Q.F32)
    return out


# ---- gpt-oss ----------------------------------------------------------------------------------
def random_mxfp4(g: torch.Generator, experts: int, rows: int, cols: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A checkpoint's MXFP4 pair: (E, rows, cols/32, 16) blocks (byte j: values 2j and 2j+1) and
    E8M0 scales near 2^-7, so values stay small."""
    blocks = torch.randint(0, 256, (experts, rows, cols // 32, 16), generator=g, dtype=torch.uint8)
    scales = torch.randint(118, 123, (experts, rows, cols // 32), generator=g, dtype=torch.uint8)
    return blocks, scales


def ggml_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> np.ndarray:
    """The checkpoint's pair as ggml's block_mxfp4 (one E8M0 byte, then 16 bytes of which byte j
    holds values j and j+16), (E, rows, cols/32 * 17) bytes: llama.cpp's repack_mxfp4."""
    codes = torch.stack((blocks & 0x0F, blocks >> 4), dim=-1).flatten(-2)  # (E, rows, groups, 32)
    qs = codes[..., :16] | (codes[..., 16:] << 4)
    packed = torch.cat((scales.unsqueeze(-1), qs), dim=-1)  # (E, rows, groups, 17)
    return packed.flatten(-2).numpy()


def gpt_oss(tok: PreTrainedTokenizerBase, vocab: dict, path: Path, fused: bool = False) -> nn.Module:
    """A tiny gpt-oss (4 layers alternating 4-token windows and full attention, 4 experts, top 2,
    sinks, YaRN), written to `path` as llama.cpp converts it; returned with the file's values."""
    config = GptOssConfig(vocab_size=len(vocab["tokens"]), hidden_size=64, intermediate_size=64, num_hidden_layers=4,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
                          num_experts_per_tok=2, sliding_window=WINDOW, max_position_embeddings=256,
                          rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                                           "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                                           "rope_theta": 10000.0},
                          tie_word_embeddings=False, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                          pad_token_id=tok.pad_token_id)
    model: Any = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    randomise(model, seed=3)
    g = torch.Generator().manual_seed(4)
    tensors = outer(model)
    for i, layer in enumerate(model.model.layers):
        blk = f"blk.{i}"
        tensors.update(attention(blk, layer.self_attn, biases=True))
        tensors[f"{blk}.attn_sinks.weight"] = as_stored(layer.self_attn.sinks, Q.F32)
        tensors[f"{blk}.attn_norm.weight"] = as_stored(layer.input_layernorm.weight, Q.F32)
        tensors[f"{blk}.post_attention_norm.weight"] = as_stored(layer.post_attention_layernorm.weight, Q.F32)
        tensors[f"{blk}.ffn_gate_inp.weight"] = as_stored(layer.mlp.router.weight, Q.F32)
        tensors[f"{blk}.ffn_gate_inp.bias"] = as_stored(layer.mlp.router.bias, Q.F32)
        experts = layer.mlp.experts
        e, h, i2 = experts.gate_up_proj.shape
        blocks, scales = random_mxfp4(g, e, i2, h)  # (E, 2I, H/32, 16): gate and up rows interleaved
        down_blocks, down_scales = random_mxfp4(g, e, h, i2 // 2)
        with torch.no_grad():  # the checkpoint's values, as transformers de-quantises them
            experts.gate_up_proj.copy_(torch.stack([dequantize_mxfp4(blocks[x], scales[x]) for x in range(e)]))
            experts.down_proj.copy_(torch.stack([dequantize_mxfp4(down_blocks[x], down_scales[x]) for x in range(e)]))
        bias = experts.gate_up_proj_bias.detach().numpy()
        if fused:  # llama.cpp's --fuse-gate-up-exps: gate rows, then up rows, one tensor
            tensors[f"{blk}.ffn_gate_up_exps.weight"] = (np.concatenate(
                [ggml_mxfp4(blocks[:, ::2], scales[:, ::2]), ggml_mxfp4(blocks[:, 1::2], scales[:, 1::2])], 1), Q.MXFP4)
            tensors[f"{blk}.ffn_gate_up_exps.bias"] = (np.concatenate([bias[:, ::2], bias[:, 1::2]], 1), Q.F32)
        else:
            tensors[f"{blk}.ffn_gate_exps.weight"] = (ggml_mxfp4(blocks[:, ::2], scales[:, ::2]), Q.MXFP4)
            tensors[f"{blk}.ffn_up_exps.weight"] = (ggml_mxfp4(blocks[:, 1::2], scales[:, 1::2]), Q.MXFP4)
            tensors[f"{blk}.ffn_gate_exps.bias"] = (bias[:, ::2], Q.F32)
            tensors[f"{blk}.ffn_up_exps.bias"] = (bias[:, 1::2], Q.F32)
        tensors[f"{blk}.ffn_down_exps.weight"] = (ggml_mxfp4(down_blocks, down_scales), Q.MXFP4)
        tensors[f"{blk}.ffn_down_exps.bias"] = as_stored(experts.down_proj_bias, Q.F32)
    rope: dict[str, Any] = dict(config.rope_parameters or {})
    keys = {**common_keys(config, config.num_hidden_layers), "expert_count": 4, "expert_used_count": 2,
            "expert_feed_forward_length": config.intermediate_size, "attention.sliding_window": WINDOW,
            "rope.dimension_count": config.head_dim, "rope.scaling.type": "yarn",
            "rope.scaling.factor": float(rope["factor"]),
            "rope.scaling.original_context_length": int(rope["original_max_position_embeddings"])}
    write_gguf(path, "gpt-oss", keys, vocab, tensors)
    return model


# ---- GLM-4.5 ----------------------------------------------------------------------------------
def glm4moe(tok: PreTrainedTokenizerBase, vocab: dict, path: Path) -> nn.Module:
    """A tiny GLM-4.5 (3 layers, the first dense; 4 routed experts, top 2, sigmoid routing with
    a score bias, one shared expert; q/k/v biases; rotary on half of each head), with one NextN
    layer in the file as llama.cpp writes it (counted in block_count, skipped by the loader)."""
    shape: dict[str, Any] = dict(  # head_dim: a field transformers' class reads though it does not declare it
        vocab_size=len(vocab["tokens"]), hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16, n_routed_experts=4,
        num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1, routed_scaling_factor=1.5,
        attention_bias=True, max_position_embeddings=256, tie_word_embeddings=False,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    config = Glm4MoeConfig(**shape)
    model: Any = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    randomise(model, seed=5)
    tensors = outer(model)
    for i, layer in enumerate(model.model.layers):
        blk = f"blk.{i}"
        tensors.update(attention(blk, layer.self_attn, biases=True))
        tensors[f"{blk}.attn_norm.weight"] = as_stored(layer.input_layernorm.weight, Q.F32)
        tensors[f"{blk}.post_attention_norm.weight"] = as_stored(layer.post_attention_layernorm.weight, Q.F32)
        mlp = layer.mlp
        if i < config.first_k_dense_replace:
            for ours in ("gate", "up", "down"):
                tensors[f"{blk}.ffn_{ours}.weight"] = as_stored(getattr(mlp, f"{ours}_proj").weight, Q.Q8_0)
            continue
        tensors[f"{blk}.ffn_gate_inp.weight"] = as_stored(mlp.gate.weight, Q.F32)
        tensors[f"{blk}.exp_probs_b.bias"] = as_stored(mlp.gate.e_score_correction_bias, Q.F32)
        gate_up, _ = as_stored(mlp.experts.gate_up_proj, Q.Q8_0)  # (E, 2I, H): llama.cpp stacks gate and up apart
        width = gate_up.shape[1] // 2
        tensors[f"{blk}.ffn_gate_exps.weight"] = (gate_up[:, :width], Q.Q8_0)
        tensors[f"{blk}.ffn_up_exps.weight"] = (gate_up[:, width:], Q.Q8_0)
        tensors[f"{blk}.ffn_down_exps.weight"] = as_stored(mlp.experts.down_proj, Q.Q8_0)
        for ours in ("gate", "up", "down"):
            tensors[f"{blk}.ffn_{ours}_shexp.weight"] = as_stored(getattr(mlp.shared_experts, f"{ours}_proj").weight,
                                                                  Q.Q8_0)
    nextn = f"blk.{config.num_hidden_layers}"  # the MTP layer: tensors the decoder does not use
    rng = np.random.default_rng(0)
    for name, dims in (("attn_norm.weight", (64,)), ("nextn.eh_proj.weight", (64, 128)),
                       ("nextn.enorm.weight", (64,)), ("nextn.hnorm.weight", (64,))):
        tensors[f"{nextn}.{name}"] = (rng.standard_normal(dims).astype(np.float32), Q.F32)
    keys = {**common_keys(config, config.num_hidden_layers + 1), "rope.dimension_count": config.head_dim // 2,
            "expert_count": 4, "expert_used_count": 2, "expert_feed_forward_length": 32, "expert_shared_count": 1,
            "leading_dense_block_count": 1, "expert_gating_func": 2, "expert_weights_scale": 1.5,
            "expert_weights_norm": True, "nextn_predict_layers": 1}
    write_gguf(path, "glm4moe", keys, vocab, tensors)
    return model


# ---- the hybrid Gated DeltaNet families ---------------------------------------------------------
def tiled(k_heads: int, per_k: int, width: int, offset: int = 0) -> np.ndarray:
    """llama.cpp's _reorder_v_heads as an index: stored entry p is the model's entry idx[p] (V
    heads grouped by key head in the model, tiled across key heads in the file)."""
    head = np.arange(k_heads * per_k * width).reshape(k_heads, per_k, width).transpose(1, 0, 2).reshape(-1)
    return np.concatenate([np.arange(offset), offset + head])


def file_rows(name: str, config: Any) -> torch.Tensor:
    """The rows of a Gated DeltaNet parameter in llama.cpp's tiled value-head order."""
    k, v, hk, hv = (config.linear_num_key_heads, config.linear_num_value_heads, config.linear_key_head_dim,
                    config.linear_value_head_dim)
    if name.endswith(("in_proj_qkv.weight", "conv1d.weight")):
        return torch.from_numpy(tiled(k, v // k, hv, 2 * k * hk))
    return torch.from_numpy(tiled(k, v // k, hv if name.endswith("in_proj_z.weight") else 1))


def plus_one(p: torch.Tensor) -> tuple[np.ndarray, Q]:
    """A zero-centred norm as llama.cpp stores it."""
    return p.detach().numpy() + 1, Q.F32


def moe_ffn(blk: str, mlp: Any) -> Stored:
    """Routed experts (gate and up stacked apart), a shared expert and its 1-D gate."""
    gate_up, _ = as_stored(mlp.experts.gate_up_proj, Q.Q8_0)
    width = gate_up.shape[1] // 2
    out = {f"{blk}.ffn_gate_inp.weight": as_stored(mlp.gate.weight, Q.F32),
           f"{blk}.ffn_gate_exps.weight": (gate_up[:, :width], Q.Q8_0),
           f"{blk}.ffn_up_exps.weight": (gate_up[:, width:], Q.Q8_0),
           f"{blk}.ffn_down_exps.weight": as_stored(mlp.experts.down_proj, Q.Q8_0),
           f"{blk}.ffn_gate_inp_shexp.weight": (mlp.shared_expert_gate.weight.detach().numpy()[0], Q.F32)}
    for ours in ("gate", "up", "down"):
        out[f"{blk}.ffn_{ours}_shexp.weight"] = as_stored(getattr(mlp.shared_expert, f"{ours}_proj").weight, Q.Q8_0)
    return out


def hybrid(tok: PreTrainedTokenizerBase, vocab: dict, path: Path, kind: str, normalised: bool = True) -> nn.Module:
    """A tiny Qwen3.5 ("qwen35"), Qwen3.5-MoE ("qwen35moe") or Qwen3-Next ("qwen3next", read as a
    Qwen3.5-MoE): 4 layers, Gated DeltaNet then gated full attention, twice; 2 key heads, 4 value
    heads; MoE kinds with 4 routed experts (top 2) and a shared expert. Converted as llama.cpp's converter does it
    (module docstring of engine/loading/gguf_hybrid.py); Qwen3.5 with one MTP layer after the
    decoder's."""
    common: dict[str, Any] = dict(
        vocab_size=len(vocab["tokens"]), hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, full_attention_interval=2, linear_num_key_heads=2,
        linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4,
        max_position_embeddings=256, tie_word_embeddings=False,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    experts: dict[str, Any] = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                   shared_expert_intermediate_size=32)
    rope = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}
    next_ = kind == "qwen3next"
    if next_:
        config: Any = Qwen3NextConfig(**common, **experts, intermediate_size=128, rope_parameters=rope,
                                      norm_topk_prob=normalised)
    else:
        rope.update(mrope_section=[2, 1, 1], mrope_interleaved=True)
        config = (Qwen3_5MoeTextConfig(**common, **experts, rope_parameters=rope) if kind == "qwen35moe" else
                  Qwen3_5TextConfig(**common, intermediate_size=128, rope_parameters=rope))
    model: Any = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    randomise(model, seed=7)
    k, v, hk, hv = 2, 4, 16, 16
    reorder = not next_  # only Qwen3.5's converter re-tiles the V heads
    heads = tiled(k, v // k, 1) if reorder else None
    values = tiled(k, v // k, hv) if reorder else None
    channels = tiled(k, v // k, hv, 2 * k * hk) if reorder else None

    def rows(value: np.ndarray, index: np.ndarray | None) -> np.ndarray:
        return value if index is None else value[index]

    tensors = outer(model)
    tensors["output_norm.weight"] = plus_one(model.model.norm.weight)
    for i, layer in enumerate(model.model.layers):
        blk = f"blk.{i}"
        tensors[f"{blk}.attn_norm.weight"] = plus_one(layer.input_layernorm.weight)
        tensors[f"{blk}.post_attention_norm.weight"] = plus_one(layer.post_attention_layernorm.weight)
        if config.layer_types[i] == "full_attention":
            tensors.update(attention(blk, layer.self_attn, biases=False))
            tensors[f"{blk}.attn_q_norm.weight"] = plus_one(layer.self_attn.q_norm.weight)
            tensors[f"{blk}.attn_k_norm.weight"] = plus_one(layer.self_attn.k_norm.weight)
        else:
            lin = layer.linear_attn
            if next_:  # [q, k, v, z] per key head -> all q, all k, all v; all z
                qkvz, _ = as_stored(lin.in_proj_qkvz.weight, Q.Q8_0)
                grouped = qkvz.reshape(k, 2 * hk + 2 * (v // k) * hv, -1)
                q, kk, vv, z = np.split(grouped, np.cumsum([hk, hk, (v // k) * hv])[:3], axis=1)
                tensors[f"{blk}.attn_qkv.weight"] = (np.concatenate([x.reshape(-1, 64) for x in (q, kk, vv)]), Q.Q8_0)
                tensors[f"{blk}.attn_gate.weight"] = (z.reshape(-1, 64), Q.Q8_0)
                tensors[f"{blk}.ssm_ba.weight"] = as_stored(lin.in_proj_ba.weight, Q.Q8_0)
            else:
                qkv, _ = as_stored(lin.in_proj_qkv.weight, Q.Q8_0)
                tensors[f"{blk}.attn_qkv.weight"] = (rows(qkv, channels), Q.Q8_0)
                tensors[f"{blk}.attn_gate.weight"] = (rows(as_stored(lin.in_proj_z.weight, Q.Q8_0)[0], values), Q.Q8_0)
                tensors[f"{blk}.ssm_beta.weight"] = (rows(as_stored(lin.in_proj_b.weight, Q.F32)[0], heads), Q.F32)
                tensors[f"{blk}.ssm_alpha.weight"] = (rows(as_stored(lin.in_proj_a.weight, Q.F32)[0], heads), Q.F32)
            conv = lin.conv1d.weight.detach().numpy()[:, 0]  # squeezed
            tensors[f"{blk}.ssm_conv1d.weight"] = (rows(conv, channels), Q.F32)
            tensors[f"{blk}.ssm_a"] = (rows(-np.exp(lin.A_log.detach().numpy()), heads), Q.F32)
            tensors[f"{blk}.ssm_dt.bias"] = (rows(lin.dt_bias.detach().numpy(), heads), Q.F32)
            tensors[f"{blk}.ssm_norm.weight"] = as_stored(lin.norm.weight, Q.F32)
            if values is not None:  # Q8_0 blocks along the file's (re-tiled) columns, set back in the model's
                filed = lin.out_proj.weight.detach()[:, values].clone()
                tensors[f"{blk}.ssm_out.weight"] = as_stored(filed, Q.Q8_0)
                lin.out_proj.weight.data[:, values] = filed
            else:
                tensors[f"{blk}.ssm_out.weight"] = as_stored(lin.out_proj.weight, Q.Q8_0)
        if kind == "qwen35":
            for ours in ("gate", "up", "down"):
                tensors[f"{blk}.ffn_{ours}.weight"] = as_stored(getattr(layer.mlp, f"{ours}_proj").weight, Q.Q8_0)
        else:
            tensors.update(moe_ffn(blk, layer.mlp))
    mtp = kind == "qwen35"
    if mtp:  # llama.cpp's MTP block after the decoder's
        tensors["blk.4.attn_norm.weight"] = (np.ones(64, np.float32), Q.F32)
        tensors["blk.4.nextn.eh_proj.weight"] = (np.zeros((64, 128), np.float32), Q.F32)
    keys = {**common_keys(config, 4 + mtp), "ssm.conv_kernel": 4, "ssm.state_size": hk, "ssm.group_count": k,
            "ssm.time_step_rank": v, "ssm.inner_size": v * hv, "full_attention_interval": 2,
            "rope.dimension_count": 8}
    if not next_:
        keys["rope.dimension_sections"] = [2, 1, 1, 0]
    else:
        keys["expert_weights_norm"] = normalised
    if mtp:
        keys["nextn_predict_layers"] = 1
    if kind != "qwen35":
        keys.update({"expert_count": 4, "expert_used_count": 2, "expert_feed_forward_length": 32,
                     "expert_shared_feed_forward_length": 32})
    # llama.cpp names Qwen3.5's pre-tokenizer, which transformers' Qwen3.5 tokenizer also applies
    write_gguf(path, "qwen3next" if next_ else kind, keys, vocab if next_ else {**vocab, "pre": "qwen35"}, tensors)
    return model


BUILDERS: dict[str, Callable[..., nn.Module]] = {
    "gpt-oss": gpt_oss, "gpt-oss-fused": partial(gpt_oss, fused=True), "glm4moe": glm4moe,
    **{kind: partial(hybrid, kind=kind) for kind in ("qwen35", "qwen35moe", "qwen3next")}}


@pytest.fixture(scope="session", params=list(BUILDERS))
def converted(request: pytest.FixtureRequest, vocab: tuple[dict, PreTrainedTokenizerBase],
              tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, nn.Module, PreTrainedTokenizerBase]:
    """(the GGUF, the transformers model it was converted from, the tokenizer to compare with):
    the tiny tokenizer; for Qwen3.5, whose GGUF transformers reads, transformers' reading of the
    file (its Qwen3.5 tokenizer splits text with Qwen's own pattern, not the tiny one's)."""
    meta, tok = vocab
    path = tmp_path_factory.mktemp(request.param) / "model.gguf"
    model = BUILDERS[request.param](tok, meta, path)
    if request.param.startswith("qwen35"):
        with isolated(path) as src:
            tok = AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name)
    return path, model, tok


def f32(value: Any) -> Any:
    """A config value as the file can hold it: floats in float32."""
    if isinstance(value, dict):
        return {k: f32(v) for k, v in value.items()}
    return float(np.float32(value)) if isinstance(value, float) else value


def test_config_is_the_converted_models(converted: tuple) -> None:
    path, ref, _ = converted
    ours = gguf_config(read_header(path)).to_dict()
    theirs = ref.config.to_dict()
    if ref.config.model_type == "qwen3_next":  # the same computation under Qwen3.5-MoE's names (engine/loading/gguf_hybrid.py)
        assert ours["model_type"] == "qwen3_5_moe_text" and theirs["norm_topk_prob"]
        theirs = {**theirs, "model_type": "qwen3_5_moe_text"}
        for key in ("intermediate_size", "decoder_sparse_step", "mlp_only_layers", "norm_topk_prob"):  # (always, in Qwen3.5)
            theirs.pop(key)
            ours.pop(key, None)
    for key in ("model_type", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "rms_norm_eps", "rope_parameters", "vocab_size",
                "tie_word_embeddings", "sliding_window", "layer_types", "num_local_experts", "n_routed_experts",
                "num_experts_per_tok", "moe_intermediate_size", "n_shared_experts", "first_k_dense_replace",
                "routed_scaling_factor", "norm_topk_prob", "attention_bias", "use_qk_norm", "n_group", "topk_group",
                "partial_rotary_factor", "num_experts", "shared_expert_intermediate_size", "linear_conv_kernel_dim",
                "linear_key_head_dim", "linear_value_head_dim", "linear_num_key_heads", "linear_num_value_heads",
                "decoder_sparse_step", "mlp_only_layers"):
        assert f32(ours.get(key)) == f32(theirs.get(key)), key
    if ours["model_type"] == "gpt_oss":
        assert ours["layer_types"][:2] == ["sliding_attention", "full_attention"] and ours["sliding_window"] == WINDOW


def test_experts_are_built_at_load_and_attention_stays_packed(converted: tuple) -> None:
    path, ref, _ = converted
    weights = GGUFWeights(path)
    try:
        with torch.device("meta"):
            hf = AutoModelForCausalLM.from_config(weights.config)
        layer_buffers_as_parameters(hf)  # GLM's router bias is loaded as a parameter
        weights.bind(hf)
        layouts = weights.layouts(hf, torch.float32, "none")
        kinds = {e.name: e.kind for e in layouts[-1].entries}
        assert kinds["self_attn.q_proj.weight"] == "gguf"  # Q8_0 blocks as the file has them
        expert_kinds = {k for n, k in kinds.items() if "experts." in n}
        # Q8_0 parts; gpt-oss: its MXFP4 matrices as stored (RowExperts), its biases side by side at load
        model_type = ref.config.model_type
        assert expert_kinds == (set() if model_type == "qwen3_5_text" else {"gguf", "dense"} if model_type == "gpt_oss"
                                else {"gguf"})
        if model_type == "gpt_oss":
            assert {n: k for n, k in kinds.items() if "experts." in n and n.endswith("_bias")} == {
                "mlp.experts.gate_up_proj_bias": "dense", "mlp.experts.down_proj_bias": "dense"}
        tiled = model_type in ("qwen3_5_text", "qwen3_5_moe_text")  # value heads re-tiled by llama.cpp
        if tiled:  # kept in the file's order (the layers read it: TILED), every projection packed as stored
            assert weights.config.linear_value_heads_tiled
            linear = {e.name: e for e in layouts[0].entries}
            for proj in ("in_proj_qkv", "in_proj_z", "out_proj"):
                entry = linear[f"linear_attn.{proj}.weight"]
                assert entry.kind == "gguf" and entry.row_order is None, proj
        if weights.config.model_type != ref.config.model_type:  # Qwen3-Next read as Qwen3.5-MoE: packed as stored
            linear = {e.name: e.kind for e in layouts[0].entries}
            assert linear["linear_attn.in_proj_qkv.weight"] == linear["linear_attn.in_proj_z.weight"] == "gguf"
            lin, k, per, width = ref.model.layers[0].linear_attn, 2, 2, 16
            qkvz = lin.in_proj_qkvz.weight.detach().reshape(k, 2 * width + 2 * per * width, -1)
            q, kk, v, z = torch.split(qkvz, [width, width, per * width, per * width], dim=1)
            ba = lin.in_proj_ba.weight.detach().reshape(k, 2 * per, -1)
            for ours, want in (("in_proj_qkv", torch.cat([x.reshape(-1, 64) for x in (q, kk, v)])),
                               ("in_proj_z", z.reshape(-1, 64)), ("in_proj_b", ba[:, :per].reshape(-1, 64)),
                               ("in_proj_a", ba[:, per:].reshape(-1, 64))):
                assert torch.equal(weights.load(f"model.layers.0.linear_attn.{ours}.weight", torch.float32), want)
        for name, p in ref.named_parameters():
            if weights.config.model_type != ref.config.model_type and "linear_attn.in_proj" in name:
                continue  # (above)
            if ".experts." in name or "linear_attn.in_proj" in name or "linear_attn.conv1d" in name:
                want = as_rows(name, p.detach()) if model_type == "gpt_oss" else p.detach()
                if tiled and "linear_attn" in name:  # the file's value-head order
                    want = want[file_rows(name, ref.config)]
                assert torch.equal(weights.load(name, torch.float32), want), name
    finally:
        weights.close()


def test_a_qwen3next_file_qwen35_cannot_run_keeps_qwen3_next_s_modules(vocab: tuple, tmp_path: Path) -> None:
    """A Qwen3-Next file whose top-k weights are not normalised (Qwen3.5-MoE's router always
    normalises them) is read as Qwen3-Next: in_proj_qkvz rebuilt at load, transformers' text."""
    meta, tok = vocab
    path = tmp_path / "model.gguf"
    model = hybrid(tok, meta, path, kind="qwen3next", normalised=False)
    config = gguf_config(read_header(path))
    assert config.model_type == "qwen3_next" and not config.norm_topk_prob
    assert_logits_and_greedy_text_equal((path, model, tok), "none")


def as_rows(name: str, value: torch.Tensor) -> torch.Tensor:
    """A parameter of transformers' GptOssExperts as RowExperts holds it: matrices rows first,
    gate_up's gate columns (even) then up columns (odd)."""
    if name.endswith(("gate_up_proj", "gate_up_proj_bias")):
        value = torch.cat((value[..., ::2], value[..., 1::2]), dim=-1)
    return value.transpose(-1, -2) if name.endswith("_proj") else value


@pytest.mark.parametrize("offload", ["none", "all"])
def test_logits_and_greedy_text_equal_transformers(converted: tuple, offload: str) -> None:
    assert_logits_and_greedy_text_equal(converted, offload)


@pytest.mark.skipif(build.kernels() is None, reason="no C compiler here")
def test_experts_cached_beside_the_cpus_give_transformers_text(converted: tuple, tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """As test_gguf_families' test of that name (gpt-oss's experts cached with their biases)."""
    assert_experts_cached_beside_cpu(*converted, tmp_path, monkeypatch)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_experts_on_the_cpu_beside_a_gpu_give_transformers_text(converted: tuple) -> None:
    path, ref, tok = converted
    if not any(name.endswith(".experts") for name, _ in ref.named_modules()):
        pytest.skip("no experts")
    assert_experts_on_cpu_beside_gpu(path, ref, tok, PROMPTS, NEW_TOKENS)


def assert_logits_and_greedy_text_equal(converted: tuple, offload: str) -> None:
    """The converted GGUF, loaded resident or with every layer streamed: logits within 1e-4 of
    transformers' on each prompt, greedy text equal to its `generate`, and (streamed) draft-free
    trees giving the same text."""
    path, ref, tok = converted
    m = load_model(path, offload=offload)  # type: ignore[arg-type]
    assert m.model.placement is not None and m.model.placement.quant == "gguf"
    if offload == "none" and build.kernels() is not None:  # routed experts stay packed (gpt-oss' too: RowExperts)
        experts = [mod for name, mod in m.model.hf_model.named_modules() if name.endswith(".experts")]
        theirs = [name for name, _ in ref.named_modules() if name.endswith(".experts")]
        assert len(experts) == len(theirs) and all(isinstance(e, PackedExperts) for e in experts)
        # gpt-oss, GLM-4.5, Qwen3.5 and Gemma 4 decode in the fused C step (engine/kernels/fused_layer.py)
        fused = m.model.hf_model.config.model_type in ("gpt_oss", "glm4_moe", "qwen3_5_text", "qwen3_5_moe_text",
                                                       "gemma4_text")
        assert (m.model.fused is not None) == fused
    engine = Engine(m.model, m.tokenizer)
    for prompt in PROMPTS:
        ids = tok(prompt)["input_ids"]
        assert len(ids) > WINDOW and m.tokenizer(prompt)["input_ids"] == ids
        with torch.inference_mode():
            theirs = ref(torch.tensor([ids])).logits[0]
        ours = logits(m, ids)
        assert (ours - theirs).abs().max() <= 1e-4 * theirs.abs().max(), prompt
        x = torch.tensor([ids])
        want = ref.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=NEW_TOKENS, do_sample=False,
                            pad_token_id=tok.pad_token_id)[0, len(ids):].tolist()
        got = greedy(engine, prompt, n=NEW_TOKENS)
        assert list(got.token_ids) == (want[: len(got.token_ids)] if got.finish_reason == "eos" else want), prompt
        if offload == "all":  # every layer streamed; draft-free trees verify against the same layers
            assert m.model.streamer is not None and m.model.placement.gpu_layers == 0
        if offload == "all" or m.model.fused is not None:  # (resident and fused: its tree passes)
            assert greedy(engine, prompt, mode="specexec", n=NEW_TOKENS).token_ids == got.token_ids


def test_gpt_oss_experts_stay_packed_in_their_nibbles(vocab: tuple, tmp_path: Path) -> None:
    """A gpt-oss GGUF's MXFP4 experts, resident on the CPU, stay packed as the file holds them:
    four-bit codes of E2M1's values (kind q4, e2m1) and one fp16 power of two per 32 values,
    0.5625 bytes a weight (fp32 would take 4; six-bit codes took 0.8125), merged gate and up rows
    per expert, their biases beside them; a decode step's experts in one kernel call with
    gpt-oss's gate (its logits and text: the tests above)."""
    if build.kernels() is None:
        pytest.skip("no packed CPU kernel here")
    meta, tok = vocab
    path = tmp_path / "gpt-oss.gguf"
    gpt_oss(tok, meta, path)
    m = load_model(path)
    experts = [mod for name, mod in m.model.hf_model.named_modules() if name.endswith(".experts")]
    assert experts and all(isinstance(e, PackedExperts) for e in experts)
    for e in experts:
        (gate_up,), (down,) = e.gate_up, e.down
        assert gate_up.packed is not None and down.packed is not None
        w = gate_up.packed[0]
        assert (w.kind, w.table, w.group, w.mins, w.scales.dtype) == ("q4", "e2m1", 32, None, torch.float16)
        assert w.out_features == e.gate_up_rows and e.gate_up_bias is not None and e.down_bias is not None
        assert e._fused is not None and e._fused[2] is not None  # decode steps: one C call with gpt-oss's gate
        weights = e.num_experts * (e.gate_up_rows * e.hidden + e.hidden * e.width)
        assert e.packed_nbytes == weights * 9 // 16


def test_experts_that_do_not_fit_together_are_refused(vocab: tuple, tmp_path: Path) -> None:
    """A gpt-oss file whose up experts are narrower than its gate experts: one message."""
    meta, tok = vocab
    good = tmp_path / "good.gguf"
    gpt_oss(tok, meta, good)
    reader = GGUFReader(good)
    keys = {k.removeprefix("gpt-oss."): f.contents() for k, f in reader.fields.items() if k.startswith("gpt-oss.")}
    tensors: Stored = {}
    for t in reader.tensors:
        data = np.array(t.data)  # as stored: floats, or blocks as bytes
        if t.name == "blk.0.ffn_up_exps.weight":
            data = data[:, : data.shape[1] // 2]
        tensors[t.name] = (data, Q(t.tensor_type))
    bad = write_gguf(tmp_path / "bad.gguf", "gpt-oss", keys, meta, tensors)
    with pytest.raises(UnsupportedModel) as err:
        load_model(bad)
    assert "mlp.experts.gate_up_proj" in err.value.user_message and "\n" not in err.value.user_message


@pytest.mark.parametrize("arch", ["gemma4"])
def test_families_not_read_yet_are_refused_by_name(vocab: tuple, tmp_path: Path, arch: str,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """An architecture gguf-py names but the loader cannot read yet is refused saying what is
    missing (none is today: one is marked so for the test)."""
    monkeypatch.setitem(gguf_archs.REFUSED, arch, "a part is not read from GGUF files yet")
    meta, _ = vocab
    keys = {"block_count": 1, "embedding_length": 64, "attention.head_count": 4, "context_length": 64}
    path = write_gguf(tmp_path / f"{arch}.gguf", arch, keys, meta, {})
    with pytest.raises(UnsupportedModel) as err:
        load_model(path)
    message = err.value.user_message
    assert f"'{arch}' GGUF; SpecChat runs GGUF files of" in message and f"not yet of {arch}: " in message
    assert "gpt-oss" in message and "safetensors" in message and "\n" not in message


@pytest.mark.parametrize("kind", ["glm4moe", "qwen35"])
def test_nf4_gives_each_kind_of_layer_its_own_layout(vocab: tuple, tmp_path: Path, kind: str) -> None:
    """--quant nf4 re-quantises a GGUF per kind of layer (GLM's dense first layer, a hybrid's
    linear layers): the model is the converted model's own NF4 (its folder loaded with --quant
    nf4), to float rounding."""
    meta, tok = vocab
    path = tmp_path / "model.gguf"
    ref: Any = BUILDERS[kind](tok, meta, path)
    folder = tmp_path / "folder"
    ref.save_pretrained(folder)
    tok.save_pretrained(folder)
    m = load_model(path, quant="nf4", offload="all")
    assert m.model.streamer is not None
    layouts = m.model.streamer.layouts
    assert layouts[0].quant == "nf4" and layouts[0].entries != layouts[1].entries
    ids = m.tokenizer(PROMPTS[0])["input_ids"]
    theirs = logits(load_model(folder, quant="nf4", offload="all"), ids)
    ours = logits(m, ids)
    assert (ours - theirs).abs().max() <= 1e-4 * theirs.abs().max()
