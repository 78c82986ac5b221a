"""What the planner knows about acceptance: a prior curve of expected tokens per target pass
(and draft passes per step) against the tree budget, refitted to the passes an engine has
recorded, and the calibration runs the app's wizard saves next to the hardware profile.

Prior: a(B, D) = 1 + s * log2(1 + B) with s = 0.78, which matches SpecExec's published 70B/7B
figure (7.99 at B = 512) and the starter pair (1.72 / 3.57 / 5.88 / 6.90 / 8.00 at B = 1 / 8 /
64 / 256 / 1024), softly capped by the depth. Draft passes per step follow a fit to the starter
pair's measured growth (1.0 / 6.5 / 9.8 / 11.3 / 12.3 at B = 1 / 8 / 64 / 256 / 1024), capped
at D + 1. Plain data in, plain data out: records are a PassRecord mapping.

What this module does not do: price passes or choose a budget (planner.py).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from engine.errors import MalformedInput
from engine.planning.profile import profile_path
from engine.types import GenerationStats, PassRecord, PassTotals
from engine.untrusted import KIB, read_json_file

PRIOR_SLOPE = 0.78  # tokens per pass gained per doubling of the budget (see module docstring)
CALIBRATION_ROWS = 200  # the newest calibration runs kept
CALIBRATION_MAX_BYTES = 256 * KIB  # 200 rows of four numbers are ~10 kB


def prior_tokens_per_pass(budget: int, max_depth: int, slope: float = PRIOR_SLOPE) -> float:
    """1 + slope * log2(1 + B), softly capped at 1 + D (no path is longer than D tokens)."""
    free = slope * math.log2(1 + budget)
    return 1.0 + max_depth * (1.0 - math.exp(-free / max_depth))


def prior_draft_passes(budget: int, max_depth: int) -> float:
    return min(max_depth + 1.0, 1.0 + 2.1 * math.log2(budget) ** 0.75) if budget > 1 else 1.0


@dataclass(frozen=True)
class MeasuredBudget:
    """One budget's recorded passes: tokens per pass, draft passes and draft seconds per step."""

    budget: int
    passes: int
    tokens_per_pass: float
    draft_passes: float
    draft_seconds: float | None = None


@dataclass(frozen=True)
class AcceptanceCurve:
    """Expected tokens per pass (and draft work per step) vs budget: the prior, refitted to and
    overridden by `measured` budgets (each needs MIN_PASSES passes to count on its own)."""

    slope: float = PRIOR_SLOPE
    measured: tuple[MeasuredBudget, ...] = ()
    # measured / predicted pass time of this pair on this machine (engine overhead the bare
    # layer timing does not see); 1.0 until the engine has recorded passes
    target_time_scale: float = 1.0
    draft_time_scale: float = 1.0
    # the deepest path the prior credits (None: the tree's own depth): a head trained to draft a
    # few tokens ahead (MTP, EAGLE) is not credited with deeper paths than it was measured at
    depth_cap: int | None = None

    MIN_PASSES = 8

    def _depth(self, max_depth: int) -> int:
        return max_depth if self.depth_cap is None else max(1, min(max_depth, self.depth_cap))

    def _at(self, budget: int) -> MeasuredBudget | None:
        return next((m for m in self.measured if m.budget == budget and m.passes >= self.MIN_PASSES), None)

    def tokens_per_pass(self, budget: int, max_depth: int) -> float:
        hit = self._at(budget)
        return hit.tokens_per_pass if hit is not None else prior_tokens_per_pass(budget, self._depth(max_depth),
                                                                                  self.slope)

    def draft_passes(self, budget: int, max_depth: int) -> float:
        hit = self._at(budget)
        return hit.draft_passes if hit is not None else prior_draft_passes(budget, self._depth(max_depth))

    def draft_seconds(self, budget: int) -> float | None:
        """Measured draft seconds per step at this budget, if recorded."""
        hit = self._at(budget)
        return hit.draft_seconds if hit is not None else None

    @staticmethod
    def from_records(records: PassRecord, tree_mode: str = "specexec") -> AcceptanceCurve:
        """From an engine's pass record: a passes-weighted least-squares slope of (a - 1) on
        log2(1 + B), and each budget's own means."""
        rows = [MeasuredBudget(b, r.passes, r.tokens / r.passes, r.draft_passes / r.passes,
                               r.draft_seconds / r.passes if r.draft_seconds else None)
                for (mode, b), r in sorted(records.items()) if mode == tree_mode and r.passes]
        if not rows:
            return AcceptanceCurve()
        num = sum(m.passes * (m.tokens_per_pass - 1.0) * math.log2(1 + m.budget) for m in rows)
        den = sum(m.passes * math.log2(1 + m.budget) ** 2 for m in rows)
        return AcceptanceCurve(slope=num / den if den else PRIOR_SLOPE, measured=tuple(rows))


# ---- calibration runs from the app ---------------------------------------------------------------
def calibration_path() -> Path:
    return profile_path().with_name("calibration.json")


def record_calibration(stats: GenerationStats, path: Path | None = None) -> None:
    """Remember a calibration run's tokens per pass at its budget (the app's wizard calls this);
    `saved_curve()` reads it back."""
    if stats.mode != "specexec" or not stats.target_passes:
        return
    target = path or calibration_path()
    try:
        rows = read_json_file(target, what="the calibration file", max_bytes=CALIBRATION_MAX_BYTES)
    except (OSError, MalformedInput):
        rows = []
    if not isinstance(rows, list):
        rows = []
    rows.append([int(stats.budget), int(stats.target_passes), int(stats.new_tokens), int(stats.draft_passes)])
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(json.dumps(rows[-CALIBRATION_ROWS:]), encoding="utf-8")


def saved_curve(path: Path | None = None) -> AcceptanceCurve:
    """The acceptance curve calibrated from record_calibration's file (the prior without one,
    or when the file is damaged)."""
    source = path or calibration_path()
    try:
        rows = read_json_file(source, what="the calibration file", max_bytes=CALIBRATION_MAX_BYTES)
        if not isinstance(rows, list):
            return AcceptanceCurve()
        totals: dict[tuple[str, int], PassTotals] = {}
        for budget, passes, tokens, drafts in rows:
            if int(budget) < 1 or int(passes) < 1 or int(tokens) < 0 or int(drafts) < 0:
                continue  # a damaged row: no run records these
            key = ("specexec", int(budget))
            totals[key] = totals.get(key, PassTotals()) + PassTotals(int(passes), int(tokens), int(drafts))
    except (OSError, MalformedInput, ValueError, TypeError, OverflowError):
        return AcceptanceCurve()
    return AcceptanceCurve.from_records(totals)
