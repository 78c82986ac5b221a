"""Write GGUF files: a Hugging Face-named model's tensors in chosen GGUF types, with its config
and byte-level BPE tokenizer as llama.cpp's metadata. For test and benchmark models
(synthetic.py); SpecChat never writes a user's model.

gguf-py quantises the legacy types (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) itself but only decodes the
K-quants and IQ4. For those this module has plain encoders written from the block layouts
(ggml's `block_q2_K` .. `block_q6_K`, `block_iq4_nl`, `block_iq4_xs`): per sub-block a scale
(and a minimum) from the range of its values, the super-block scales as fp16, nearest codes.
They are not llama.cpp's error-minimising search, which does not matter here: what a test
checks is that the file's own de-quantised weights are what runs.

Tensors are written one at a time (header and tensor table first), so a file larger than RAM
can be written. Llama's q/k rows are stored permuted, as llama.cpp's converter stores them.

What this module does not do: read GGUF files (engine.loading.gguf) or choose weights.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from gguf import MODEL_ARCH_NAMES, GGUFWriter, get_tensor_name_map
from gguf import GGMLQuantizationType as Q
from gguf import quants as gq
from gguf.constants import GGML_QUANT_SIZES, RopeScalingType, TokenType
from gguf.quants import quant_shape_to_byte_shape

IQ4_LEVELS = np.array((-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113), np.float32)


# ---- encoders for the types gguf-py cannot quantise -------------------------------------------
def _f16(x: np.ndarray) -> np.ndarray:
    """fp32 -> the fp16 the block stores, and that value back in fp32 (what decoding sees)."""
    return x.astype(np.float16).astype(np.float32)


def _div(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.divide(a, b, out=np.zeros(np.broadcast_shapes(a.shape, b.shape), np.float32), where=b != 0)


def _round(x: np.ndarray, lo: int, hi: int) -> np.ndarray:
    return np.clip(np.rint(x), lo, hi).astype(np.int32)


def _bytes(*parts: np.ndarray) -> np.ndarray:
    return np.concatenate([p.astype(np.uint8) if p.dtype != np.float16 else p.view(np.uint8) for p in parts], axis=1)


def _affine(x: np.ndarray, levels: int, scale_bits: int) -> tuple[np.ndarray, ...]:
    """x (n, groups, size) -> (d16, dmin16, scale codes, min codes, q) for x ~ d*sc*q - dmin*m."""
    lo = np.minimum(x.min(-1), 0.0)
    scale = (x.max(-1) - lo) / levels
    smax = (1 << scale_bits) - 1
    d, dmin = _f16(scale.max(-1, keepdims=True) / smax), _f16((-lo).max(-1, keepdims=True) / smax)
    sc, m = _round(_div(scale, d), 0, smax), _round(_div(-lo, dmin), 0, smax)
    eff_scale, eff_min = d * sc, dmin * m
    q = _round(_div(x + eff_min[..., None], eff_scale[..., None]), 0, levels)
    return d.astype(np.float16), dmin.astype(np.float16), sc, m, q


def _pack_k_scales(sc: np.ndarray, m: np.ndarray) -> np.ndarray:
    """8 six-bit scales and mins -> the 12 bytes Q4_K/Q5_K keep them in."""
    out = np.zeros((sc.shape[0], 12), np.int32)
    out[:, 0:4] = (sc[:, :4] & 63) | ((sc[:, 4:] >> 4) << 6)
    out[:, 4:8] = (m[:, :4] & 63) | ((m[:, 4:] >> 4) << 6)
    out[:, 8:12] = (sc[:, 4:] & 15) | ((m[:, 4:] & 15) << 4)
    return out


def _nibbles_k(q: np.ndarray) -> np.ndarray:
    """(n, 256) codes < 16 -> 128 bytes: in each 64 values, the first 32 low, the next 32 high."""
    q = q.reshape(-1, 4, 2, 32)
    return (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(-1, 128)


def _packed(fields: Iterable[np.ndarray]) -> np.ndarray:
    """Bit fields (disjoint bits, already shifted into place) added into one array."""
    total, *rest = fields
    for f in rest:
        total = total + f
    return total


def _crumbs(q: np.ndarray, bits: int = 2) -> np.ndarray:
    """(n, 256) codes < 4 -> 64 bytes: in each 128 values, four runs of 32 share 32 bytes."""
    q = q.reshape(-1, 2, 4, 32)
    return _packed(q[:, :, k] << (bits * k) for k in range(4)).reshape(-1, 64)


def _bitplane(q: np.ndarray) -> np.ndarray:
    """(n, 256) bits -> 32 bytes: byte l holds bit i of value 32*i + l."""
    q = q.reshape(-1, 8, 32)
    return _packed(q[:, i] << i for i in range(8))


def _q4_k(x: np.ndarray) -> np.ndarray:
    d, dmin, sc, m, q = _affine(x.reshape(-1, 8, 32), 15, 6)
    return _bytes(d, dmin, _pack_k_scales(sc, m), _nibbles_k(q.reshape(-1, 256)))


def _q5_k(x: np.ndarray) -> np.ndarray:
    d, dmin, sc, m, q = _affine(x.reshape(-1, 8, 32), 31, 6)
    q = q.reshape(-1, 256)
    return _bytes(d, dmin, _pack_k_scales(sc, m), _bitplane(q >> 4), _nibbles_k(q & 15))


def _q2_k(x: np.ndarray) -> np.ndarray:
    d, dmin, sc, m, q = _affine(x.reshape(-1, 16, 16), 3, 4)
    return _bytes(sc | (m << 4), _crumbs(q.reshape(-1, 256)), d, dmin)


def _symmetric(x: np.ndarray, qmax: int, scale_max: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """x (n, groups, size) -> (d16, signed scale codes, q) for x ~ d*sc*q, |q| <= qmax."""
    scale = np.abs(x).max(-1) / qmax
    d = _f16(scale.max(-1, keepdims=True) / scale_max)
    sc = _round(_div(scale, d), -scale_max - 1, scale_max)
    q = _round(_div(x, (d * sc)[..., None]), -qmax - 1, qmax)
    return d.astype(np.float16), sc, q


def _q3_k(x: np.ndarray) -> np.ndarray:
    d, sc, q = _symmetric(x.reshape(-1, 16, 16), 3, 31)
    u, q = sc + 32, q.reshape(-1, 256)
    low, high = u & 15, u >> 4
    scales = np.concatenate([low[:, :8] | (low[:, 8:] << 4),
                             _packed(high[:, 4 * k:4 * k + 4] << (2 * k) for k in range(4))], axis=1)
    return _bytes(_bitplane((q >= 0).astype(np.int32)), _crumbs(q & 3), scales, d)


def _q6_k(x: np.ndarray) -> np.ndarray:
    d, sc, q = _symmetric(x.reshape(-1, 16, 16), 31, 127)
    q = (q + 32).reshape(-1, 2, 2, 64)  # halves of 128 values, each two runs of 64
    ql = ((q[:, :, 0] & 15) | ((q[:, :, 1] & 15) << 4)).reshape(-1, 128)
    qh = _crumbs((q >> 4).reshape(-1, 256))
    return _bytes(ql, qh, sc.astype(np.int8).view(np.uint8), d)


def _iq4_codes(x: np.ndarray, step: np.ndarray) -> np.ndarray:
    """Nearest of the 16 IQ4 levels to x / step."""
    return np.abs(_div(x, step)[..., None] - IQ4_LEVELS).argmin(-1)


def _extreme(x: np.ndarray) -> np.ndarray:
    """The value of largest magnitude along the last axis (with its sign)."""
    return np.take_along_axis(x, np.abs(x).argmax(-1)[..., None], -1)[..., 0]


def _iq4_nl(x: np.ndarray) -> np.ndarray:
    x = x.reshape(-1, 32)
    d = _f16(_extreme(x) / -127)[:, None]
    q = _iq4_codes(x, d)
    return _bytes(d.astype(np.float16), q[:, :16] | (q[:, 16:] << 4))


def _iq4_xs(x: np.ndarray) -> np.ndarray:
    x = x.reshape(-1, 8, 32)
    scale = _extreme(x) / -127
    d = _f16(np.abs(scale).max(-1, keepdims=True) / 31)
    ls = _round(_div(scale, d), -32, 31)
    q = _iq4_codes(x, (d * ls)[..., None])  # (n, 8, 32)
    u = ls + 32
    scales_h = _packed((u[:, s] >> 4) << (2 * s) for s in range(8)).astype(np.uint16)[:, None]
    scales_l = (u[:, 0::2] & 15) | ((u[:, 1::2] & 15) << 4)
    qs = (q[:, :, :16] | (q[:, :, 16:] << 4)).reshape(-1, 128)
    return _bytes(d.astype(np.float16), scales_h.view(np.uint8), scales_l, qs)


_ENCODERS: dict[Q, Callable[[np.ndarray], np.ndarray]] = {
    Q.Q2_K: _q2_k, Q.Q3_K: _q3_k, Q.Q4_K: _q4_k, Q.Q5_K: _q5_k, Q.Q6_K: _q6_k,
    Q.IQ4_NL: _iq4_nl, Q.IQ4_XS: _iq4_xs,
}


def quantize(x: np.ndarray, qtype: Q) -> np.ndarray:
    """A float array (..., cols) -> its GGUF storage: float types as they are, quantised types as
    uint8 blocks (..., cols / block * block bytes)."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    if qtype not in _ENCODERS:
        return gq.quantize(x, qtype)
    block, size = GGML_QUANT_SIZES[qtype]
    if x.shape[-1] % block:
        raise ValueError(f"a row of {x.shape[-1]} values is not a whole number of {qtype.name} blocks of {block}")
    blocks = _ENCODERS[qtype](x.reshape(-1, block))
    assert blocks.shape[1] == size
    return blocks.reshape(*x.shape[:-1], x.shape[-1] // block * size)


# ---- whole files ------------------------------------------------------------------------------
def llama_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp stores Llama's q/k rows with each head's two rotary halves interleaved."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_name(arch: str, hf_name: str, num_layers: int) -> str:
    """A Hugging Face tensor name -> its GGUF name (gguf-py's own table); a name already in
    GGUF's form ("blk.0.ssm_a") is kept."""
    if hf_name.startswith("blk."):
        return hf_name
    arch_id = next(k for k, v in MODEL_ARCH_NAMES.items() if v == arch)
    table = get_tensor_name_map(arch_id, num_layers)
    whole = table.get_name(hf_name)  # an MoE layer's experts: "mlp.experts.down_proj", no suffix
    if whole is not None:
        return f"{whole}.weight"
    base, _, suffix = hf_name.rpartition(".")
    name = table.get_name(base)
    if name is None:
        raise ValueError(f"no GGUF name for {hf_name} in a {arch} model")
    return f"{name}.{suffix}"


def add_keys(w: GGUFWriter, arch: str, keys: Mapping[str, Any]) -> None:
    """Metadata under "<arch>.": ints as uint32, floats as float32, bools, lists as arrays,
    anything else as a string."""
    for key, value in keys.items():
        full = f"{arch}.{key}"
        if isinstance(value, bool):
            w.add_bool(full, value)
        elif isinstance(value, int):
            w.add_uint32(full, value)
        elif isinstance(value, float):
            w.add_float32(full, value)
        elif isinstance(value, (list, tuple)):
            w.add_array(full, list(value))
        else:
            w.add_string(full, str(value))


def _common_keys(w: GGUFWriter, config: dict) -> None:
    """The architecture's metadata every llama-style file has, from a transformers-style config."""
    heads = config["num_attention_heads"]
    w.add_context_length(config["max_position_embeddings"])
    w.add_embedding_length(config["hidden_size"])
    w.add_block_count(config["num_hidden_layers"])
    w.add_feed_forward_length(config["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(config["num_key_value_heads"])
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    w.add_rope_dimension_count(config.get("rotary_dim") or head_dim)  # (a partial rotary: fewer)
    if config.get("head_dim"):  # a config that names it (Gemma's differs from hidden / heads)
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    experts = config.get("num_experts") or config.get("num_local_experts")  # transformers 5 keeps the latter
    if experts:
        w.add_expert_count(experts)
        w.add_expert_used_count(config["num_experts_per_tok"])
        if config.get("moe_intermediate_size"):  # Mixtral's experts are intermediate_size wide
            w.add_expert_feed_forward_length(config["moe_intermediate_size"])
    if config.get("sliding_window"):
        w.add_sliding_window(config["sliding_window"])
    scaling = config.get("rope_scaling") or {}
    if scaling.get("rope_type", "default") != "default":
        w.add_rope_scaling_type(RopeScalingType(scaling["rope_type"]))
        w.add_rope_scaling_factor(float(scaling["factor"]))
        if scaling.get("original_max_position_embeddings"):
            w.add_rope_scaling_orig_ctx_len(int(scaling["original_max_position_embeddings"]))
    w.add_rope_freq_base(float(config["rope_theta"]))
    w.add_layer_norm_rms_eps(float(config["rms_norm_eps"]))


def _tokenizer(w: GGUFWriter, tokenizer: dict, tokens: list[str]) -> None:
    """The tokenizer's metadata (write_gguf's `tokenizer`), `tokens` padded to the vocabulary."""
    w.add_vocab_size(len(tokens))
    w.add_tokenizer_model(tokenizer.get("model", "gpt2"))
    w.add_tokenizer_pre(tokenizer.get("pre", "default"))
    w.add_token_list(tokens)
    special = tokenizer.get("special", ())
    types = tokenizer.get("types") or [TokenType.CONTROL if t in special else TokenType.NORMAL for t in tokens]
    w.add_token_types(list(types) + [TokenType.UNUSED] * (len(tokens) - len(types)))
    if tokenizer.get("scores"):
        w.add_token_scores(list(tokenizer["scores"]) + [0.0] * (len(tokens) - len(tokenizer["scores"])))
    if tokenizer["merges"]:
        w.add_token_merges(tokenizer["merges"])
    w.add_bos_token_id(tokenizer["bos_id"])
    w.add_eos_token_id(tokenizer["eos_id"])
    w.add_pad_token_id(tokenizer["pad_id"])
    if tokenizer.get("unk_id") is not None:
        w.add_unk_token_id(tokenizer["unk_id"])
    w.add_add_bos_token(bool(tokenizer.get("add_bos", False)))
    if tokenizer.get("chat_template"):
        w.add_chat_template(tokenizer["chat_template"])


def write_gguf(path: Path, arch: str, config: dict, tokenizer: dict,
               tensors: Sequence[tuple[str, tuple[int, ...], Q]], value: Callable[[str], np.ndarray],
               name: str = "synthetic", parts: int = 1, keys: Mapping[str, Any] | None = None,
               common: bool = True) -> Path:
    """Write a GGUF of architecture `arch` ("llama", "qwen2", ...).

    `config`: hidden_size, intermediate_size, num_hidden_layers, num_attention_heads,
    num_key_value_heads, max_position_embeddings, rms_norm_eps, rope_theta, vocab_size; and
    where the model has them head_dim, num_experts (or num_local_experts), num_experts_per_tok,
    moe_intermediate_size, sliding_window, rope_scaling ({"rope_type": "linear", "factor": 8.0}),
    rotary_dim (where the rotary embedding turns fewer values than a head's).
    An MoE layer's experts are given as llama.cpp stores them: (E, out, in)
    "mlp.experts.gate_proj", "mlp.experts.up_proj" (transformers' fused gate_up_proj split in
    its halves) and "mlp.experts.down_proj". Gemma's norms are stored plus one, as llama.cpp's
    converter stores them.
    `tokenizer`: tokens (byte-level spelled; padded with unused tokens up to vocab_size),
    merges ("a b"), special (the control tokens), bos/eos/pad ids, chat_template, pre
    (llama.cpp's pre-tokenizer name); for a SentencePiece vocabulary (Gemma) model "llama",
    types (llama.cpp's token types), scores, unk_id, add_bos, and no merges. `tensors`: (Hugging Face name, shape, GGUF type) in file
    order; `value(name)` gives each one when it is written: float values (quantised here), or
    its GGUF bytes already (uint8, rows x row bytes: random_blocks). With `parts` > 1 the model
    is split as llama.cpp's gguf-split does it (gguf-py's writer: `<stem>-00001-of-0000N.gguf`,
    whole tensors per part, the metadata in the first); the first part's path is returned.
    `keys`: more of the architecture's metadata, by name after "<arch>." (add_keys), written
    after the common ones; with `common` False, the architecture's whole metadata (Gemma 4's
    per-layer arrays and widths, which the common keys would name twice): `config` then only
    names num_hidden_layers, num_attention_heads, num_key_value_heads and vocab_size."""
    layers = config["num_hidden_layers"]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    tokens = list(tokenizer["tokens"])
    tokens += [f"<unused{i}>" for i in range(config.get("vocab_size", len(tokens)) - len(tokens))]
    w = GGUFWriter(path, arch, split_max_tensors=-(-len(tensors) // parts) if parts > 1 else 0)
    w.add_name(name)
    if common:
        _common_keys(w, config)
    add_keys(w, arch, keys or {})
    _tokenizer(w, tokenizer, tokens)
    for hf, shape, qtype in tensors:  # the tensor table first: names, shapes, types, sizes
        if qtype in (Q.F32, Q.F16):
            w.add_tensor_info(gguf_name(arch, hf, layers), shape, np.dtype(np.float32 if qtype == Q.F32 else np.float16),
                              int(np.prod(shape)) * (4 if qtype == Q.F32 else 2))
        else:
            byte_shape = quant_shape_to_byte_shape(shape, qtype)
            w.add_tensor_info(gguf_name(arch, hf, layers), byte_shape, np.dtype(np.uint8), int(np.prod(byte_shape)),
                              raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for hf, shape, qtype in tensors:  # then the data, one tensor in memory at a time
        data = value(hf)
        if data.dtype != np.uint8:
            if arch == "llama" and hf.endswith(("q_proj.weight", "k_proj.weight")):
                data = llama_permute(data, heads if "q_proj" in hf else kv_heads)
            if arch == "gemma3" and hf.endswith("norm.weight"):
                data = data + 1  # llama.cpp folds Gemma's (1 + w) into the stored norm
            data = quantize(data, qtype)
        w.write_tensor_data(data)
    w.close()
    return w.format_shard_names(path)[0] if parts > 1 else path


# byte offsets of each type's fp16 scale fields (ggml's block structs)
SCALE_FIELDS = {Q.Q4_0: (0,), Q.Q4_1: (0, 2), Q.Q5_0: (0,), Q.Q5_1: (0, 2), Q.Q8_0: (0,), Q.Q2_K: (80, 82),
                Q.Q3_K: (108,), Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,), Q.IQ4_NL: (0,), Q.IQ4_XS: (0,)}


def random_blocks(qtype: Q, shape: tuple[int, ...], rng: np.random.Generator, scale: float = 1e-4) -> np.ndarray:
    """GGUF bytes of a tensor of random blocks: random codes, fp16 scales of magnitude `scale`
    (either sign), as fast as random bytes (for large synthetic files whose values do not matter)."""
    byte_shape = quant_shape_to_byte_shape(shape, qtype)
    _, size = GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, size=int(np.prod(byte_shape)), dtype=np.uint8).reshape(-1, size)
    for at in SCALE_FIELDS[qtype]:
        d = (rng.uniform(0.5, 1.0, blocks.shape[0]) * scale * rng.choice([-1.0, 1.0], blocks.shape[0]))
        blocks[:, at:at + 2] = d.astype(np.float16).view(np.uint8).reshape(-1, 2)
    return blocks.reshape(byte_shape)


def random_tensor(qtype: Q, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    """A synthetic model's tensor: F32 ones (norms), else random blocks whose fp16 scales make
    weights of about 0.02 (IQ4's levels reach 127, Q6_K's and Q8_0's codes 32 and 127)."""
    if qtype == Q.F32:
        return np.ones(shape, dtype=np.float32)
    scale = 5e-6 if qtype in (Q.IQ4_XS, Q.IQ4_NL) else 2e-5 if qtype in (Q.Q6_K, Q.Q8_0, Q.Q3_K) else 8e-5
    return random_blocks(qtype, shape, rng, scale=scale)


# llama.cpp's file types (LLAMA_FTYPE_MOSTLY_*) of a file whose quantised tensors are all one type
FILE_TYPES = {Q.Q4_0: 2, Q.Q4_1: 3, Q.Q8_0: 7, Q.IQ4_NL: 25, Q.IQ4_XS: 30}


def rewriter(reader: Any, part: Path, changes: Mapping[str, Any]) -> GGUFWriter:
    """A GGUFWriter at `part` holding `reader`'s (a gguf.GGUFReader's) metadata, with the keys
    of `changes` set to their values (added where the source lacks them): a rewritten file's
    header, before its tensors."""
    from gguf import GGUFValueType  # noqa: PLC0415

    arch = str(reader.fields["general.architecture"].contents())
    part.parent.mkdir(parents=True, exist_ok=True)
    w = GGUFWriter(part, arch)
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        main = field.types[0]
        w.add_key_value(key, changes.get(key, field.contents()), main,
                        field.types[-1] if main == GGUFValueType.ARRAY else None)
    for key, value in changes.items():
        if key in reader.fields:
            continue
        if isinstance(value, int):
            w.add_uint32(key, value)
        else:
            w.add_string(key, str(value))
    return w


def requantize_gguf(src: Path, dest: Path, qtype: Q) -> Path:
    """`src` rewritten with every quantised tensor in `qtype` (its de-quantised values re-encoded;
    float tensors, metadata and tensor order as they are): the starter's Q4_1 file as Q8_0, for
    the peer benchmark. Written to `dest` + ".part", then renamed; idempotent."""
    if dest.is_file():
        return dest
    from gguf import GGUFReader  # noqa: PLC0415 (only the rewriters need the reader)

    reader = GGUFReader(src)
    part = dest.with_name(dest.name + ".part")
    w = rewriter(reader, part, {"general.file_type": FILE_TYPES[qtype]} if qtype in FILE_TYPES else {})
    infos = []
    for t in reader.tensors:
        shape = tuple(int(s) for s in reversed(t.shape.tolist()))  # rows first, as numpy reads them
        keep = t.tensor_type in (Q.F32, Q.F16, Q.BF16)
        new = Q(t.tensor_type) if keep else qtype
        if keep:
            data = np.asarray(t.data)
            w.add_tensor_info(t.name, shape, data.dtype, int(data.nbytes))
        else:
            byte_shape = quant_shape_to_byte_shape(shape, new)
            w.add_tensor_info(t.name, byte_shape, np.dtype(np.uint8), int(np.prod(byte_shape)), raw_dtype=new)
        infos.append((t, shape, keep))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for t, shape, keep in infos:
        if keep:
            w.write_tensor_data(np.asarray(t.data))
        else:
            values = gq.dequantize(np.asarray(t.data), t.tensor_type).reshape(shape)
            w.write_tensor_data(quantize(values, qtype))
    w.close()
    os.replace(part, dest)
    return dest
