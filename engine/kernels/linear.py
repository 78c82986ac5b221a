"""Linear layers whose weights stay group-quantised on the CPU: `PackedLinear`, a drop-in for an
inference `nn.Linear`, running qmatmul.c through ctypes.

A `QuantWeight` holds a weight (out_features x in_features) as codes, a scale per group and
optionally a minimum per group, w = scale * code (+ minimum):

- "q8": int8 codes (N x K), groups of 16 or 32: GGUF's Q8_0 (and 5- or 6-bit codes whose rows
  are not whole chunks of 64);
- "q6": codes -32..31 in six bits (N x K/64*48, `pack6`), groups of 16 or 32: Q6_K (groups of
  16), Q5_0/Q5_1/Q5_K (codes 0..31, with minimums);
- "q4": codes 0..15 packed two per byte (N x K/2; in each group of 32, byte k holds value k in
  its low nibble and value k + 16 in its high nibble), groups of 32: Q4_0, Q4_1, Q4_K. Q4_0's
  minimum, -8 scale, is not stored (`offset` 8): 0.5625 bytes a weight, the file's;
- "q2": codes 0..3 in two bits, with minimums (N x K/4), and "q3": codes -4..3 in three bits
  (N x K/128*48, `pack_low`), groups of 16, rows of whole 128s: Q2_K and Q3_K at 0.41 / 0.45
  bytes a weight with their scales as the file factors them (the files' 0.33 / 0.43; in kind
  q6 they took 0.91 / 0.83).

Codes may also be nibbles (packed as q4's) that index a table of values (`table`, no minimums;
`from_nibbles`): MXFP4 (gpt-oss's experts) is a q4 whose codes index E2M1's values doubled
("e2m1", -12..12), IQ4_NL and IQ4_XS a q8 whose codes index IQ4's table ("iq4", -127..113): the
files' nibbles, 0.5625 bytes a weight with an fp16 scale per 32 (IQ4_XS: 0.54, its scales as
K-quants factor theirs).

Scales and minimums are kept in fp16 where every one of a weight's is exactly an fp16 value (the
file's own fp16 scales: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0), as K-quants store them where they are
K-quants' (per 8 groups an fp16 factor and 8 int8 multipliers, 10 bytes, uint8 tensors: the
kernel multiplies them out in fp32, exactly: `from_factors`), else in fp32: the values
multiplied are the file's either way. A Q4_1 step reads 0.625 bytes a weight, a Q4_K one 0.578
(0.75 with its scale products in fp32), a Q6_K one 0.828 (kind q6: six bits a code, 48 bytes per
64 values as `pack6` lays them out; as int8 codes it was 1.08), the file's 0.820.

`from_codes` packs codes of either kind (engine.offload.gguf_blocks.affine gives them);
`from_dense` quantises a float weight (tests and benchmarks); `dequantize` is the reference.

What this module does not do: build the kernel (build.py) or decide which layers use it.
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

from engine.kernels.build import kernels
from engine.kernels.governor import governor
from engine.offload import gguf_blocks

Kind = Literal["q8", "q4", "q6", "q2", "q3"]
Table = Literal["e2m1", "iq4"]
KIND_CODES = {"q8": 8, "q4": 4, "q6": 6, "q2": 2, "q3": 3}  # qmatmul.c's kind codes
HALF = 256  # qmatmul.c's QM_HALF: the scales and minimums are fp16
KSC = 512  # qmatmul.c's QM_KSC: the scales and minimums as K-quants store them (uint8 tensors)
OFF8 = 1024  # qmatmul.c's QM_OFF8: q4 codes offset by 8, no minimums stored (QuantWeight.offset)
# a table's values and its flag in qmatmul.c's kind code (QuantWeight.table), and the kind whose
# integer path reads them: MXFP4's values times 2 (ggml's kvalues_mxfp4, QM_E2M1) as q4 codes,
# IQ4's (ggml's kvalues_iq4nl, QM_IQ4) as q8 codes
TABLES: dict[str, tuple[tuple[int, ...], int, Kind]] = {
    "e2m1": (gguf_blocks.MXFP4_DOUBLED, 2048, "q4"),
    "iq4": (gguf_blocks.IQ4_LEVELS, 4096, "q8"),
}


@dataclass(frozen=True)
class QuantWeight:
    kind: Kind
    codes: torch.Tensor  # q8: int8 (N, K); q4: uint8 (N, K/2)
    scales: torch.Tensor  # fp32 or fp16 (N, K/group), or uint8 K-scales (N, K/group/8 * 10)
    mins: torch.Tensor | None  # the scales' dtype and layout, or None
    group: int
    out_features: int
    in_features: int
    offset: int = 0  # q4 without minimums: each value scale * (code - offset); 8 for GGUF's Q4_0
    table: Table | None = None  # codes are nibbles indexing TABLES[table]: each value scale * that (MXFP4, IQ4)

    @functools.cached_property
    def args(self) -> tuple[int, int, int, int | None]:
        """The kernel's kind code and the addresses of codes, scales and minimums (the tensors
        live as long as the weight and are never replaced: it is frozen)."""
        half = HALF if self.scales.dtype == torch.float16 else KSC if self.scales.dtype == torch.uint8 else 0
        flags = half | (OFF8 if self.offset else 0) | (TABLES[self.table][1] if self.table else 0)
        return (KIND_CODES[self.kind] | flags, self.codes.data_ptr(),
                self.scales.data_ptr(), self.mins.data_ptr() if self.mins is not None else None)

    def like(self, codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None,
             out_features: int) -> QuantWeight:
        """A weight of this one's kind, group, width and offset (or table) over other tensors
        (rows of it, rows stacked with another's, or a copy on another device)."""
        return QuantWeight(self.kind, codes, scales, mins, self.group, out_features, self.in_features, self.offset,
                           self.table)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.codes, self.scales, self.mins) if t is not None)


