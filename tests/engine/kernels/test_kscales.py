"""K-quant scales kept as the file factors them (QM_KSC: per 8 groups an fp16 factor and 8 int8
multipliers, linear.from_factors): the kernel multiplies them out in fp32 exactly, so every
product has the bits of the same weight with its scales stored as fp32 values, in every build
of the kernel this machine can run (its native one, AVX2 + FMA, AVX-512 without the integer
rows, plain C), at every row count (decode step, a few rows, tiles); and the weights take the
file's bytes, not 0.75 (Q4_K) or 1.25 (Q6_K) a weight."""

from __future__ import annotations

import ctypes
from pathlib import Path

import pytest
import torch

from engine.kernels import build
from engine.kernels.linear import QuantWeight, dequantize, from_codes, from_factors
from engine.offload import gguf_blocks
from engine.loading.cpu_packed import quant_weight

VARIANTS = {"native": build.FLAG_SETS[0], "avx512, no integer rows": (*build.FLAG_SETS[0], "-DQM_NO_VNNI"),
            "avx2": build.FLAG_SETS[1], "plain C": build.FLAG_SETS[2]}


@pytest.fixture(scope="module", params=list(VARIANTS))
def lib(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> ctypes.CDLL:
    cc = build.compiler()
    if cc is None:
        pytest.skip("no C compiler here")
    target = tmp_path_factory.mktemp("kernel") / "libqmatmul.so"
    error = build._compile(cc, VARIANTS[request.param], target)
    if error:
        pytest.skip(f"this compiler cannot build the {request.param} kernel: {error}")
    loaded = build._load(target)
    assert loaded is not None
    return loaded


def matmul(lib: ctypes.CDLL, w: QuantWeight, x: torch.Tensor) -> torch.Tensor:
    x = x.float().contiguous()
    y = torch.empty(x.shape[0], w.out_features)
    kind, codes, scales, mins = w.args
    assert lib.qm_matmul(kind, x.data_ptr(), x.shape[0], w.in_features, codes, scales, mins, w.out_features,
                         w.group, y.data_ptr(), 2) == 0
    return y


def weights(kind: str, n: int = 40, k: int = 512, seed: int = 0) -> tuple[QuantWeight, QuantWeight]:
    """A weight of K-quant factors (Q4_K: q4 codes with minimums; Q5_K: 5-bit codes in q6;
    Q6_K: signed 6-bit codes in q6, groups of 16, no minimums; Q3_K: signed 3-bit codes in q3,
    groups of 16; Q2_K: 2-bit codes with minimums in q2, groups of 16) and the same values with
    scale products in fp32."""
    g = torch.Generator().manual_seed(seed)
    group = 16 if kind in ("Q6_K", "Q3_K", "Q2_K") else 32
    groups = k // group
    d = (torch.rand(n, groups // 8, generator=g) * 0.01).half().float()
    if kind in ("Q6_K", "Q3_K"):
        codes = torch.randint(-32, 32, (n, k), generator=g) if kind == "Q6_K" else torch.randint(-4, 4, (n, k), generator=g)
        mult = torch.randint(-128, 128, (n, groups), generator=g)
        dmin = mmult = None
    elif kind == "Q2_K":
        codes = torch.randint(0, 4, (n, k), generator=g)
        mult = torch.randint(0, 16, (n, groups), generator=g)
        dmin = -(torch.rand(n, groups // 8, generator=g) * 0.01).half().float()
        mmult = torch.randint(0, 16, (n, groups), generator=g)
    else:
        codes = torch.randint(0, 16 if kind == "Q4_K" else 32, (n, k), generator=g)
        mult = torch.randint(0, 64, (n, groups), generator=g)
        dmin = -(torch.rand(n, groups // 8, generator=g) * 0.01).half().float()
        mmult = torch.randint(0, 64, (n, groups), generator=g)
    bits = {"Q4_K": 4, "Q5_K": 5, "Q6_K": 6, "Q3_K": 3, "Q2_K": 2}[kind]
    factored = from_factors(codes, d, mult, dmin, mmult, group, bits)
    scales = d.repeat_interleave(8, dim=1) * mult.float()
    mins = dmin.repeat_interleave(8, dim=1) * mmult.float() if dmin is not None and mmult is not None else None
    return factored, from_codes(codes, scales, mins, group, bits)


@pytest.mark.parametrize("kind", ["Q4_K", "Q5_K", "Q6_K", "Q3_K", "Q2_K"])
def test_factored_scales_give_the_bits_of_their_products(lib: ctypes.CDLL, kind: str) -> None:
    factored, products = weights(kind)
    assert factored.scales.dtype == torch.uint8 and factored.kind == products.kind
    assert torch.equal(dequantize(factored), dequantize(products))
    dense = dequantize(products)
    g = torch.Generator().manual_seed(1)
    for m in (1, 2, 3, 4, 5, 8, 64):
        x = torch.randn(m, factored.in_features, generator=g)
        got = matmul(lib, factored, x)
        assert torch.equal(got, matmul(lib, products, x)), m
        assert (got - x @ dense.T).abs().max() <= 1e-5 * (x @ dense.T).abs().max()


def test_a_k_quant_file_tensor_is_held_at_the_files_bytes() -> None:
    """cpu_packed.quant_weight on K-quant blocks (the project's GGUF writer's random blocks):
    the values are gguf_blocks' de-quantisation bit for bit, held in the kernel's codes (half a
    byte for 4 bits, six bits for 5 and 6: kind q6) plus 10 bytes per 8 groups of scales (and
    minimums): Q6_K at 0.83 bytes a weight, its file's 0.82; Q3_K and Q2_K in three and two bits
    (kinds q3 and q2, groups of 16), IQ4_XS in its nibbles (q8 codes of its table's values)."""
    import numpy as np

    from engine.testing.gguf_write import Q, random_tensor

    rows, cols = 16, 512
    for qtype, held, kind in ((Q.Q4_K, 0.5 + 20 / 256, "q4"), (Q.Q5_K, 0.75 + 20 / 256, "q6"),
                              (Q.Q6_K, 0.75 + 10 / 128, "q6"), (Q.Q3_K, 0.375 + 10 / 128, "q3"),
                              (Q.Q2_K, 0.25 + 20 / 128, "q2"), (Q.IQ4_XS, 0.5 + 10 / 256, "q8")):
        stored = random_tensor(qtype, (rows, cols), np.random.default_rng(int(qtype)))
        blocks = torch.from_numpy(np.ascontiguousarray(stored).view(np.uint8).reshape(-1))
        w = quant_weight(blocks, int(qtype), (rows, cols), None)
        assert w.scales.dtype == torch.uint8 and w.kind == kind
        assert torch.equal(dequantize(w), gguf_blocks.dequantize(blocks, int(qtype)).reshape(rows, cols))
        assert w.nbytes == held * rows * cols, qtype


def test_factors_need_whole_blocks_of_eight_groups() -> None:
    with pytest.raises(ValueError, match="blocks of 8 groups"):
        from_factors(torch.zeros(2, 96, dtype=torch.int64), torch.ones(2, 1), torch.ones(2, 3), None, None, 32, 4)


def test_the_product_path_reads_factored_weights(tmp_path: Path) -> None:
    """The Python entry (qlinear, PackedLinear) takes the machine's kernel with the same bits."""
    from engine.kernels.linear import qlinear

    if build.kernels() is None:
        pytest.skip("no C compiler here")
    factored, products = weights("Q4_K", seed=3)
    x = torch.randn(3, factored.in_features)
    assert torch.equal(qlinear(x, factored), qlinear(x, products))
