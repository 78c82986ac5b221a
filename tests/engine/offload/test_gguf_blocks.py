"""The torch de-quantisation of GGUF blocks equals gguf-py's reference decoder bit for bit, for
every type the store keeps packed: on random blocks (every code pattern) with sane fp16 scales,
and on real quantised data where gguf-py can quantise the type."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf import quants as gq

from engine.kernels.linear import dequantize as linear_dequantize
from engine.kernels.linear import from_nibbles, qlinear
from engine.offload.gguf_blocks import (
    AFFINE,
    AFFINE_BITS,
    PACKED,
    affine,
    block_size,
    dequantize,
    dequantize_into,
    table_nibbles,
)

# byte offsets of each type's fp16 scale fields (ggml's block structs)
SCALES = {Q.Q4_0: (0,), Q.Q4_1: (0, 2), Q.Q5_0: (0,), Q.Q5_1: (0, 2), Q.Q8_0: (0,), Q.Q2_K: (80, 82),
          Q.Q3_K: (108,), Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,), Q.IQ4_NL: (0,), Q.IQ4_XS: (0,),
          Q.MXFP4: ()}  # MXFP4's scale is one byte, a power of two (random_blocks: 2^-28..2^12)
QUANTISABLE = (Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.MXFP4)


def random_blocks(qtype: Q, n: int, seed: int = 0) -> np.ndarray:
    """n random blocks whose fp16 scales are finite and of either sign, magnitude 1e-4..1."""
    rng = np.random.default_rng(seed)
    _, nbytes = block_size(qtype)
    blocks = rng.integers(0, 256, size=(n, nbytes), dtype=np.uint8)
    for at in SCALES[qtype]:
        scale = (rng.uniform(1e-4, 1.0, n) * rng.choice([-1, 1], n)).astype(np.float16)
        blocks[:, at:at + 2] = scale.view(np.uint8).reshape(n, 2)
    if qtype == Q.MXFP4:
        blocks[:, 0] = rng.integers(100, 141, n)  # finite values: 12 * 2^(e - 128)
    return blocks


def test_every_packed_type_is_covered() -> None:
    assert set(SCALES) == set(PACKED)


@pytest.mark.parametrize("qtype", PACKED, ids=lambda t: t.name)
def test_random_blocks_equal_gguf_py_bit_for_bit(qtype: Q) -> None:
    blocks = random_blocks(qtype, 512)
    ref = gq.dequantize(blocks, qtype).reshape(-1)  # (n * values,) fp32
    ours = dequantize(torch.from_numpy(blocks).reshape(-1), qtype).numpy()
    assert ours.dtype == np.float32 and ours.shape == ref.shape
    assert np.array_equal(ours.view(np.uint32), ref.view(np.uint32))


@pytest.mark.parametrize("qtype", QUANTISABLE, ids=lambda t: t.name)
def test_quantised_weights_equal_gguf_py_bit_for_bit(qtype: Q) -> None:
    w = (np.random.default_rng(1).standard_normal((48, 256)) * 0.05).astype(np.float32)
    stored = gq.quantize(w, qtype)
    ref = gq.dequantize(stored, qtype)
    ours = dequantize(torch.from_numpy(stored).reshape(-1), qtype).reshape(ref.shape).numpy()
    assert np.array_equal(ours.view(np.uint32), ref.view(np.uint32))


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q8_0, Q.F16], ids=lambda t: t.name)
def test_dequantize_into_fills_rows_in_chunks_and_reorders_them(qtype: Q) -> None:

    rows, cols = 37, 512
    if qtype == Q.F16:
        stored = np.random.default_rng(2).standard_normal((rows, cols)).astype(np.float16).view(np.uint8)
    else:
        values, nbytes = block_size(qtype)
        stored = random_blocks(qtype, rows * cols // values).reshape(rows, -1)
    ref = gq.dequantize(stored, qtype).reshape(rows, cols)
    order = torch.randperm(rows, generator=torch.Generator().manual_seed(0))
    out = torch.empty(rows, cols, dtype=torch.bfloat16)
    dequantize_into(torch.from_numpy(stored).reshape(-1), qtype, out, order, chunk_values=5 * cols)  # several chunks
    assert torch.equal(out, torch.from_numpy(ref)[order].to(torch.bfloat16))


@pytest.mark.parametrize("qtype", AFFINE, ids=lambda t: t.name)
def test_codes_scales_and_minimums_give_the_decoded_values_bit_for_bit(qtype: Q) -> None:
    blocks = torch.from_numpy(random_blocks(qtype, 256, seed=3))
    codes, scales, mins, group = affine(blocks, qtype)
    values, _ = block_size(qtype)
    assert codes.dtype == torch.int8 and codes.shape == (256, values) and scales.shape == (256, values // group)
    if qtype == Q.MXFP4:  # E2M1's values doubled (the kernel keeps the nibbles that index them)
        assert int(codes.min()) >= -12 and int(codes.max()) <= 12
    else:
        bits = AFFINE_BITS[qtype]
        assert int(codes.min()) >= (-(1 << (bits - 1)) if mins is None else 0)
        assert int(codes.max()) < (1 << (bits - 1) if mins is None else 1 << bits)
    w = codes.float().reshape(256, -1, group) * scales[..., None]
    if mins is not None:
        w = w + mins[..., None]
    assert torch.equal(w.reshape(-1), dequantize(blocks.reshape(-1), qtype))


@pytest.mark.parametrize("qtype", [Q.MXFP4, Q.IQ4_NL, Q.IQ4_XS], ids=lambda q: q.name)
def test_nibbles_of_a_table_are_the_kernels_codes_bit_for_bit(qtype: Q) -> None:
    """MXFP4 and IQ4 blocks kept as their own nibbles (codes that index E2M1's or IQ4's values)
    and their scales (IQ4_XS's factored as the file holds them): the kernel's weight
    de-quantises to ggml's values bit for bit, and its product is theirs."""
    values, _ = block_size(qtype)
    per_row = 256 // values  # 256 values a row
    blocks = torch.from_numpy(random_blocks(qtype, 8 * per_row, seed=5))
    want = dequantize(blocks.reshape(-1), qtype).reshape(8, 256)
    for rows in (8, 3):
        nibbles, scales, d, mult = table_nibbles(blocks[: rows * per_row], qtype)
        w = from_nibbles(nibbles.reshape(rows, 128), "e2m1" if qtype == Q.MXFP4 else "iq4",
                         scales.reshape(rows, -1) if scales is not None else None,
                         d.reshape(rows, -1) if d is not None else None, mult.reshape(rows, -1) if mult is not None else None)
        assert (w.kind, w.codes.dtype, w.codes.shape) == ("q4" if qtype == Q.MXFP4 else "q8", torch.uint8, (rows, 128))
        assert torch.equal(linear_dequantize(w), want[:rows])
        for m in (1, 3, 9):
            x = torch.randn(m, 256)
            assert torch.allclose(qlinear(x, w), x @ want[:rows].T, rtol=1e-5, atol=1e-5 * float(want.abs().max()))


@pytest.mark.parametrize("chunk", [1, 1 << 22])
def test_a_part_of_fused_experts_fills_its_rows_of_every_matrix(chunk: int) -> None:
    """Gate experts (E, R, C) de-quantise into rows [0, R) of each expert of a fused (E, 2R, C)
    parameter, up experts into [R, 2R): a strided slice, filled whole matrices at a time."""
    experts, rows, cols = 3, 4, 64
    blocks = random_blocks(Q.Q8_0, experts * rows * cols // 32, seed=3)
    want = torch.from_numpy(gq.dequantize(blocks, Q.Q8_0).reshape(experts, rows, cols))
    fused = torch.full((experts, 2 * rows, cols), 7.0)
    dequantize_into(torch.from_numpy(blocks).reshape(-1), Q.Q8_0, fused.narrow(1, rows, rows), chunk_values=chunk)
    assert torch.equal(fused[:, rows:], want) and bool((fused[:, :rows] == 7.0).all())
