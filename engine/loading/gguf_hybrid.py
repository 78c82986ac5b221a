"""GGUF files of the hybrid Gated DeltaNet families (llama.cpp's qwen3next, qwen35, qwen35moe):
the config keys llama.cpp writes for them and the transforms its converter applies, undone.

llama.cpp's converter (convert_hf_to_gguf.py: Qwen3NextModel, and for Qwen3.5 the V-reordering
subclass of it) changes these tensors; each is undone here:

- zero-centred RMSNorm weights (input, post-attention, final, q/k norms) are stored plus one;
  the gated norm of the linear layers (`ssm_norm`) is not;
- `A_log` is stored as `ssm_a` = -exp(A_log); `dt_bias` as `ssm_dt.bias`;
- the depthwise convolution (C, 1, K) is stored squeezed, (C, K);
- Qwen3-Next's fused `in_proj_qkvz`, per key head [q, k, v, z], is stored as `attn_qkv` (all q
  heads, all k heads, all v heads) and `attn_gate` (all z heads): exactly Qwen3.5's in_proj_qkv
  and in_proj_z. So a Qwen3-Next file whose every layer is MoE with a shared expert and
  normalised top-k weights (Qwen3-Next-80B-A3B) loads as a Qwen3.5-MoE (`as_qwen35`), the same
  computation under Qwen3.5's names: both projections stay packed as stored and the fused CPU
  step and pass take it (until 2026-11-28 in_proj_qkvz was rebuilt de-quantised: 3.6 GB of
  fp32 for Qwen3-Next-80B-A3B, and every step took the general path). Its `ssm_ba`, per key
  head [b, a], is split into in_proj_b and in_proj_a. Other Qwen3-Next files (dense layers)
  keep Qwen3-Next's modules, in_proj_qkvz rebuilt at load;
- Qwen3.5 (with fewer key heads than value heads) stores every value-indexed dimension with
  its V heads tiled ([K0, K1, .., K0, K1, ..]) where the model groups them by key head
  ([K0 v0, K0 v1, .., K1 v0, ..]): the rows of in_proj_qkv's value block, in_proj_z, in_proj_a,
  in_proj_b and the convolution's value channels, the entries of A_log and dt_bias, and the
  columns of out_proj. This one is not undone: a layer's value heads are independent, so the
  file's order serves as well once each value head reads its own key head (head h reads key
  head h % key heads, not h // (value heads / key heads)). `rules` sets the config's
  `linear_value_heads_tiled` (engine.model.linear_attention.TILED) and the layers read that;
  out_proj, whose columns would cross quantisation blocks, stays packed as stored (re-ordered,
  it was de-quantised to fp32 at load: 1 GB of Qwen3.6-35B-A3B's RAM, read every token).

MTP (multi-token prediction) layers llama.cpp appends after the decoder's (`nextn_predict_layers`
more blocks) are not read: block_count less those is the decoder.

What this module does not do: read files (gguf.py) or know other families (gguf_families.py).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from engine.model.linear_attention import TILED
from engine.store.gguf_header import GGUFHeader

ARCHS = {"qwen3next": "qwen3_next", "qwen35": "qwen3_5_text", "qwen35moe": "qwen3_5_moe_text"}
_ATTENTION = {"context_length": "max_position_embeddings", "block_count": "num_hidden_layers",
              "feed_forward_length": "intermediate_size", "embedding_length": "hidden_size",
              "rope.freq_base": "rope_theta", "attention.head_count": "num_attention_heads",
              "attention.head_count_kv": "num_key_value_heads", "attention.key_length": "head_dim",
              "attention.layer_norm_rms_epsilon": "rms_norm_eps", "vocab_size": "vocab_size",
              "ssm.conv_kernel": "linear_conv_kernel_dim", "ssm.state_size": "linear_key_head_dim",
              "ssm.group_count": "linear_num_key_heads", "ssm.time_step_rank": "linear_num_value_heads",
              "full_attention_interval": "full_attention_interval"}
_EXPERTS = {"expert_count": "num_experts", "expert_used_count": "num_experts_per_tok",
            "expert_feed_forward_length": "moe_intermediate_size",
            "expert_shared_feed_forward_length": "shared_expert_intermediate_size",
            "expert_weights_norm": "norm_topk_prob"}
KEY_TABLES: dict[str, dict[str, str | None]] = {
    "qwen3_next": {**_ATTENTION, **_EXPERTS}, "qwen3_5_text": dict(_ATTENTION),
    "qwen3_5_moe_text": {**_ATTENTION, **_EXPERTS}}
# norms stored plus one (llama.cpp's `norm.weight` rule, all but the linear layers' gated norm)
OFFSET_NORMS = ("input_layernorm.weight", "post_attention_layernorm.weight", "self_attn.q_norm.weight",
                "self_attn.k_norm.weight")

Build = Callable[[list[torch.Tensor]], torch.Tensor]


def as_qwen35(header: GGUFHeader) -> bool:
    """Whether a qwen3next file loads as a Qwen3.5-MoE (module docstring): every decoder layer
    routes experts beside a shared expert, and the top-k weights are normalised (Qwen3.5-MoE's
    router always normalises them)."""
    meta = header.metadata
    blocks, nextn, norm = (meta.get(f"qwen3next.{key}") for key in ("block_count", "nextn_predict_layers",
                                                                        "expert_weights_norm"))
    if header.architecture != "qwen3next" or blocks is None or norm is not None and not bool(norm):
        return False
    return all(header.tensor(f"blk.{i}.{t}.weight") is not None and header.tensor(f"blk.{i}.ffn_gate.weight") is None
               for i in range(int(blocks) - int(nextn or 0)) for t in ("ffn_gate_inp", "ffn_up_shexp"))


def rules(header: GGUFHeader, config: dict[str, Any]) -> None:
    """Config fields llama.cpp states in another form: the value head width (the file has
    all value heads' width), the rotary width as a fraction of a head, Qwen3.5's mrope
    sections, the decoder's layers without the MTP layers; the layer pattern follows from
    `full_attention_interval` as transformers derives it."""
    arch = header.architecture or ""
    meta = header.metadata
    inner, heads = meta.get(f"{arch}.ssm.inner_size"), config.get("linear_num_value_heads")
    if arch != "qwen3next" and heads != config.get("linear_num_key_heads"):  # (only Qwen3.5's converter tiles)
        config[TILED] = True
    if isinstance(heads, int) and heads > 0 and inner is not None:
        config["linear_value_head_dim"] = int(inner) // heads
    nextn = meta.get(f"{arch}.nextn_predict_layers")
    if nextn is not None and isinstance(config.get("num_hidden_layers"), int):
        config["num_hidden_layers"] -= int(nextn)
    head_dim = config.get("head_dim")
    rope_dim = meta.get(f"{arch}.rope.dimension_count")
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": float(config.pop("rope_theta", 10000.0))}
    if rope_dim is not None and isinstance(head_dim, int) and head_dim > 0:
        rope["partial_rotary_factor"] = int(rope_dim) / head_dim
    sections = meta.get(f"{arch}.rope.dimension_sections")
    if arch != "qwen3next" and sections is not None:  # llama.cpp pads the three sections to four
        rope.update(mrope_section=[int(s) for s in list(sections)[:3]], mrope_interleaved=True)
    config["rope_parameters"] = rope


def recipes(header: GGUFHeader, config: Any, params: Sequence[str]) -> dict[str, tuple[tuple[str, ...], Build]]:
    """The parameters built from the file's tensors at load: (sources, build)."""
    heads = _Heads(config)
    out: dict[str, tuple[tuple[str, ...], Build]] = {}
    for name in params:
        if name == "model.norm.weight":
            out[name] = (("output_norm.weight",), _minus_one)
            continue
        if not name.startswith("model.layers."):
            continue
        index, _, leaf = name.removeprefix("model.layers.").partition(".")
        blk = f"blk.{index}"
        if leaf in OFFSET_NORMS:
            stored = {"input_layernorm.weight": "attn_norm", "post_attention_layernorm.weight": "post_attention_norm",
                      "self_attn.q_norm.weight": "attn_q_norm", "self_attn.k_norm.weight": "attn_k_norm"}[leaf]
            out[name] = ((f"{blk}.{stored}.weight",), _minus_one)
        elif leaf == "linear_attn.A_log":
            out[name] = ((f"{blk}.ssm_a",), lambda v: torch.log(-v[0]))
        elif leaf == "linear_attn.dt_bias":
            out[name] = ((f"{blk}.ssm_dt.bias",), lambda v: v[0])
        elif leaf == "linear_attn.conv1d.weight":
            out[name] = ((f"{blk}.ssm_conv1d.weight",), lambda v: v[0].unsqueeze(1))
        elif leaf == "linear_attn.in_proj_qkvz.weight":
            out[name] = ((f"{blk}.attn_qkv.weight", f"{blk}.attn_gate.weight"), _qkvz(heads))
        elif leaf in ("linear_attn.in_proj_b.weight", "linear_attn.in_proj_a.weight") and header.architecture == "qwen3next":
            out[name] = ((f"{blk}.ssm_ba.weight",), _half_of_ba(heads, leaf.endswith("in_proj_a.weight")))
        elif leaf == "mlp.shared_expert_gate.weight":  # (1, H), which some files store as (H,)
            out[name] = ((f"{blk}.ffn_gate_inp_shexp.weight",), lambda v: v[0].reshape(1, -1))
    return out


def add_names(header: GGUFHeader, names: dict[str, str], num_layers: int) -> None:
    """Separate gate and up experts (llama.cpp's default) as the two parts of gate_up_proj,
    which gguf-py's table maps only to a fused `ffn_gate_up_exps`; a Qwen3-Next file read as a
    Qwen3.5-MoE: its attn_qkv and attn_gate as in_proj_qkv and in_proj_z."""
    for i in range(num_layers):
        if header.architecture == "qwen3next" and header.tensor(f"blk.{i}.attn_qkv.weight") is not None:
            names.setdefault(f"blk.{i}.attn_qkv", f"model.layers.{i}.linear_attn.in_proj_qkv")
            names.setdefault(f"blk.{i}.attn_gate", f"model.layers.{i}.linear_attn.in_proj_z")
        fused = names.get(f"blk.{i}.ffn_gate_up_exps")
        if fused is not None and header.tensor(f"blk.{i}.ffn_gate_exps.weight") is not None:
            names[f"blk.{i}.ffn_gate_exps"] = names[f"blk.{i}.ffn_up_exps"] = fused


def _minus_one(values: list[torch.Tensor]) -> torch.Tensor:
    return values[0] - 1


class _Heads:
    """The linear layers' head counts and widths of a config."""

    def __init__(self, config: Any) -> None:
        self.k = int(config.linear_num_key_heads)
        self.v = int(config.linear_num_value_heads)
        self.hk = int(config.linear_key_head_dim)
        self.hv = int(config.linear_value_head_dim)


def _qkvz(heads: _Heads) -> Build:
    """Qwen3-Next's in_proj_qkvz rows, per key head [q, k, v, z], from attn_qkv (q heads, k
    heads, v heads) and attn_gate (z heads)."""
    q_rows, v_rows = heads.hk, heads.v // heads.k * heads.hv

    def build(values: list[torch.Tensor]) -> torch.Tensor:
        qkv, z = values
        q, k, v = torch.split(qkv, [heads.k * q_rows, heads.k * q_rows, heads.k * v_rows])
        per_head = torch.cat((q.reshape(heads.k, q_rows, -1), k.reshape(heads.k, q_rows, -1),
                              v.reshape(heads.k, v_rows, -1), z.reshape(heads.k, v_rows, -1)), dim=1)
        return per_head.reshape(-1, qkv.shape[-1])

    return build


def _half_of_ba(heads: _Heads, second: bool) -> Build:
    """in_proj_b's rows (or in_proj_a's: `second`) of Qwen3-Next's in_proj_ba, per key head [b of
    its value heads, a of them]."""
    per = heads.v // heads.k

    def build(values: list[torch.Tensor]) -> torch.Tensor:
        grouped = values[0].reshape(heads.k, 2 * per, -1)
        return grouped[:, per:].reshape(heads.v, -1) if second else grouped[:, :per].reshape(heads.v, -1)

    return build
