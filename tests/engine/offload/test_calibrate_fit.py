"""The output-aware group fit of the self-draft's low-bit weights (engine.offload.lowbit's
importance weights and clip starts, engine.offload.calibrate's use of them), on random weights
whose input columns matter unequally, checked against recomputed errors."""

from __future__ import annotations

import pytest
import torch

from engine.offload import calibrate, lowbit


def _skewed(seed: int, rows: int = 256, cols: int = 256) -> tuple[torch.Tensor, torch.Tensor]:
    """Gaussian weights and per-column importances spread over ~3 orders of magnitude."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=g) * 0.02
    h = torch.exp(torch.randn(cols, generator=g) * 1.5)
    return w, h


def _weighted_error(w: torch.Tensor, wq: torch.Tensor, h: torch.Tensor) -> float:
    return float(((w - wq).square() * h).sum())


@pytest.mark.parametrize("bits", lowbit.BITS)
def test_weighted_fit_cuts_the_weighted_error(bits: int) -> None:
    """Weighing each column's squared error by its importance in the fit of (scale, offset) gives
    a lower importance-weighted error than the uniform fit (and the uniform fit a lower plain one)."""
    w, h = _skewed(bits)
    weighted = torch.empty_like(w)
    lowbit.dequantize_into(*lowbit.quantize(w, bits, 32, importance=h), bits, weighted)
    plain = lowbit.roundtrip(w, bits)
    assert _weighted_error(w, weighted, h) < 0.9 * _weighted_error(w, plain, h)
    assert float((w - plain).square().sum()) < float((w - weighted).square().sum())


def test_importance_follows_the_column_scales() -> None:
    """With column scales c the codes are those of w * c, so the importance of a scaled column is
    h_j / c_j^2: the weighted fit of (w, c, h) equals the weighted fit of w * c with h / c^2."""
    w, h = _skewed(7, cols=128)
    c = torch.exp(torch.randn(128, generator=torch.Generator().manual_seed(8)) * 0.5).half()
    scaled = lowbit.quantize(w, 3, 32, c, importance=h)
    direct = lowbit.quantize(w * c.float(), 3, 32, importance=h / c.float().square())
    for a, b in zip(scaled, direct):
        assert torch.equal(a, b)


@pytest.mark.parametrize("bits", lowbit.BITS)
def test_clip_starts_never_raise_a_groups_error(bits: int) -> None:
    """The fit keeps each group's best round of all its starts, the range's included: no group is
    worse than with the range's start alone, and on heavy-tailed weights some are better (in the
    float fit; stored, with (s, m) in bytes, the whole weight's error is lower too)."""
    g = torch.Generator().manual_seed(10 + bits)
    chi2 = torch.randn(3, 128, 256, generator=g).square().mean(dim=0)
    w = torch.randn(128, 256, generator=g) / chi2.sqrt() * 0.02  # Student's t, 3 d.o.f.: outliers set the range
    grid = lowbit.levels(bits, w.device)

    def group_errors(clips: tuple[float, ...]) -> torch.Tensor:
        q, s, m = lowbit.fit_groups(w.view(-1, 32), bits, grid, clips=clips)
        value = q.float() if grid is None else grid[q.long()]
        return (value * s.float()[:, None] + m.float()[:, None] - w.view(-1, 32)).square().mean(dim=1)

    e_one, e_many = group_errors((1.0,)), group_errors((1.0, 0.9, 0.8))
    assert bool((e_many <= e_one * (1 + 1e-5) + 1e-12).all())
    assert float(e_many.sum()) < 0.98 * float(e_one.sum())
    one = lowbit.roundtrip(w, bits)
    many = lowbit.roundtrip(w, bits, clips=(1.0, 0.9, 0.8))
    assert float((many - w).square().sum()) < 0.99 * float((one - w).square().sum())


def test_three_bit_codes_are_the_nearest_levels() -> None:
    """For the stored (scale, offset) (their bytes under the rows' factors), each 3-bit code is
    the level nearest its value (checked against a search over all 8 levels)."""
    w, _ = _skewed(4, cols=128)
    packed, scale, offset, rows = lowbit.quantize(w, 3, 32)
    grid = lowbit.levels(3, torch.device("cpu"))
    assert grid is not None
    s, m = lowbit.from_bytes(scale.view(-1, 4), offset.view(-1, 4), rows)
    t = (w.view(-1, 32) - m.reshape(-1, 1)) / s.reshape(-1, 1)
    codes = lowbit.unpack(packed, 3).view(-1, 32)
    nearest = (t[..., None] - grid).abs().argmin(dim=-1)
    gap = (t - grid[codes]).abs() - (t - grid[nearest]).abs()
    assert float(gap.max()) < 1e-4


def test_weighted_calibration_cuts_the_output_error_on_held_out_inputs() -> None:
    """Inputs whose channels differ in size by orders of magnitude: with the alpha held at 0 (no
    column scales), weighing the fit by mean(x_j^2) gives a lower output error on held-out inputs
    of the same kind than the uniform fit; the full default (alphas, clip starts) is lower still
    than the uniform fit."""
    g = torch.Generator().manual_seed(5)
    w = torch.randn(128, 256, generator=g) * 0.02
    gain = torch.exp(torch.randn(256, generator=g) * 1.2)

    def inputs(n: int) -> torch.Tensor:
        return torch.randn(n, 256, generator=g) * gain

    x, held = inputs(256), inputs(512)
    ref = held @ w.T

    def error(**kw: object) -> float:
        *codes, c = calibrate.quantise_aware(w, x, 3, 32, **kw)  # type: ignore[arg-type]
        out = torch.empty_like(w)
        lowbit.dequantize_into(*codes, 3, out, c)
        return float((held @ out.T - ref).square().mean())

    uniform = error(alphas=(0.0,), weighted=False, clips=(1.0,), search_rounds=None)
    weighted = error(alphas=(0.0,), weighted=True, clips=(1.0,), search_rounds=None)
    default = error()
    assert weighted < 0.85 * uniform, (weighted, uniform)
    assert default < weighted, (default, weighted)



def test_an_importance_of_another_width_is_refused() -> None:
    with pytest.raises(ValueError, match="input column"):
        lowbit.quantize(torch.zeros(8, 128), 3, 64, importance=torch.ones(64))
