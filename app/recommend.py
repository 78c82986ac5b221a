"""Which catalog pairs suit this machine: the models page's badges and the wizard's ranking.

Wraps `engine.planning.profile` (the saved profile) and `engine.planning.planner` (predicted
speed and fit) so the widgets get plain rows. Every failure degrades to "benchmark needed": a
missing or unreadable profile never breaks the page.

The starter alone (target = the catalog's starter, no draft) is always an option: on a CPU-only
machine it is the only recommendation, since a draft that costs as much as the target cannot
pay for itself there.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from engine.errors import EngineError
from engine.planning import planner, profile
from engine.planning.calibration import calibration_path, saved_curve
from engine.planning.planner import PairPrediction
from engine.planning.profile import HardwareProfile
from engine.store.catalog import Catalog, CatalogModel

log = logging.getLogger(__name__)

STARTER_PAIR_ID = "starter"
FIT_LABELS = {"fits": "Fits", "slow": "Slow", "too big": "Too big", "unknown": "Benchmark needed",
              "no prediction": "No prediction"}


@dataclass(frozen=True)
class PairOption:
    """One choice of (target, draft). draft "" = no draft (plain decoding)."""

    pair_id: str
    title: str
    description: str
    target: str
    draft: str
    download_bytes: int
    fit: str = "unknown"  # "fits" | "slow" | "too big" | "unknown" (no profile) | "no prediction"
    tokens_per_second: float | None = None
    budget: int | None = None
    reason: str = ""
    target_format: str = ""  # "BF16", "GGUF Q4_K_M", "AWQ INT4"...
    target_source: str = ""  # where the target downloads from: "owner/name" or "owner/name:FILE.gguf"

    @property
    def fit_label(self) -> str:
        return FIT_LABELS.get(self.fit, self.fit)

    def speed_text(self) -> str:
        if self.tokens_per_second is None:
            return "benchmark needed" if self.fit == "unknown" else "—"
        return f"{format_speed(self.tokens_per_second)} tok/s"


def format_speed(tok_s: float) -> str:
    """Two significant digits below 10 ("0.031", "4.2"), whole numbers above."""
    if tok_s >= 10:
        return f"{tok_s:.0f}"
    if tok_s >= 1:
        return f"{tok_s:.1f}"
    return f"{tok_s:.2g}"


def load_profile() -> HardwareProfile | None:
    """The saved HardwareProfile, or None (not measured yet, unreadable or from an old version)."""
    try:
        return profile.load_profile()
    except (OSError, ValueError, KeyError, TypeError) as exc:  # a corrupt profile: ask for a new benchmark
        log.warning("hardware profile unreadable: %s", exc)
        return None


def profile_has_gpu(profile: HardwareProfile) -> bool:
    return profile.gpu is not None


def profile_headline(profile: HardwareProfile | None) -> str:
    """One line for a page header: CPU, RAM and GPU of the profile."""
    if profile is None:
        return "Benchmark needed: no hardware profile yet (Settings → This computer, or the first-run wizard)."
    keep = [line for line in profile_lines(profile) if line.startswith(("CPU", "RAM", "GPU"))]
    return " · ".join(keep) or profile_lines(profile)[0]


def profile_lines(profile: HardwareProfile | None) -> list[str]:
    if profile is None:
        return ["No hardware profile yet: run “Benchmark this computer”."]
    return profile.summary_lines()


def _predict(profile: HardwareProfile | None, target: CatalogModel, draft: CatalogModel | None,
             quant: str) -> PairPrediction | None:
    if profile is None:
        return None
    try:  # calibrated from the app's test runs when there are some
        return planner.predict_pair(profile, target, draft, quant=quant, curve=saved_curve())
    except EngineError as exc:  # a pair the planner cannot price shows "no prediction"
        log.info("no prediction for %s + %s: %s", target.id, draft.id if draft else "-", exc.user_message)
        return None
    except (ValueError, KeyError, ZeroDivisionError) as exc:
        log.warning("no prediction for %s + %s: %s", target.id, draft.id if draft else "-", exc)
        return None


def _option(pair_id: str, title: str, description: str, target: CatalogModel, draft: CatalogModel | None,
            profile: HardwareProfile | None, quant: str) -> PairOption:
    size = target.download_bytes + (draft.download_bytes if draft else 0)
    source = f"{target.repo_id}:{target.gguf_file}" if target.gguf_file else target.repo_id
    about = dict(target_format=target.format_label, target_source=source)
    prediction = _predict(profile, target, draft, quant)
    if prediction is None:
        return PairOption(pair_id, title, description, target.id, draft.id if draft else "", size,
                          fit="unknown" if profile is None else "no prediction", **about)
    return PairOption(
        pair_id, title, description, target.id, draft.id if draft else "", size, fit=prediction.fit,
        tokens_per_second=prediction.tokens_per_second, budget=prediction.budget,
        reason=f"{prediction.reason}. {prediction_basis()}", **about,
    )


def prediction_basis() -> str:
    """Where every predicted speed comes from (the same in the wizard, the models page and the
    plot): the benchmark, refitted to the runs measured here once there are some."""
    if calibration_path().is_file():
        return "Predicted from this computer's benchmark, calibrated by the answers measured here."
    return "Predicted from this computer's benchmark alone: no answer measured here yet."


def pair_options(catalog: Catalog, profile: HardwareProfile | None, quant: str = "auto") -> list[PairOption]:
    """Every catalog pair, then the starter alone, each priced on `profile` when there is one."""
    options = []
    for pair in catalog.pairs:
        target, draft = catalog.find(pair.target), catalog.find(pair.draft)
        assert target is not None and draft is not None, "load_catalog validated the pair"
        options.append(_option(pair.id, pair.id, pair.description, target, draft, profile, quant))
    starter = catalog.find(catalog.starter)
    assert starter is not None
    options.append(_option(STARTER_PAIR_ID, f"Starter ({starter.id})",
                           "A small model that runs anywhere, even without a GPU. No draft.",
                           starter, None, profile, quant))
    return options


def recommend(options: list[PairOption], profile: HardwareProfile | None) -> list[PairOption]:
    """What the wizard offers, best first: on a CPU-only machine (or with no profile) the starter;
    with a GPU, the pairs that fit (fastest first), then those that are slow, then the starter."""
    starter = [o for o in options if o.pair_id == STARTER_PAIR_ID]
    if profile is None or not profile_has_gpu(profile):
        return starter
    fits = sorted((o for o in options if o.fit == "fits" and o.pair_id != STARTER_PAIR_ID),
                  key=lambda o: -(o.tokens_per_second or 0.0))
    slow = sorted((o for o in options if o.fit == "slow" and o.pair_id != STARTER_PAIR_ID),
                  key=lambda o: -(o.tokens_per_second or 0.0))
    return fits + slow + starter


def predicted_curve(profile: HardwareProfile | None, target: CatalogModel, draft: CatalogModel | None,
                    quant: str = "auto") -> list[tuple[int, float]]:
    """The planner's tok/s per budget, or [] when there is nothing to plot."""
    if profile is None or draft is None:
        return []
    try:
        curve = planner.predict_curve(profile, target, draft, quant=quant, curve=saved_curve())  # as the table's
        return [(int(b), float(t)) for b, t in curve]
    except (EngineError, ValueError, KeyError, ZeroDivisionError) as exc:
        log.info("no curve for %s + %s: %s", target.id, draft.id, exc)
        return []
