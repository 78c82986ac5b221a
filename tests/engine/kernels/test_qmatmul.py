"""The packed CPU kernel (engine/kernels): built with the machine's C compiler, it multiplies by
group-quantised weights as a dense product by their values does (fp32 rounding apart), at
every row count, shape, kind and thread count; a machine where it cannot be built (no
compiler, a compile error, a damaged cached library, switched off) gets None and the dense
path, never an exception."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from engine.kernels import build
from engine.kernels.linear import PackedLinear, dequantize, from_codes, from_dense, qlinear


@pytest.fixture(scope="module")
def lib() -> object:
    found = build.kernels()
    if found is None:
        pytest.skip("no C compiler here")
    return found


def close(got: torch.Tensor, want: torch.Tensor) -> bool:
    return bool((got - want).abs().max() <= 1e-5 * want.abs().max() + 1e-6)


@pytest.mark.parametrize("kind,group,mins,half", [("q8", 32, False, False), ("q8", 16, False, True),
                                                  ("q8", 32, True, True), ("q4", 32, True, False),
                                                  ("q4", 32, True, True), ("q6", 16, False, False),
                                                  ("q6", 32, True, True), ("q2", 16, True, False),
                                                  ("q3", 16, False, True)])
def test_products_equal_the_dense_product_of_the_values(lib: object, kind: str, group: int, mins: bool,
                                                        half: bool) -> None:
    """half: scales and minimums that are all fp16 values (as GGUF's Q4_1/Q8_0 store them) are
    kept and read as fp16; others as fp32."""
    g = torch.Generator().manual_seed(0)
    for n, k in ((1, 32), (7, 96), (64, 576), (13, 1536)):
        if kind == "q6" and k % 64 or kind in ("q2", "q3") and k % 128:
            continue  # six-bit codes take whole chunks of 64, two- and three-bit ones 128 (else q8 or q6 holds them)
        if kind == "q4" and not half:
            w = from_dense(torch.randn(n, k, generator=g), "q4")
        else:
            lo, hi = {"q6": (-32, 32), "q3": (-4, 4), "q2": (0, 4)}.get(kind, (-128, 128) if not mins else (0, 32 if kind != "q4" else 16))
            codes = torch.randint(lo, hi, (n, k), generator=g, dtype=torch.int8)
            scales = torch.rand(n, k // group, generator=g) * 0.1
            lows = torch.randn(n, k // group, generator=g) * 0.1 if mins else None
            if half:
                scales[0, 0] = 6e-8  # an fp16 subnormal (the plain C build converts it by hand)
                scales, lows = scales.half().float(), lows.half().float() if lows is not None else None
            w = from_codes(codes, scales, lows, group, {"q4": 4, "q6": 6, "q8": 8, "q2": 2, "q3": 3}[kind])
        assert w.kind == kind
        assert (w.scales.dtype == torch.float16) == half
        ref_w = dequantize(w)
        bias = torch.randn(n, generator=g)
        # 1-4 tokens: the integer rows (VNNI CPUs); 5+ the panels (AVX-512; else the fp32 tiles): a
        # block of 8 lanes, one vector of 16 tokens, two, three, and blocks of 48 with a last one
        # of 8 lanes or more
        for m in (1, 2, 3, 4, 5, 8, 16, 33, 53, 64, 113):
            x = torch.randn(m, k, generator=g)
            assert close(qlinear(x, w), x @ ref_w.T), (n, k, m)
            assert close(qlinear(x, w, bias), x @ ref_w.T + bias), (n, k, m)
        x3 = torch.randn(2, 3, k, generator=g)
        assert close(qlinear(x3, w), x3 @ ref_w.T)
        for m in (4, 40):
            x = torch.randn(m, k, generator=g)
            assert torch.equal(qlinear(x, w, threads=1), qlinear(x, w, threads=2))


@pytest.mark.parametrize("kind,group", [("q4", 32), ("q8", 32), ("q8", 16)])
def test_activations_of_any_size_keep_their_precision(lib: object, kind: str, group: int) -> None:
    """A VNNI CPU carries a step's activations as 22-bit integers with one power of two a block of
    32 (qm_digits.h): blocks of zeros, of tiny and of huge values, and blocks whose values span
    many powers of ten, each stay within a few 1e-7 of the sum of the terms' sizes (fp32: ~1e-7),
    and an infinite or NaN activation still gives a non-finite output, as fp32 does."""
    g = torch.Generator().manual_seed(3)
    k = 256
    w = from_dense(torch.randn(48, k, generator=g), kind, group)
    dense = dequantize(w).double()
    x = torch.randn(1, k, generator=g)
    x[0, :32] = 0.0
    x[0, 32:64] *= 1e-30
    x[0, 64:96] *= 1e30
    x[0, 96:128] = 10.0 ** torch.linspace(-8, 3, 32)
    for part in (slice(0, 64), slice(0, 128), slice(64, 128)):  # with and without the 1e30 block dominating
        y = x.clone()
        y[0, part.stop:] = torch.randn(1, k - part.stop, generator=g)
        want = y.double() @ dense.T
        size = y.double().abs() @ dense.abs().T
        assert ((qlinear(y, w).double() - want).abs() / size).max() < 2e-6
    for bad in (float("inf"), float("nan")):
        y = x.clone()
        y[0, 200] = bad
        assert not qlinear(y, w).isfinite().any()


@pytest.mark.parametrize("kind,group", [("q4", 32), ("q8", 32), ("q8", 16)])
def test_a_few_rows_give_each_rows_own_bits(lib: object, kind: str, group: int) -> None:
    """On a CPU with integer rows, 2-4 rows of x (an MoE expert's share of a tree pass) go through
    the rows a single row takes, each weight row read once for all: every output row has the
    bits that row alone gets, so a tree's rows equal a decode step's."""
    if lib.qm_simd() not in (4, 5):  # type: ignore[attr-defined]
        pytest.skip("no integer rows on this CPU")
    g = torch.Generator().manual_seed(5)
    w = from_dense(torch.randn(100, 576, generator=g), kind, group)  # type: ignore[arg-type]
    for m in (2, 3, 4):
        x = torch.randn(m, 576, generator=g)
        y = qlinear(x, w)
        assert all(torch.equal(y[i], qlinear(x[i : i + 1], w)[0]) for i in range(m)), m


def test_q4_0_is_held_at_its_files_bytes(lib: object) -> None:
    """GGUF's Q4_0 (4-bit codes, minimum -8 scale) keeps no minimums: the codes offset by 8
    (QuantWeight.offset), 0.5625 bytes a weight with fp16 scales. Products equal the dense
    product of its values through the integer rows (1-4 tokens), the fp32 tiles (5+), a row
    length that is no multiple of 64 (the fp32 rows) and the 64-value tail of the 128-code rows."""
    g = torch.Generator().manual_seed(11)
    for n, k in ((7, 96), (64, 576), (13, 1536)):
        codes = torch.randint(0, 16, (n, k), generator=g, dtype=torch.int8)
        scales = (torch.rand(n, k // 32, generator=g) * 0.1).half().float()
        w = from_codes(codes, scales, -8 * scales, 32, 4)
        assert w.kind == "q4" and w.offset == 8 and w.mins is None
        assert w.nbytes == n * k // 2 + n * k // 32 * 2
        ref_w = (codes.float().reshape(n, -1, 32) - 8) * scales[..., None]
        assert torch.equal(dequantize(w), ref_w.reshape(n, k))
        for m in (1, 2, 3, 4, 5, 16):
            x = torch.randn(m, k, generator=g)
            assert close(qlinear(x, w), x @ ref_w.reshape(n, k).T), (n, k, m)
        x = torch.randn(4, k, generator=g)
        assert torch.equal(qlinear(x, w, threads=1), qlinear(x, w, threads=2))
    other = from_codes(codes, scales, -7 * scales, 32, 4)  # any other minimum is kept
    assert other.offset == 0 and other.mins is not None


def test_six_bit_codes_round_trip_through_their_packing() -> None:
    """pack6 lays whole 128s (in an order of their own for groups of 16) and a last 64 differently
    (linear.pack6); unpack6 reads them all back, and the bytes are three quarters of a byte a code
    either way."""
    from engine.kernels.linear import pack6, unpack6

    g = torch.Generator().manual_seed(7)
    for group in (16, 32):
        for k in (64, 128, 192, 576, 1024):
            codes = torch.randint(-32, 32, (3, k), generator=g, dtype=torch.int8)
            packed = pack6(codes, group)
            assert packed.shape == (3, k // 64 * 48)
            assert torch.equal(unpack6(packed, k, group), codes.int()), (group, k)
    assert not torch.equal(pack6(codes, 16), pack6(codes, 32))


def test_two_and_three_bit_codes_round_trip_through_their_packing() -> None:
    """pack_low keeps a quarter of a byte a code (q2, 0..3) or three eighths (q3, -4..3), whole
    128s; unpack_low reads them back."""
    from engine.kernels.linear import pack_low, unpack_low

    g = torch.Generator().manual_seed(8)
    for bits, lo, hi in ((2, 0, 4), (3, -4, 4)):
        for k in (128, 256, 1536):
            codes = torch.randint(lo, hi, (3, k), generator=g, dtype=torch.int8)
            packed = pack_low(codes, bits)
            assert packed.dtype == torch.uint8 and packed.shape == (3, k // 128 * (32 if bits == 2 else 48))
            assert torch.equal(unpack_low(packed, k, bits), codes.int()), (bits, k)


def test_four_bit_codes_pack_as_gguf_blocks_hold_them(lib: object) -> None:
    codes = torch.arange(32).remainder(16).reshape(1, 32)
    w = from_codes(codes, torch.ones(1, 1), torch.zeros(1, 1), 32, 4)
    assert w.kind == "q4" and w.codes.shape == (1, 16)
    assert w.codes[0, 0] == codes[0, 0] | (codes[0, 16] << 4)  # byte k: value k low, value k + 16 high
    assert torch.equal(dequantize(w), codes.float())


def test_packed_linear_is_a_drop_in_linear(lib: object) -> None:
    dense = torch.nn.Linear(64, 24)
    w = from_dense(dense.weight.data, "q8")
    packed = PackedLinear(w, dense.bias.data)
    x = torch.randn(5, 64)
    with torch.inference_mode():
        assert close(packed(x), x @ dequantize(w).T + dense.bias.data)
        assert (packed(x) - dense(x)).abs().max() < 0.05
    assert packed.out_features == 24 and packed.in_features == 64


@pytest.fixture
def fresh_build(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A new cache folder and no library loaded yet in this process (restored afterwards)."""
    monkeypatch.setenv("SPECCHAT_CACHE_DIR", str(tmp_path))
    build.reset()
    yield tmp_path
    build.reset()


def test_no_compiler_means_no_kernel_and_no_exception(fresh_build: Path, monkeypatch: pytest.MonkeyPatch,
                                                      caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv("CC", str(fresh_build / "no-such-compiler"))
    with caplog.at_level(logging.INFO, logger="engine.kernels.build"):
        assert build.kernels() is None
    assert "no C compiler" in caplog.text
    w = from_dense(torch.randn(8, 64), "q4")
    x = torch.randn(3, 64)
    assert close(qlinear(x, w), x @ dequantize(w).T)  # the dense path


def test_a_compiler_that_fails_means_no_kernel(fresh_build: Path, monkeypatch: pytest.MonkeyPatch,
                                               caplog: pytest.LogCaptureFixture) -> None:
    fake = fresh_build / "cc"
    fake.write_text("#!/bin/sh\necho 'fatal error: this compiler builds nothing' >&2\nexit 1\n")
    fake.chmod(0o755)
    monkeypatch.setenv("CC", str(fake))
    with caplog.at_level(logging.INFO, logger="engine.kernels.build"):
        assert build.kernels() is None
    assert "could not be built" in caplog.text and "builds nothing" in caplog.text


def test_switched_off(fresh_build: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPECCHAT_NO_KERNELS", "1")
    assert build.kernels() is None


def test_a_damaged_cached_library_is_built_again(lib: object, fresh_build: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    assert build.kernels() is not None  # built into one fresh cache
    built = list((fresh_build / "kernels").glob("*/libqmatmul.so"))
    assert len(built) == 1
    # the same library, damaged, in another cache (a path this process has not loaded)
    other = fresh_build / "other"
    damaged = other / "kernels" / built[0].parent.name / "libqmatmul.so"
    damaged.parent.mkdir(parents=True)
    damaged.write_bytes(b"not a shared library")
    monkeypatch.setenv("SPECCHAT_CACHE_DIR", str(other))
    build.reset()
    assert build.kernels() is not None
    assert damaged.read_bytes()[:4] == b"\x7fELF"
