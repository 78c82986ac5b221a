"""GGUF blocks de-quantised with torch ops, on whatever device the bytes are.

Each ggml type stores a row as a run of fixed-size blocks (a few fp16 scales and packed codes,
ggml's `block_q4_0` .. `block_iq4_xs`); a weight matrix is its rows one after the other. These
functions turn (n, block bytes) uint8 into (n, block values) fp32 with the same float32
operations, in the same order, as gguf-py's reference decoder (gguf.quants), so the result is
bit for bit the file's own de-quantised weights; tests/engine/offload/test_gguf_blocks.py holds
every type to that. The float types (F32, F16, BF16) are read as they are.

`dequantize_into` fills a dense parameter (any dtype) from a tensor's bytes a bounded number of
rows at a time, so the fp32 intermediate never grows with the tensor.

What this module does not do: know tensor names or files (engine.loading.gguf) or layouts.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import torch
from gguf import GGMLQuantizationType as Q
from gguf.constants import GGML_QUANT_SIZES

# ggml types the store keeps packed and this module de-quantises
PACKED = (Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.IQ4_NL, Q.IQ4_XS, Q.MXFP4)
FLOATS = {Q.F32: torch.float32, Q.F16: torch.float16, Q.BF16: torch.bfloat16}
SUPPORTED = frozenset(int(t) for t in (*PACKED, *FLOATS))
CHUNK_VALUES = 1 << 22  # values de-quantised per step of dequantize_into (16 MB of fp32; x8 on a GPU)
# MXFP4's E2M1 values doubled (ggml's kvalues_mxfp4): code c is MXFP4_DOUBLED[c] * 2^(e - 128)
MXFP4_DOUBLED = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)
IQ4_LEVELS = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)


def block_size(qtype: int) -> tuple[int, int]:
    """(values, bytes) of one block of `qtype`."""
    return GGML_QUANT_SIZES[Q(qtype)]


def row_bytes(qtype: int, cols: int) -> int:
    values, nbytes = block_size(qtype)
    return cols // values * nbytes


def type_name(qtype: int) -> str:
    try:
        return Q(qtype).name
    except ValueError:
        return f"type {qtype}"


# ---- small readers --------------------------------------------------------------------------
def _f16(blocks: torch.Tensor, at: int) -> torch.Tensor:
    """The fp16 at byte `at` of every block, as (n, 1) fp32."""
    return blocks[:, at:at + 2].contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor, run: int) -> torch.Tensor:
    """(n, k*run) bytes -> (n, 2*k*run) codes: each run of `run` bytes gives its low nibbles,
    then its high nibbles."""
    n = qs.shape[0]
    q = qs.reshape(n, -1, 1, run)
    return torch.cat([q & 15, q >> 4], dim=2).reshape(n, -1)


def _fields(data: torch.Tensor, run: int, width: int) -> torch.Tensor:
    """(n, k*run) bytes -> (n, k*(8/width), run) fields: each run of bytes read `width` bits at a
    time, lowest first: the field at shift s of byte l is value l of sub-run s."""
    n = data.shape[0]
    shifts = torch.arange(0, 8, width, dtype=torch.uint8, device=data.device).reshape(1, 1, -1, 1)
    q = (data.reshape(n, -1, 1, run) >> shifts) & ((1 << width) - 1)
    return q.reshape(n, -1, run)


def _bits32(blocks: torch.Tensor, at: int) -> torch.Tensor:
    """The 32 bits of the little-endian uint32 at byte `at`, as (n, 32) uint8 (bit i at i)."""
    b = blocks[:, at:at + 4].reshape(-1, 4, 1) >> torch.arange(8, dtype=torch.uint8, device=blocks.device)
    return (b & 1).reshape(-1, 32)


def _k_scales(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The 12 bytes of eight 6-bit scales and mins of Q4_K/Q5_K -> two (n, 8) fp32."""
    d, m, md = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    sc = torch.cat([d & 63, (md & 15) | ((d >> 2) & 48)], dim=1)
    mn = torch.cat([m & 63, (md >> 4) | ((m >> 2) & 48)], dim=1)
    return sc.float(), mn.float()


# ---- the types ------------------------------------------------------------------------------
def _q4_0(b: torch.Tensor) -> torch.Tensor:
    return _f16(b, 0) * (_nibbles(b[:, 2:18], 16).to(torch.int8) - 8).float()