def from_codes(codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None, group: int,
               bits: int) -> QuantWeight:
    """codes (N, K) of `bits` bits (signed when there are no minimums), scales and minimums
    (N, K/group) -> the kind that holds them: "q4" for 4-bit codes in groups of 32, else "q8"."""
    n, k = codes.shape
    if k % group or group % 8:
        raise ValueError(f"{k} columns are not a whole number of groups of {group}")
    scales = scales.float().reshape(n, k // group).contiguous()
    mins = mins.float().reshape(n, k // group).contiguous() if mins is not None else None
    if all(t is None or _exact_half(t) for t in (scales, mins)):  # the kernel reads 2 bytes, not 4
        scales = scales.half()
        mins = mins.half() if mins is not None else None
    kind, packed = _packed_codes(codes, group, bits, mins is not None)
    if kind == "q4" and mins is not None and torch.equal(mins.float(), -8.0 * scales.float()):
        return QuantWeight(kind, packed, scales, None, group, n, k, offset=8)  # Q4_0: the file's 0.5625 bytes a weight
    return QuantWeight(kind, packed, scales, mins, group, n, k)


def from_nibbles(nibbles: torch.Tensor, table: Table, scales: torch.Tensor | None = None,
                 d: torch.Tensor | None = None, mult: torch.Tensor | None = None) -> QuantWeight:
    """Codes that index a table, as the files store them: nibbles (N, K/2) uint8, each group of 32
    values in 16 bytes (byte k: value k's code in its low nibble, value k + 16's in its high one,
    as kind q4 packs them), and each group's scale: `scales` (N, K/32) (fp16 where all are fp16
    values), or as K-quants factor them, `d` (N, K/256) fp16 values times `mult` (N, K/32) small
    integers (IQ4_XS). MXFP4's scale is its E8M0 scale / 2 (table "e2m1" holds its values doubled)."""
    n, half_k = nibbles.shape
    k = half_k * 2
    if k % (256 if d is not None else 32):
        raise ValueError(f"{k} columns are not a whole number of groups of 32 (blocks of 256 with factored scales)")
    if d is not None and mult is not None:
        params = _k_params(d, mult)
    elif scales is not None:
        params = scales.float().reshape(n, k // 32).contiguous()
        if _exact_half(params):
            params = params.half()
    else:
        raise ValueError("from_nibbles needs scales, or d and mult")
    return QuantWeight(TABLES[table][2], nibbles.to(torch.uint8).contiguous(), params, None, 32, n, k, table=table)


def _packed_codes(codes: torch.Tensor, group: int, bits: int, has_mins: bool) -> tuple[Kind, torch.Tensor]:
    n, k = codes.shape
    if bits <= 4 and group == 32 and has_mins:
        q = codes.to(torch.uint8).reshape(n, k // 32, 2, 16)
        return "q4", (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(n, k // 2).contiguous()
    if bits in (2, 3) and group == 16 and k % 128 == 0:
        lo, hi = int(codes.min()), int(codes.max())
        if bits == 2 and has_mins and lo >= 0 and hi <= 3:
            return "q2", pack_low(codes, 2)
        if bits == 3 and not has_mins and lo >= -4 and hi <= 3:
            return "q3", pack_low(codes, 3)
    if bits in (2, 3, 5, 6) and group in (16, 32) and k % 64 == 0 and int(codes.min()) >= -32 and int(codes.max()) <= 31:
        return "q6", pack6(codes, group)
    return "q8", codes.to(torch.int8).contiguous()


def pack6(codes: torch.Tensor, group: int = 32) -> torch.Tensor:
    """(N, K) codes in -32..31 -> kind q6's bytes (N, K / 64 * 48), c = code + 32. Each whole 128
    values: 64 bytes of low nibbles (byte j: value lo(j)'s, value hi(j)'s in the high nibble), then
    32 bytes of the top two bits (byte j, bits 2i and 2i + 1: value lo(j)'s, lo(j + 32)'s,
    hi(j)'s, hi(j + 32)'s for i = 0..3). Groups of 32: lo(j) = j, hi(j) = j + 64; groups of 16
    (Q6_K): lo(j) the first 8 values of group j / 8, hi(j) its last 8, so the two halves of a
    64-byte load cover the same 8 groups and their dots add in one lane (qm_digits.h). A last 64
    (K = 64 mod 128): 32 bytes of low nibbles (value j, value j + 32), then 16 bytes of top bits
    (byte j, bits 2i, 2i + 1: value j + 16 i's). qmatmul.c's expand_q6 reads both."""
    n, k = codes.shape
    c = (codes.to(torch.int16) + 32).to(torch.uint8)
    whole = k // 128 * 128
    parts = [_pack6(c[:, :whole].reshape(n, -1, 128)[..., _order(group, codes.device)], 128)] if k >= 128 else []
    if k % 128:
        parts.append(_pack6(c[:, whole:].reshape(n, 1, 64), 64))
    return torch.cat(parts, dim=-1).contiguous()


def pack_low(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """(N, K) codes, K a multiple of 128, groups of 16 -> kind q2's bytes (bits 2: codes 0..3,
    N x K/4) or q3's (bits 3: codes -4..3, c = code + 4, N x K/128*48). Each 128 values in
    pack6's order for groups of 16 (`_order`): 32 bytes of two-bit fields as pack6 lays out its
    top bits (byte j, bits 2i and 2i + 1: the value at place j + 32 i), then for q3 16 bytes of
    third bits (bit m, little-endian: the value at place m). qmatmul.c's expand_low reads both."""
    n, k = codes.shape
    c = (codes.to(torch.int16) + (4 if bits == 3 else 0)).to(torch.uint8).reshape(n, k // 128, 128)
    c = c[..., _order(16, codes.device)]
    parts = [_fields(c & 3)]
    if bits == 3:
        third = ((c >> 2) & 1).reshape(n, k // 128, 16, 8)
        parts.append((third << torch.arange(8, dtype=torch.uint8, device=codes.device)).sum(-1, dtype=torch.uint8))
    return torch.cat(parts, dim=-1).reshape(n, -1).contiguous()


def unpack_low(packed: torch.Tensor, k: int, bits: int) -> torch.Tensor:
    """pack_low's inverse: -> (N, K) int32 codes."""
    n = packed.shape[0]
    b = packed.reshape(n, k // 128, 32 if bits == 2 else 48).to(torch.int32)
    stored = _unfields(b[..., :32])  # (n, blocks, 128) in order
    if bits == 3:
        third = (b[..., 32:, None] >> torch.arange(8, device=packed.device)) & 1  # (n, blocks, 16, 8)
        stored = stored + 4 * third.reshape(n, -1, 128) - 4
    out = torch.empty_like(stored).index_copy_(2, _order(16, packed.device), stored)
    return out.reshape(n, k)


def _order(group: int, device: torch.device) -> torch.Tensor:
    """A whole 128's values in the order pack6 stores them: lo(0..63), then hi(0..63), on `device`."""
    if group != 16:
        return torch.arange(128, device=device)
    j = torch.arange(64, device=device)
    lo = 16 * (j // 8) + j % 8
    return torch.cat([lo, lo + 8])


def _pack6(c: torch.Tensor, width: int) -> torch.Tensor:
    """(N, blocks, width) values 0..63 -> (N, blocks * width * 3 / 4) bytes, as pack6 lays them."""
    n, blocks, _ = c.shape
    low, top = c & 15, c >> 4
    nibbles = low[..., : width // 2] | (low[..., width // 2 :] << 4)
    return torch.cat([nibbles, _fields(top)], dim=-1).reshape(n, -1)


def _fields(v: torch.Tensor) -> torch.Tensor:
    """(..., width) values 0..3 -> (..., width / 4) bytes: byte j, bits 2i and 2i + 1, holding
    value j + width/4 i (pack6's top bits, pack_low's codes)."""
    t = v.reshape(*v.shape[:-1], 4, v.shape[-1] // 4)
    return t[..., 0, :] | (t[..., 1, :] << 2) | (t[..., 2, :] << 4) | (t[..., 3, :] << 6)


def _unfields(b: torch.Tensor) -> torch.Tensor:
    """_fields' inverse on int32 bytes: (..., m) -> (..., 4m) values."""
    return torch.cat([(b >> (2 * i)) & 3 for i in range(4)], dim=-1)


def unpack6(packed: torch.Tensor, k: int, group: int = 32) -> torch.Tensor:
    """pack6's inverse: (N, K / 64 * 48) bytes -> (N, K) int32 codes in -32..31."""
    n = packed.shape[0]
    whole = k // 128 * 96
    parts = []
    if k >= 128:
        stored = _unpack6(packed[:, :whole], 128).reshape(n, -1, 128)
        parts.append(torch.empty_like(stored).index_copy_(2, _order(group, packed.device), stored).reshape(n, -1))
    if k % 128:
        parts.append(_unpack6(packed[:, whole:], 64))
    return torch.cat(parts, dim=-1).reshape(n, k) - 32


def _unpack6(b: torch.Tensor, width: int) -> torch.Tensor:
    n = b.shape[0]
    b = b.reshape(n, -1, width * 3 // 4).to(torch.int32)
    half = width // 2
    low = torch.cat([b[..., :half] & 15, b[..., :half] >> 4], dim=-1)  # (n, blocks, width)
    top = _unfields(b[..., half:])  # value j + width/4 i at that index
    return (low | (top << 4)).reshape(n, -1)


def from_factors(codes: torch.Tensor, d: torch.Tensor, mult: torch.Tensor, dmin: torch.Tensor | None,
                 mmult: torch.Tensor | None, group: int, bits: int) -> QuantWeight:
    """codes (N, K) of `bits` bits with scales d * mult (and minimums dmin * mmult) as K-quants
    store them: d, dmin (N, K/group/8) fp16 values, one per 8 groups; mult, mmult (N, K/group)
    whole numbers in -128..127. Kept in that form (10 bytes per 8 groups); the kernel multiplies
    them out in fp32, exactly (an fp16 times an 8-bit integer), so the values multiplied are
    from_codes(codes, d * mult, dmin * mmult)'s."""
    n, k = codes.shape
    if k % (8 * group):
        raise ValueError(f"{k} columns are not a whole number of blocks of 8 groups of {group}")
    kind, packed = _packed_codes(codes, group, bits, dmin is not None)
    mins = _k_params(dmin, mmult) if dmin is not None and mmult is not None else None
    return QuantWeight(kind, packed, _k_params(d, mult), mins, group, n, k)


def _k_params(d: torch.Tensor, mult: torch.Tensor) -> torch.Tensor:
    n, blocks = d.shape
    out = torch.empty(n, blocks, 10, dtype=torch.uint8)
    out[..., :2] = d.to(torch.float16).contiguous().view(torch.uint8).reshape(n, blocks, 2)
    out[..., 2:] = mult.to(torch.int8).reshape(n, blocks, 8).view(torch.uint8)
    return out.reshape(n, blocks * 10)


def params_fp32(t: torch.Tensor, groups: int) -> torch.Tensor:
    """Scales or minimums (rows, ...) in any of the kept forms -> (rows, groups) fp32 values."""
    if t.dtype != torch.uint8:
        return t.float()
    blocks = t.reshape(t.shape[0], groups // 8, 10)
    d = blocks[..., :2].contiguous().view(torch.float16).float()  # (rows, blocks, 1)
    return (d * blocks[..., 2:].contiguous().view(torch.int8).float()).reshape(t.shape[0], groups)


def _exact_half(t: torch.Tensor) -> bool:
    """Whether every value of `t` is an fp16 value (GGUF's Q4_0/Q4_1/Q5_0/Q5_1/Q8_0 scales and
    minimums are; K-quants' scale products are not)."""
    return bool(torch.equal(t.half().float(), t))


def from_dense(weight: torch.Tensor, kind: Kind, group: int = 32) -> QuantWeight:
    """Quantise a float weight group-wise: "q8" symmetric (codes -127..127), "q4" with a
    minimum (codes 0..15), round to nearest."""
    w = weight.detach().float().reshape(weight.shape[0], -1, group)
    if kind == "q8":
        scale = w.abs().amax(-1) / 127
        codes = torch.where(scale[..., None] > 0, w / scale[..., None], torch.zeros_like(w)).round().clamp(-127, 127)
        return from_codes(codes.reshape(weight.shape).to(torch.int8), scale, None, group, 8)
    lo, hi = w.amin(-1), w.amax(-1)
    scale = (hi - lo) / 15
    codes = torch.where(scale[..., None] > 0, (w - lo[..., None]) / scale[..., None], torch.zeros_like(w))
    return from_codes(codes.round().clamp(0, 15).reshape(weight.shape), scale, lo, 32, 4)


def codes_of(w: QuantWeight) -> torch.Tensor:
    """(N, K) codes as ints (a table's weight: the values its codes index)."""
    if w.table is not None:
        return _table_values(_nibbles(w.codes), w.table).reshape(w.out_features, w.in_features)
    if w.kind == "q8":
        return w.codes.to(torch.int32)
    if w.kind == "q6":
        return unpack6(w.codes, w.in_features, w.group)
    if w.kind in ("q2", "q3"):
        return unpack_low(w.codes, w.in_features, KIND_CODES[w.kind])
    return _nibbles(w.codes).reshape(w.out_features, w.in_features).to(torch.int32)


def _nibbles(codes: torch.Tensor) -> torch.Tensor:
    """q4-packed bytes (rows, K/2) -> (rows, K/32, 2, 16) nibbles: each group's low, then high ones."""
    p = codes.reshape(codes.shape[0], -1, 16)
    return torch.stack([p & 15, p >> 4], dim=2)


def _table_values(codes: torch.Tensor, table: Table) -> torch.Tensor:
    """Nibble codes -> the table values they index (int32)."""
    return torch.tensor(TABLES[table][0], dtype=torch.int32, device=codes.device)[codes.long()]


def dequantize(w: QuantWeight) -> torch.Tensor:
    """(N, K) fp32 values: scale * code + minimum, in fp32 (the values the kernel multiplies by)."""
    groups = w.in_features // w.group
    scales = params_fp32(w.scales, groups)
    v = codes_of(w).float().reshape(w.out_features, -1, w.group) * scales[..., None]
    mins = _mins_fp32(w.mins, scales, w.offset, groups)
    if mins is not None:
        v = v + mins[..., None]
    return v.reshape(w.out_features, w.in_features)


def _mins_fp32(mins: torch.Tensor | None, scales: torch.Tensor, offset: int, groups: int) -> torch.Tensor | None:
    """The minimums in fp32: stored, or -offset * scale (exact in fp32), or None."""
    if mins is not None:
        return params_fp32(mins, groups)
    return -float(offset) * scales if offset else None


def dequantize_rows(w: QuantWeight, rows: torch.Tensor) -> torch.Tensor:
    """(len(rows), K) fp32: rows `rows` of dequantize(w), reading only those rows (a look-up in
    an embedding table kept packed)."""
    rows = rows.reshape(-1).to(torch.long)
    codes = w.codes[rows]
    if w.table is not None:
        codes = _table_values(_nibbles(codes), w.table)
    elif w.kind == "q4":
        codes = _nibbles(codes)
    elif w.kind == "q6":
        codes = unpack6(codes, w.in_features, w.group)
    elif w.kind in ("q2", "q3"):
        codes = unpack_low(codes, w.in_features, KIND_CODES[w.kind])
    groups = w.in_features // w.group
    scales = params_fp32(w.scales[rows], groups)
    v = codes.reshape(len(rows), -1, w.group).float() * scales[..., None]
    mins = _mins_fp32(w.mins[rows] if w.mins is not None else None, scales, w.offset, groups)
    if mins is not None:
        v = v + mins[..., None]
    return v.reshape(len(rows), w.in_features)


def qlinear(x: torch.Tensor, w: QuantWeight, bias: torch.Tensor | None = None,
            threads: int | None = None) -> torch.Tensor:
    """x (..., K) -> (..., N) fp32: x @ dequantize(w).T (+ bias), by the kernel; by that dense
    product when no kernel could be built. A decode step makes ~200 of these calls, so the
    Python around the call is kept to a few operations (the weight's own arguments are built
    once, in `QuantWeight.args`)."""
    lib = kernels()
    if lib is None:
        y = x.float() @ dequantize(w).T
        return y + bias if bias is not None else y
    if x.dtype is torch.float32 and x.is_contiguous():
        x2 = x.view(-1, w.in_features)
    else:
        x2 = x.reshape(-1, w.in_features).float().contiguous()
    m = x2.shape[0]
    y = x2.new_empty((m, w.out_features))
    if m:
        kind, codes, scales, mins = w.args
        rc = lib.qm_matmul(kind, x2.data_ptr(), m, w.in_features, codes, scales, mins, w.out_features, w.group,
                           y.data_ptr(), threads or governor().threads())
        if rc != 0:
            raise torch.OutOfMemoryError("The packed CPU kernel could not allocate its scratch memory.")
    if bias is not None:
        y += bias
    return y if x.dim() == 2 else y.view(*x.shape[:-1], w.out_features)


class QmLinear(ctypes.Structure):
    """qmatmul.c's qm_linear: a QuantWeight (and bias) as the C calls that take whole layers read it."""

    _fields_ = [("codes", ctypes.c_void_p), ("scales", ctypes.c_void_p), ("mins", ctypes.c_void_p),
                ("bias", ctypes.c_void_p), ("kind", ctypes.c_int64), ("n", ctypes.c_int64), ("k", ctypes.c_int64),
                ("group", ctypes.c_int64)]

    def point_at(self, w: QuantWeight, bias: torch.Tensor | None = None) -> None:
        """Point at `w` and `bias` (the caller keeps them alive as long as this is used)."""
        kind, codes, scales, mins = w.args
        self.codes, self.scales, self.mins = codes, scales, mins
        self.bias = bias.data_ptr() if bias is not None else None
        self.kind, self.n, self.k, self.group = kind, w.out_features, w.in_features, w.group


class QmGate(ctypes.Structure):
    """qmatmul.c's qm_gate for qm_experts_one: gpt-oss's gate and biases, or (gelu) Gemma 4's GELU."""

    _fields_ = [("gate_up_bias", ctypes.c_void_p), ("down_bias", ctypes.c_void_p), ("alpha", ctypes.c_float),
                ("limit", ctypes.c_float), ("interleaved", ctypes.c_int), ("gelu", ctypes.c_int)]


class PackedLinear(nn.Module):
    """An inference Linear over a QuantWeight (fp32 in, fp32 out)."""

    def __init__(self, weight: QuantWeight, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.qweight = weight
        self.in_features = weight.in_features
        self.out_features = weight.out_features
        self.bias = nn.Parameter(bias.float(), requires_grad=False) if bias is not None else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return qlinear(x, self.qweight, self.bias).to(x.dtype)

    def extra_repr(self) -> str:
        w = self.qweight
        return f"in_features={w.in_features}, out_features={w.out_features}, {w.kind}, group={w.group}"
