"""The chi-square goodness-of-fit p-value of the sampling tests, as scipy.stats.chisquare gives it
(the statistic sum((obs - exp)^2 / exp) on len(obs) - 1 degrees of freedom), from
torch.special.gammaincc: the chi-square survival function is the regularised upper incomplete
gamma function, Q(df / 2, stat / 2). The dev install then needs no scipy (~140 MB) for one
function. Imported by name (tests/ is on sys.path: tests/conftest.py's folder)."""

from __future__ import annotations

import torch


def chisquare_pvalue(observed: torch.Tensor, expected: torch.Tensor) -> float:
    """P(chi2(len - 1) >= statistic): small when the counts `observed` did not come from
    `expected` (same total, every cell > 0)."""
    obs, exp = observed.double().flatten(), expected.double().flatten()
    if obs.numel() != exp.numel() or obs.numel() < 2:
        raise ValueError(f"need two or more cells of each, got {obs.numel()} observed and {exp.numel()} expected")
    if not bool((exp > 0).all()):
        raise ValueError("every expected count must be positive")
    if abs(float(obs.sum() - exp.sum())) > 1e-8 * float(exp.sum()):
        raise ValueError(f"observed total {float(obs.sum())} differs from expected total {float(exp.sum())}")
    stat = ((obs - exp) ** 2 / exp).sum()
    return float(torch.special.gammaincc(torch.tensor((obs.numel() - 1) / 2, dtype=torch.float64), stat / 2))
