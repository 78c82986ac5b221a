"""tests/chi_square.py, the sampling tests' p-value, against the chi-square table's critical values
(the 5 % and 0.1 % points that every statistics table prints) and on counts too far off to pass."""

from __future__ import annotations

import pytest
import torch
from chi_square import chisquare_pvalue


def counts_with_statistic(stat: float, cells: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Observed and expected counts (100 per cell) whose chi-square statistic is `stat`."""
    expected = torch.full((cells,), 100.0, dtype=torch.float64)
    shift = (stat * 100 / 2) ** 0.5  # one cell up, one down: 2 * shift^2 / 100
    observed = expected.clone()
    observed[0] += shift
    observed[1] -= shift
    return observed, expected


@pytest.mark.parametrize(("df", "critical", "level"), [
    (1, 3.841459, 0.05), (10, 18.307038, 0.05), (60, 79.081944, 0.05), (1, 10.827566, 0.001), (100, 149.449, 0.001),
])
def test_table_critical_values_give_their_level(df: int, critical: float, level: float) -> None:
    observed, expected = counts_with_statistic(critical, df + 1)
    assert chisquare_pvalue(observed, expected) == pytest.approx(level, rel=1e-4)


def test_counts_equal_to_expectation_pass_and_far_off_counts_fail() -> None:
    expected = torch.tensor([400.0, 300.0, 200.0, 100.0])
    assert chisquare_pvalue(expected, expected) == 1.0
    assert chisquare_pvalue(torch.tensor([100.0, 200.0, 300.0, 400.0]), expected) < 1e-100


def test_unusable_input_is_refused_with_a_message() -> None:
    with pytest.raises(ValueError, match="differs from expected total"):
        chisquare_pvalue(torch.tensor([1.0, 2.0]), torch.tensor([1.0, 1.0]))
    with pytest.raises(ValueError, match="must be positive"):
        chisquare_pvalue(torch.tensor([1.0, 1.0]), torch.tensor([2.0, 0.0]))
    with pytest.raises(ValueError, match="two or more cells"):
        chisquare_pvalue(torch.tensor([1.0]), torch.tensor([1.0]))