def _q4_1(b: torch.Tensor) -> torch.Tensor:
    return _f16(b, 0) * _nibbles(b[:, 4:20], 16).float() + _f16(b, 2)


def _q5_0(b: torch.Tensor) -> torch.Tensor:
    q = _nibbles(b[:, 6:22], 16) | (_bits32(b, 2) << 4)
    return _f16(b, 0) * (q.to(torch.int8) - 16).float()


def _q5_1(b: torch.Tensor) -> torch.Tensor:
    q = _nibbles(b[:, 8:24], 16) | (_bits32(b, 4) << 4)
    return _f16(b, 0) * q.float() + _f16(b, 2)


def _q8_0(b: torch.Tensor) -> torch.Tensor:
    return b[:, 2:34].contiguous().view(torch.int8).float() * _f16(b, 0)


def _q2_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    scales = b[:, 0:16]
    dl = (_f16(b, 80) * (scales & 15).float()).reshape(n, 16, 1)
    ml = (_f16(b, 82) * (scales >> 4).float()).reshape(n, 16, 1)
    q = _fields(b[:, 16:80], 32, 2).reshape(n, 16, 16).float()
    return (dl * q - ml).reshape(n, 256)


def _q3_k_scales(b: torch.Tensor) -> torch.Tensor:
    """Q3_K blocks -> each group of 16's 6-bit scale less 32 (n, 16) fp32, the integer d multiplies."""
    n = b.shape[0]
    s = b[:, 96:108]
    low = _fields(s[:, 0:8], 8, 4).reshape(n, 16)
    high = _fields(s[:, 8:12], 4, 2).reshape(n, 16)
    return ((low | (high << 4)).to(torch.int8) - 32).float()


def _q3_k_codes(b: torch.Tensor) -> torch.Tensor:
    """Q3_K blocks -> their signed 3-bit codes (n, 256) int8, -4..3."""
    n = b.shape[0]
    ql = _fields(b[:, 32:96], 32, 2).reshape(n, 16, 16)
    qh = _fields(b[:, 0:32], 32, 1).reshape(n, 16, 16) ^ 1  # a clear mask bit subtracts 4
    return (ql.to(torch.int8) - (qh << 2).to(torch.int8)).reshape(n, 256)


def _q3_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    dl = (_f16(b, 108) * _q3_k_scales(b)).reshape(n, 16, 1)
    return (dl * _q3_k_codes(b).reshape(n, 16, 16).float()).reshape(n, 256)


def _q4_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    sc, mn = _k_scales(b[:, 4:16])
    d = (_f16(b, 0) * sc).reshape(n, 8, 1)
    dm = (_f16(b, 2) * mn).reshape(n, 8, 1)
    q = _nibbles(b[:, 16:144], 32).reshape(n, 8, 32).float()
    return (d * q - dm).reshape(n, 256)


def _q5_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    sc, mn = _k_scales(b[:, 4:16])
    d = (_f16(b, 0) * sc).reshape(n, 8, 1)
    dm = (_f16(b, 2) * mn).reshape(n, 8, 1)
    ql = _nibbles(b[:, 48:176], 32).reshape(n, 8, 32)
    qh = _fields(b[:, 16:48], 32, 1)
    q = (ql | (qh << 4)).float()
    return (d * q - dm).reshape(n, 256)


def _q6_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    scales = b[:, 192:208].contiguous().view(torch.int8).float()
    d = (_f16(b, 208) * scales).reshape(n, 16, 1)
    ql = _nibbles(b[:, 0:128], 64).reshape(n, 8, 32)
    qh = _fields(b[:, 128:192], 32, 2)
    q = ((ql | (qh << 4)).to(torch.int8) - 32).reshape(n, 16, 16).float()
    return (d * q).reshape(n, 256)


def _iq4_nl(b: torch.Tensor) -> torch.Tensor:
    return _f16(b, 0) * _iq4_codes(b[:, 2:18], 16).float()


def _iq4_xs_scales(b: torch.Tensor) -> torch.Tensor:
    """IQ4_XS blocks -> each group of 32's 6-bit scale less 32 (n, 8) fp32, the integer its
    block's fp16 d multiplies."""
    n = b.shape[0]
    low = _nibbles(b[:, 4:8], 1)  # sub-block s: nibble s % 2 of byte s // 2
    high = _fields(b[:, 2:4], 2, 2).transpose(1, 2).reshape(n, 8)  # bits 2s..2s+1 of a uint16
    return ((low | (high << 4)).to(torch.int8) - 32).float()


