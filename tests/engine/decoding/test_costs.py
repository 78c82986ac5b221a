"""The engine's pass-cost model (engine.decoding.costs.PassCosts): a one-token pass priced apart
from passes over more tokens, as a CPU's matrix-vector and matrix-matrix products differ, a
curve through the sizes measured, and the draft-free tree size it picks from that."""

from __future__ import annotations

import pytest

from engine.decoding.costs import PassCosts

# seconds per pass as the starter model measures on the 2-core CPU: a step from 1 to 2 tokens,
# then a gentle slope (engine/decoding/costs.py)
MEASURED = {1: 0.060, 2: 0.090, 3: 0.092, 5: 0.095, 9: 0.100, 17: 0.110}


def measured() -> PassCosts:
    costs = PassCosts()
    for _ in range(5):
        for tokens, seconds in MEASURED.items():
            costs.observe_target(tokens, seconds)
    return costs


def test_one_token_is_priced_apart_from_the_line_through_larger_passes() -> None:
    costs = measured()
    assert costs.target(1) == pytest.approx(0.060)
    for tokens in (2, 5, 17):
        assert costs.target(tokens) == pytest.approx(MEASURED[tokens], abs=0.005)
    assert costs.target(400) > costs.target(17)


def test_a_weak_candidate_does_not_buy_the_dearer_pass() -> None:
    costs = measured()
    assert costs.best_size([0.4]) == 0  # 1.4 tokens in 0.090 s is slower than 1 in 0.060 s
    assert costs.best_size([0.6]) == 1  # 1.6 in 0.090 s is faster
    assert costs.best_size([0.9, 0.8, 0.7, 0.6, 0.01]) == 4  # a likely copy pays; its unlikely tail does not


def test_before_measurements_trees_are_priced_to_be_tried() -> None:
    fresh = PassCosts()
    assert fresh.target(65) == pytest.approx(2 * fresh.target(1))  # relative figures
    singles = PassCosts()
    singles.observe_target(1, 0.05)
    assert singles.target(1) == pytest.approx(0.05) and singles.target(65) == pytest.approx(0.10)
    assert singles.best_size([0.3]) == 1  # optimistic until a larger pass is measured


def test_passes_measured_far_out_never_price_a_small_pass_below_one_token() -> None:
    costs = PassCosts()
    costs.observe_target(1, 0.060)
    for tokens, seconds in ((100, 0.100), (300, 0.300), (500, 0.500)):  # a line through them: t(2) = 0.002 s
        costs.observe_target(tokens, seconds)
    assert 0.060 <= costs.target(2) < 0.061
    costs.observe_target(2, 0.010)  # a measurement below one token's cost (noise) prices it at one token
    assert costs.target(2) == pytest.approx(0.060)


def test_one_large_first_pass_does_not_price_every_tree_like_the_prompt() -> None:
    """A fresh process: one-token passes, and the first pass, which also read 78 tokens of the
    prompt's tail. Small trees must still look cheap (the old flat line priced a 5-token pass
    at the 79-token pass's cost, so draft-free trees were never grown in a one-shot run)."""
    costs = PassCosts()
    costs.observe_target(79, 0.180)
    for _ in range(10):
        costs.observe_target(1, 0.025)
    assert costs.target(5) < 2 * costs.target(1)
    assert costs.target(79) == pytest.approx(0.180)
    assert costs.best_size([0.9, 0.8]) == 2


def test_small_trees_are_priced_from_their_own_sizes_not_the_prompt_passes() -> None:
    """Figures of a CPU hybrid MoE (a 2-core machine, session of 2026-11-28): a step 8.6 ms, trees
    of 2 and 4 tokens 14.0 and 24.8 ms, and answers' first passes over the prompt's tail (170
    tokens, another code path) 0.9 s. A line through all of them priced a 2-token tree at 28 ms,
    so candidates accepted 85 % of the time never paid; the curve prices it as measured."""
    costs = PassCosts()
    for _ in range(3):
        costs.observe_target(170, 0.90)
        costs.observe_target(160, 0.85)
    for _ in range(20):
        costs.observe_target(1, 0.0086)
    for _ in range(4):
        costs.observe_target(2, 0.0140)
        costs.observe_target(4, 0.0248)
    assert costs.target(2) == pytest.approx(0.0140)
    assert costs.target(3) == pytest.approx((0.0140 + 0.0248) / 2)
    assert costs.target(4) == pytest.approx(0.0248)
    assert costs.target(165) == pytest.approx(0.875, rel=1e-3)
    assert 0.0248 < costs.target(40) < 0.875
    assert costs.target(400) > costs.target(170)  # past the last bucket: its segment's slope
    assert costs.best_size([0.85, 0.72, 0.61]) == 2  # (1 + 1.57) / 19.4 ms: 132 tok/s, a step 116


def test_a_concave_curve_is_followed_between_buckets() -> None:
    """An MoE's pass wakes the union of its tokens' experts: its cost per token falls with size.
    Between measured sizes the curve follows that, where one line would not."""
    costs = PassCosts()
    costs.observe_target(1, 0.010)
    for tokens, seconds in ((2, 0.018), (8, 0.040), (64, 0.100)):
        costs.observe_target(tokens, seconds)
    assert costs.target(8) == pytest.approx(0.040)
    assert costs.target(36) == pytest.approx(0.070)
    assert costs.target(5) == pytest.approx(0.029)
