"""GGUF files of Gemma 4 (llama.cpp's `gemma4`): the config keys llama.cpp's converter writes for
the text model, read back into transformers' Gemma4TextConfig, and the tensor names gguf-py's
table leaves out.

llama.cpp's converter (Gemma4Model, a Gemma3Model whose norms are stored as they are: Gemma 4's
RMSNorm multiplies by its weight, not by 1 + weight) writes, beside the usual keys:

- `attention.key_length` / `value_length`: the full-attention layers' head width
  (global_head_dim); `key_length_swa` / `value_length_swa`: the sliding layers' (head_dim);
- `attention.sliding_window_pattern`: one bool per layer, true for a sliding layer;
- `attention.head_count_kv`: one number, or one per layer where the full layers have their own
  K/V head count (num_global_key_value_heads);
- `feed_forward_length`: one number, or one per layer where the layers that share K/V have a
  double-wide MLP (use_double_wide_mlp);
- `attention.shared_kv_layers`: num_kv_shared_layers (those layers have no k/v tensors, and
  transformers' modules for them have none either);
- `embedding_length_per_layer_input`: hidden_size_per_layer_input (0: none); the per-layer
  token embeddings (`per_layer_token_embd`, vocab_size_per_layer_input rows) are stored as the
  checkpoint has them (their scale is computed, not stored), as are `per_layer_model_proj`,
  `per_layer_proj_norm` and each layer's `inp_gate`, `proj`, `post_norm`;
- `rope.freq_base` (full layers) and `rope.freq_base_swa`; the full layers' proportional rope
  as a `rope_freqs` tensor of head_dim / 2 frequency factors: 1 for each rotated pair, 1e30 for
  each pair left unrotated, so its partial_rotary_factor is 2 * (count of ones) / head_dim;
- K equal to V (attention_k_eq_v) is not a key: the full-attention layers have no `attn_v`;
- the MoE block (26B-A4B): `expert_count`, `expert_used_count`, `expert_feed_forward_length`;
  the fused `ffn_gate_up_exps` (E, 2I, H) and `ffn_down_exps` as transformers holds them, the
  router as `ffn_gate_inp`, its `scale` as `ffn_gate_inp.scale`, its per_expert_scale as
  `ffn_down_exps.scale`; `layer_scalar` as `layer_output_scale`.

Nothing is stored in another form, so no tensor needs a recipe: every name maps through gguf-py's
table (add_names supplies the two router scales it does not name).

What this module does not do: read tensor data beyond the small `rope_freqs` (gguf.py), or know
other families (gguf_families.py).
"""

from __future__ import annotations

from typing import Any

import numpy as np
from gguf import GGMLQuantizationType

from engine.errors import UnsupportedModel
from engine.store.gguf_header import CorruptGGUF, GGUFHeader

ARCH = "gemma4"
KEY_TABLE: dict[str, str | None] = {
    "context_length": "max_position_embeddings", "block_count": "num_hidden_layers",
    "feed_forward_length": "intermediate_size", "embedding_length": "hidden_size",
    "attention.head_count": "num_attention_heads", "attention.layer_norm_rms_epsilon": "rms_norm_eps",
    "attention.sliding_window": "sliding_window", "final_logit_softcapping": "final_logit_softcapping",
    "attention.shared_kv_layers": "num_kv_shared_layers",
    "embedding_length_per_layer_input": "hidden_size_per_layer_input", "vocab_size": "vocab_size",
    "expert_count": "num_experts", "expert_used_count": "top_k_experts",
    "expert_feed_forward_length": "moe_intermediate_size",
    # read by `rules`: their form depends on the model
    "attention.head_count_kv": None, "attention.key_length": None, "attention.key_length_swa": None,
    "rope.freq_base": None, "rope.freq_base_swa": None,
}
# keys transformers' GGUF reader builds its Gemma 4 config from (for the tokenizer) that may be one
# value per layer, which its config refuses: left out of the copy its tokenizer conversion reads
TOKENIZER_DROPS = (f"{ARCH}.attention.head_count_kv", f"{ARCH}.feed_forward_length")
UNROTATED = 1e29  # rope_freqs entries at least this large leave their pair unrotated (llama.cpp: 1e30)


def _key(header: GGUFHeader, name: str) -> Any:
    return header.metadata.get(f"{ARCH}.{name}")


def _per_layer(value: Any, n: int, what: str, header: GGUFHeader) -> list[int]:
    """A key llama.cpp writes as one number or one per layer, as one per layer."""
    values = [int(v) for v in value] if isinstance(value, (list, tuple, np.ndarray)) else [int(value)] * n
    if len(values) != n:
        raise CorruptGGUF(f"{header.path.name} gives {what} for {len(values)} layers of {n}")
    return values