def _iq4_codes(qs: torch.Tensor, run: int) -> torch.Tensor:
    """IQ4 code bytes -> their table values as int8 codes."""
    table = torch.tensor(IQ4_LEVELS, dtype=torch.int8, device=qs.device)
    return table[_nibbles(qs, run).long()]


def _iq4_xs(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    scale = _iq4_xs_scales(b)
    dl = (_f16(b, 0) * scale).reshape(n, 8, 1)
    q = _iq4_codes(b[:, 8:136], 16).float().reshape(n, 8, 32)
    return (dl * q).reshape(n, 256)


def _mxfp4_parts(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """ggml's MXFP4 block (an E8M0 exponent e, then 16 bytes: byte j holds value j in its low
    nibble, value j + 16 in its high one) -> (the doubled E2M1 values, int8 (n, 32); the block's
    scale 2^(e - 128), fp32 (n, 1))."""
    doubled = torch.tensor(MXFP4_DOUBLED, dtype=torch.int8, device=b.device)
    return doubled[_nibbles(b[:, 1:17], 16).long()], _e8m0_half(b[:, 0:1])


def _e8m0_half(e: torch.Tensor) -> torch.Tensor:
    """E8M0 exponents (uint8) -> 2^(e - 128) in fp32, ggml's e8m0_to_fp32_half: exact for every e."""
    e = e.to(torch.int32)
    bits = torch.where(e < 2, torch.tensor(0x00200000, dtype=torch.int32, device=e.device) << e, (e - 1) << 23)
    return bits.view(torch.float32)


# the types whose nibbles index a table the kernel reads them through (engine.kernels.linear.TABLES)
NIBBLE_TABLES: dict[int, Literal["e2m1", "iq4"]] = {Q.MXFP4: "e2m1", Q.IQ4_NL: "iq4", Q.IQ4_XS: "iq4"}


def table_nibbles(b: torch.Tensor, qtype: int) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None,
                                                      torch.Tensor | None]:
    """(n, block bytes) blocks of a NIBBLE_TABLES type -> their code bytes as they are (n, values / 2)
    uint8 (each 32 values' 16 bytes: value k in byte k's low nibble, k + 16 in its high one, kind
    q4's packing) and their scales: (nibbles, scales (n, groups of 32) fp32, None, None), or for
    IQ4_XS (nibbles, None, d (n, 1), the groups' integers (n, 8)) as K-quants factor theirs.
    MXFP4's scale is 2^(e - 128): the table holds its values doubled."""
    if qtype == Q.MXFP4:
        return b[:, 1:17].contiguous(), _e8m0_half(b[:, 0:1]), None, None
    if qtype == Q.IQ4_NL:
        return b[:, 2:18].contiguous(), _f16(b, 0), None, None
    if qtype == Q.IQ4_XS:
        return b[:, 8:136].contiguous(), None, _f16(b, 0), _iq4_xs_scales(b)
    raise ValueError(f"{type_name(qtype)} has no table of values")


def _mxfp4(b: torch.Tensor) -> torch.Tensor:
    q, d = _mxfp4_parts(b)
    return q.float() * d


_DECODERS: dict[int, Callable[[torch.Tensor], torch.Tensor]] = {
    Q.Q4_0: _q4_0, Q.Q4_1: _q4_1, Q.Q5_0: _q5_0, Q.Q5_1: _q5_1, Q.Q8_0: _q8_0,
    Q.Q2_K: _q2_k, Q.Q3_K: _q3_k, Q.Q4_K: _q4_k, Q.Q5_K: _q5_k, Q.Q6_K: _q6_k,
    Q.IQ4_NL: _iq4_nl, Q.IQ4_XS: _iq4_xs, Q.MXFP4: _mxfp4,
}


# ---- the same blocks as codes, scales and minimums ----------------------------------------------
# Types whose values are scale * code + minimum per group of 16 or 32 ("linear" blocks; every
# quantised type the store keeps): `affine` gives those parts for the packed CPU kernel
# (engine.kernels), whose products read the codes and apply a group's scale once. The IQ4 types
# count, a code being its table value (-127..113), and MXFP4, its E2M1 values doubled being the
# integers -12..12 and its scale a power of two (the kernel keeps both in the file's nibbles:
# `table_nibbles`); Q2_K's and Q3_K's 2- and 3-bit codes, groups of 16, in the kernel's two- and
# three-bit kinds. K_FACTORED types' scales are an fp16 times small integers (`k_factors`).
AFFINE = (Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.MXFP4, Q.IQ4_NL, Q.IQ4_XS, Q.Q2_K,
          Q.Q3_K)
AFFINE_BITS: dict[int, int] = {Q.Q4_0: 4, Q.Q4_1: 4, Q.Q4_K: 4, Q.Q5_0: 5, Q.Q5_1: 5, Q.Q5_K: 5, Q.Q8_0: 8, Q.Q6_K: 6,
                               Q.MXFP4: 4, Q.IQ4_NL: 8, Q.IQ4_XS: 8, Q.Q2_K: 2, Q.Q3_K: 3}  # the bits the kernel keeps a code in
GROUP16 = (Q.Q6_K, Q.Q2_K, Q.Q3_K)  # the AFFINE types whose groups are 16 values


def affine(b: torch.Tensor, qtype: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, int]:
    """(n, block bytes) uint8 blocks of an AFFINE type -> (codes (n, values) int8, scales
    (n, groups) fp32, minimums (n, groups) fp32 or None, group size). scale * code + minimum,
    in fp32, is `dequantize`'s value bit for bit (a code times an fp16 scale needs at most 16
    bits, exact in fp32; a minimum that is -8 d or -16 d is exact too)."""
    n = b.shape[0]
    if qtype in (Q.Q4_0, Q.Q4_1):
        d, q = _f16(b, 0), _nibbles(b[:, 2 if qtype == Q.Q4_0 else 4:18 if qtype == Q.Q4_0 else 20], 16)
        return q.to(torch.int8), d, (-8.0 * d if qtype == Q.Q4_0 else _f16(b, 2)), 32
    if qtype in (Q.Q5_0, Q.Q5_1):
        at = 2 if qtype == Q.Q5_0 else 4
        d, q = _f16(b, 0), _nibbles(b[:, at + 4:at + 20], 16) | (_bits32(b, at) << 4)
        return q.to(torch.int8), d, (-16.0 * d if qtype == Q.Q5_0 else _f16(b, 2)), 32
    if qtype == Q.Q8_0:
        return b[:, 2:34].contiguous().view(torch.int8), _f16(b, 0), None, 32
    if qtype in (Q.Q4_K, Q.Q5_K):
        sc, mn = _k_scales(b[:, 4:16])
        if qtype == Q.Q4_K:
            q = _nibbles(b[:, 16:144], 32)
        else:
            q = (_nibbles(b[:, 48:176], 32).reshape(n, 8, 32) | (_fields(b[:, 16:48], 32, 1) << 4)).reshape(n, 256)
        return q.to(torch.int8), _f16(b, 0) * sc, -(_f16(b, 2) * mn), 32
    if qtype == Q.Q6_K:
        scales = b[:, 192:208].contiguous().view(torch.int8).float()
        ql = _nibbles(b[:, 0:128], 64).reshape(n, 8, 32)
        qh = _fields(b[:, 128:192], 32, 2)
        q = (ql | (qh << 4)).to(torch.int8) - 32
        return q.reshape(n, 256), _f16(b, 208) * scales, None, 16
    if qtype == Q.MXFP4:
        q, d = _mxfp4_parts(b)
        return q, d, None, 32
    if qtype == Q.Q2_K:
        scales = b[:, 0:16]
        return (_fields(b[:, 16:80], 32, 2).reshape(n, 256).to(torch.int8), _f16(b, 80) * (scales & 15).float(),
                -(_f16(b, 82) * (scales >> 4).float()), 16)
    if qtype == Q.Q3_K:
        return _q3_k_codes(b), _f16(b, 108) * _q3_k_scales(b), None, 16
    if qtype == Q.IQ4_NL:
        return _iq4_codes(b[:, 2:18], 16), _f16(b, 0), None, 32
    if qtype == Q.IQ4_XS:
        return _iq4_codes(b[:, 8:136], 16), _f16(b, 0) * _iq4_xs_scales(b), None, 32
    raise ValueError(f"{type_name(qtype)} is not a linear block type")


K_FACTORED = (Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.IQ4_XS, Q.Q2_K, Q.Q3_K)  # scales (and minimums) an fp16 times small integers


def k_factors(b: torch.Tensor, qtype: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None,
                                                    torch.Tensor | None]:
    """(n, block bytes) uint8 blocks of a K_FACTORED type -> the factors of affine's scales and
    minimums, per 8 groups one fp16 value and per group an integer: (d (n, blocks of 8 groups),
    sc (n, groups), dmin or None, mn or None), with affine's scales = d * sc and minimums =
    dmin * mn (dmin holds the minimum's sign: -dmin of the block)."""
    if qtype in (Q.Q4_K, Q.Q5_K):
        sc, mn = _k_scales(b[:, 4:16])
        return _f16(b, 0), sc, -_f16(b, 2), mn
    if qtype == Q.Q6_K:  # 16 groups of 16: the block's one factor serves both halves
        return _f16(b, 208).repeat(1, 2), b[:, 192:208].contiguous().view(torch.int8).float(), None, None
    if qtype == Q.IQ4_XS:
        return _f16(b, 0), _iq4_xs_scales(b), None, None
    if qtype == Q.Q2_K:  # 16 groups of 16: each factor serves both halves, as Q6_K's
        scales = b[:, 0:16]
        return (_f16(b, 80).repeat(1, 2), (scales & 15).float(), -_f16(b, 82).repeat(1, 2), (scales >> 4).float())
    if qtype == Q.Q3_K:
        return _f16(b, 108).repeat(1, 2), _q3_k_scales(b), None, None
    raise ValueError(f"{type_name(qtype)} is not a K-quant type")


def dequantize(data: torch.Tensor, qtype: int) -> torch.Tensor:
    """Flat uint8 bytes of whole blocks of `qtype` -> flat fp32 values (float types: as stored,
    converted to fp32)."""
    if qtype in FLOATS:
        return data.view(FLOATS[Q(qtype)]).float()
    values, nbytes = block_size(qtype)
    return _DECODERS[qtype](data.reshape(-1, nbytes)).reshape(-1)


def dequantize_into(data: torch.Tensor, qtype: int, out: torch.Tensor,
                    row_order: torch.Tensor | None = None, chunk_values: int = CHUNK_VALUES) -> None:
    """Fill `out` (rows, cols) or (cols,), any dtype, on data's device, from the bytes of a tensor
    stored row after row. `row_order[j]` is the stored row that becomes row j (llama.cpp stores
    Llama's q/k rows permuted); None keeps the order. Rows are de-quantised about `chunk_values`
    values at a time (x8 on a GPU). `out` may be a strided slice of a larger tensor along its
    second-last dim (a part of fused experts, (E, rows of a part, cols)): it is filled a few
    whole matrices at a time."""
    if out.dim() > 2 and not out.is_contiguous():
        _dequantize_matrices(data, qtype, out, row_order, chunk_values)
        return
    out2 = out.reshape(-1, out.shape[-1])
    rows, cols = out2.shape
    if qtype in FLOATS:
        stored = data.view(FLOATS[Q(qtype)]).reshape(rows, cols)
        out2.copy_(stored if row_order is None else stored[row_order])
        return
    per_row = row_bytes(qtype, cols)
    stored_rows = data.reshape(rows, per_row)
    # fewer, larger steps on a GPU, where each op is a kernel launch
    step = max(1, chunk_values * (8 if data.device.type == "cuda" else 1) // cols)
    for r in range(0, rows, step):
        end = min(rows, r + step)
        src = stored_rows[r:end] if row_order is None else stored_rows[row_order[r:end]]
        out2[r:end].copy_(dequantize(src.reshape(-1), qtype).reshape(end - r, cols))


def _dequantize_matrices(data: torch.Tensor, qtype: int, out: torch.Tensor, row_order: torch.Tensor | None,
                         chunk_values: int) -> None:
    """dequantize_into for an `out` (E, rows, cols) whose matrices are not adjacent (any strides):
    a few whole matrices at a time through a contiguous buffer."""
    assert row_order is None and out.dim() == 3, "parts of (E, rows, cols) experts, in stored row order"
    n, rows, cols = out.shape
    per_matrix = data.numel() // n
    step = max(1, chunk_values * (8 if data.device.type == "cuda" else 1) // (rows * cols))
    for m in range(0, n, step):
        end = min(n, m + step)
        tmp = torch.empty((end - m, rows, cols), dtype=out.dtype, device=out.device)
        dequantize_into(data[m * per_matrix:end * per_matrix], qtype, tmp, None, chunk_values)
        out[m:end].copy_(tmp)