def rules(header: GGUFHeader, config: dict[str, Any]) -> None:
    """The config fields llama.cpp writes in another form (module docstring)."""
    name = header.path.name
    n = config.get("num_hidden_layers")
    if not isinstance(n, int) or n < 1:
        raise CorruptGGUF(f"{name} has no block_count")
    types = _layer_types(header, n)
    config["layer_types"] = types
    shared = int(config.get("num_kv_shared_layers") or 0)
    own = range(n - shared)  # the layers that compute their K/V
    _heads(header, config, types, own)
    _ffn(header, config, n, shared)
    config["enable_moe_block"] = bool(config.get("num_experts"))
    _per_layer_inputs(header, config, n)
    config["rope_parameters"] = _rope(header, config)
    config["eos_token_id"] = _ends(header) or config.get("eos_token_id")


def _ends(header: GGUFHeader) -> list[int] | None:
    """Every token that ends an answer when there are several, as llama.cpp stops at each: the
    end of sequence, of a turn, of a message (Gemma 4's <eos>, <turn|>, <|tool_response>), and a
    file's own list of them."""
    meta = header.metadata
    listed = meta.get("tokenizer.ggml.eos_token_ids")
    ids = [meta.get("tokenizer.ggml.eos_token_id"), *(listed.tolist() if isinstance(listed, np.ndarray) else []),
           meta.get("tokenizer.ggml.eot_token_id"), meta.get("tokenizer.ggml.eom_token_id")]
    ends = list(dict.fromkeys(int(i) for i in ids if i is not None))
    return ends if len(ends) > 1 else None


def _layer_types(header: GGUFHeader, n: int) -> list[str]:
    pattern = _key(header, "attention.sliding_window_pattern")
    if pattern is None:
        raise CorruptGGUF(f"{header.path.name} does not say which of its layers are sliding-window layers "
                          f"({ARCH}.attention.sliding_window_pattern)")
    if isinstance(pattern, (list, tuple, np.ndarray)):
        sliding = [bool(b) for b in pattern]
        if len(sliding) != n:
            raise CorruptGGUF(f"{header.path.name} marks {len(sliding)} layers of {n} as sliding or not")
    else:  # a period, as llama.cpp reads it: the last layer of each period is a full one
        period = int(pattern)
        sliding = [period > 0 and i % period < period - 1 for i in range(n)]
    return ["sliding_attention" if s else "full_attention" for s in sliding]


def _heads(header: GGUFHeader, config: dict[str, Any], types: list[str], own: range) -> None:
    """Head widths and K/V head counts of the sliding and full layers, and whether keys are
    values (full layers with no `attn_v` of their own)."""
    name = header.path.name
    full_dim = _key(header, "attention.key_length")
    swa_dim = _key(header, "attention.key_length_swa")
    swa_dim = full_dim if swa_dim is None else swa_dim
    if full_dim is None:
        raise CorruptGGUF(f"{name} does not give its heads' width ({ARCH}.attention.key_length)")
    for key, want in (("attention.value_length", full_dim), ("attention.value_length_swa", swa_dim)):
        value = _key(header, key)
        if value is not None and int(value) != int(want):
            raise UnsupportedModel(f"'{name}' has values {int(value)} wide and keys {int(want)} wide; SpecChat runs "
                                   "Gemma 4 models whose keys and values have one width.")
    config["head_dim"], config["global_head_dim"] = int(swa_dim), int(full_dim)
    stored = _key(header, "attention.head_count_kv")
    kv = _per_layer(config.get("num_attention_heads", 1) if stored is None else stored, len(types),
                    "K/V head counts", header)
    by_type: dict[str, set[int]] = {}
    for t, k in zip(types, kv):
        by_type.setdefault(t, set()).add(k)
    if any(len(v) > 1 for v in by_type.values()):
        raise UnsupportedModel(f"'{name}' has layers of one kind with different K/V head counts; SpecChat runs "
                               "Gemma 4 models with one count for sliding and one for full layers.")
    swa_kv = min(by_type.get("sliding_attention", by_type.get("full_attention", {1})))
    full_kv = min(by_type.get("full_attention", {swa_kv}))
    config["num_key_value_heads"] = swa_kv
    full_own = [i for i in own if types[i] == "full_attention"]
    k_eq_v = bool(full_own) and all(header.tensor(f"blk.{i}.attn_v.weight") is None for i in full_own)
    config["attention_k_eq_v"] = k_eq_v
    if isinstance(stored, (list, tuple, np.ndarray)):
        config["num_global_key_value_heads"] = full_kv  # transformers applies it to K=V layers only
    if full_kv != swa_kv and not k_eq_v:
        raise UnsupportedModel(f"'{name}' has {full_kv} K/V heads in its full layers and {swa_kv} in its sliding "
                               "ones without sharing keys and values; transformers' Gemma 4 has no such model.")


def _ffn(header: GGUFHeader, config: dict[str, Any], n: int, shared: int) -> None:
    """One MLP width, doubled in the layers that share K/V when the file says so per layer."""
    widths = _per_layer(config.get("intermediate_size", 0), n, "MLP widths", header)
    base = widths[0]
    double = shared > 0 and widths[n - shared:] == [2 * base] * shared
    if widths != [base] * (n - shared) + [2 * base if double else base] * shared:
        raise UnsupportedModel(f"'{header.path.name}' has MLP widths {sorted(set(widths))} across its layers; "
                               "SpecChat runs Gemma 4 models with one width (doubled in layers sharing K/V).")
    config["intermediate_size"] = base
    config["use_double_wide_mlp"] = double


def _per_layer_inputs(header: GGUFHeader, config: dict[str, Any], n: int) -> None:
    """The per-layer input width, and the per-layer table's vocabulary (its rows)."""
    width = int(config.get("hidden_size_per_layer_input") or 0)
    config["hidden_size_per_layer_input"] = width
    table = header.tensor("per_layer_token_embd.weight")
    if not width:
        if table is not None:
            raise CorruptGGUF(f"{header.path.name} has per-layer token embeddings but no per-layer input width")
        return
    if table is None or len(table.shape) != 2 or table.shape[1] != n * width:
        raise CorruptGGUF(f"{header.path.name} needs per-layer token embeddings of {n} x {width} columns "
                          f"(per_layer_token_embd is {None if table is None else table.shape})")
    config["vocab_size_per_layer_input"] = int(table.shape[0])


def _rope(header: GGUFHeader, config: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Proportional rope on the full layers (the share of pairs rotated from `rope_freqs`),
    plain rope on the sliding ones, each with its own theta."""
    name = header.path.name
    swa_rot = _key(header, "rope.dimension_count_swa")
    if swa_rot is not None and int(swa_rot) != config["head_dim"]:
        raise UnsupportedModel(f"'{name}' rotates {int(swa_rot)} of the {config['head_dim']} dimensions of its "
                               "sliding layers' heads; transformers' Gemma 4 rotates them all.")
    full_dim = config["global_head_dim"]
    factor = 1.0
    freqs = header.tensor("rope_freqs.weight")
    if freqs is not None:
        values = _small_tensor(header, "rope_freqs.weight")
        rotated = int(np.argmax(values != 1.0)) if (values != 1.0).any() else len(values)
        if len(values) != full_dim // 2 or not (values[rotated:] >= UNROTATED).all():
            raise UnsupportedModel(f"'{name}' scales its full layers' rope frequencies in a way SpecChat does not "
                                   "read (rope_freqs is neither ones nor ones then unrotated pairs).")
        factor = 2 * rotated / full_dim
    theta = _key(header, "rope.freq_base")
    swa_theta = _key(header, "rope.freq_base_swa")
    return {"full_attention": {"rope_type": "proportional", "partial_rotary_factor": factor,
                               "rope_theta": float(1e6 if theta is None else theta)},
            "sliding_attention": {"rope_type": "default", "rope_theta": float(1e4 if swa_theta is None else swa_theta)}}


def _small_tensor(header: GGUFHeader, tensor: str) -> np.ndarray:
    """The values of a small F32 / F16 tensor, read from the file."""
    t = header.tensor(tensor)
    assert t is not None
    kinds: dict[int, type[np.floating]] = {int(GGMLQuantizationType.F32): np.float32,
                                            int(GGMLQuantizationType.F16): np.float16}
    kind = kinds.get(t.qtype)
    if kind is None or t.nbytes > 1 << 20:
        raise CorruptGGUF(f"{header.path.name}: {tensor} is {t.type_name}, not F32 or F16")
    count = t.nbytes // np.dtype(kind).itemsize
    return np.fromfile(header.files[t.part], dtype=kind, count=count, offset=t.offset).astype(np.float64)


def add_names(header: GGUFHeader, names: dict[str, str], num_layers: int) -> None:
    """The router's scale and per-expert scale, which llama.cpp's converter renames
    (`ffn_gate_inp.scale`, `ffn_down_exps.scale`) and gguf-py's table does not name."""
    for i in range(num_layers):
        for stored, ours in (("ffn_gate_inp.scale", "router.scale"),
                             ("ffn_down_exps.scale", "router.per_expert_scale")):
            if header.tensor(f"blk.{i}.{stored}") is not None:
                names[f"blk.{i}.{stored}"] = f"model.layers.{i}.{ours}"
