"""Which catalog pairs suit this machine: the models page's badges and the wizard's ranking.

Wraps `engine.planning.profile` (the saved profile) and `engine.planning.planner` (predicted
speed and fit) so the widgets get plain rows. Every failure degrades to "benchmark needed": a
missing or unreadable profile never breaks the page.

The starter alone (target = the catalog's starter, no draft) is always an option: on a CPU-only
machine it is the only recommendation, since a draft that costs as much as the target cannot
pay for itself there. The starter is what every part of SpecChat runs (PyPI's 98.4 MB Q4_1
GGUF, run as it is: engine.loading.starter), so its rows show that size and format.

Speeds: once this computer has run a pair (the wizard's test run, any answer), the figure is
what it measured there (engine.planning.measured: "measured here: 2.9 tok/s over 10
answers"); before that, the planner's prediction, labelled as one ("predicted from the
benchmark; not measured here yet"). `pair_options(..., locate=...)` finds the local copy a
measurement belongs to.

A pair whose draft is an EAGLE-3 head (catalog role "head") is priced as a head: its one layer
and its output head per draft pass (the entry's shape), with the EAGLE-3 acceptance prior of
engine.decoding.draft_choice (`pair_curve`), never the wizard's calibration of a draft model.

`download_warning` says why a download deserves a second look (a pair that does not fit, a
large download, more than the free disk space); the pages ask through an injected callable.
"""

from __future__ import annotations

import logging
import shutil
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from engine.decoding.draft_choice import prior_curve
from engine.errors import EngineError
from engine.planning import planner, profile
from engine.planning.calibration import AcceptanceCurve, saved_curve
from engine.planning.measured import MeasuredSpeed, format_rate, measured_speed
from engine.planning.planner import PairPrediction
from engine.planning.profile import HardwareProfile
from engine.store.catalog import Catalog, CatalogModel
from engine.store.pypi import STARTER_FORMAT, STARTER_GGUF_BYTES, STARTER_SOURCE
from engine.units import GB, format_bytes

log = logging.getLogger(__name__)

STARTER_PAIR_ID = "starter"
FIT_LABELS = {"fits": "Fits", "slow": "Slow", "too big": "Too big", "unknown": "Benchmark needed",
              "no prediction": "No prediction"}
LARGE_DOWNLOAD_BYTES = 10 * GB  # a download this big is confirmed first, fit or not
READING_TOK_S = 5.0  # a CPU-only machine is offered a large model it runs at least this fast (reading speed)
PRIOR_NOTE = "predicted from the benchmark; not measured here yet"
Locate = Callable[[str], "Path | None"]  # a catalog id -> the local file or folder the app would load


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
    target_format: str = ""  # what runs: "BF16", "GGUF Q4_K_M", "AWQ INT4", the starter's Q4_1 GGUF...
    target_source: str = ""  # where the target comes from: "owner/name", "owner/name:FILE.gguf", PyPI
    measured: MeasuredSpeed | None = None  # what this computer measured for the pair
    draft_role: str = ""  # the draft's catalog role: "draft" (a model), "head" (an EAGLE-3 head), "" none

    @property
    def fit_label(self) -> str:
        return FIT_LABELS.get(self.fit, self.fit)

    @property
    def speed(self) -> float | None:
        """The figure to go by: measured here when there is one, else the prediction."""
        return self.measured.tokens_per_second if self.measured is not None else self.tokens_per_second

    def speed_text(self) -> str:
        """"2.9 tok/s measured", "~17 tok/s predicted", "benchmark needed" or "—"."""
        if self.measured is not None:
            return f"{format_rate(self.measured.tokens_per_second)} tok/s measured"
        if self.tokens_per_second is None:
            return "benchmark needed" if self.fit == "unknown" else "—"
        return f"~{format_rate(self.tokens_per_second)} tok/s predicted"

    def speed_html(self) -> str:
        """The wizard's wording: the measured figure, or the prediction labelled as a prior."""
        if self.measured is not None:
            many = "answer" if self.measured.answers == 1 else "answers"
            return (f"measured here: <b>{format_rate(self.measured.tokens_per_second)} tok/s</b> over "
                    f"{self.measured.answers} {many}")
        if self.tokens_per_second is None:
            return ""
        return f"about <b>{format_rate(self.tokens_per_second)} tok/s</b> ({PRIOR_NOTE})"


format_speed = format_rate  # one wording of a speed everywhere


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


def pair_curve(draft: CatalogModel | None) -> AcceptanceCurve:
    """The acceptance curve a catalog pair is priced with: for an EAGLE-3 head the prior
    draft_choice prices every head by ("assistant"); else the wizard's calibration of the
    catalog pair it ran (the catalog prior until it has run one)."""
    return prior_curve("assistant") if draft is not None and draft.is_head else saved_curve()


def _predict(profile: HardwareProfile | None, target: CatalogModel, draft: CatalogModel | None,
             quant: str) -> PairPrediction | None:
    if profile is None:
        return None
    try:  # calibrated from the app's test runs when there are some
        return planner.predict_pair(profile, target, draft, quant=quant, curve=pair_curve(draft))
    except EngineError as exc:  # a pair the planner cannot price shows "no prediction"
        log.info("no prediction for %s + %s: %s", target.id, draft.id if draft else "-", exc.user_message)
        return None
    except (ValueError, KeyError, ZeroDivisionError) as exc:
        log.warning("no prediction for %s + %s: %s", target.id, draft.id if draft else "-", exc)
        return None


def download_bytes(model: CatalogModel, starter: str) -> int:
    """What fetching `model` costs: the starter comes from PyPI (one figure everywhere)."""
    return STARTER_GGUF_BYTES if model.id == starter else model.download_bytes


def measured_for(locate: Locate | None, target: str, draft: str, profile: HardwareProfile | None) -> MeasuredSpeed | None:
    """What this computer measured for the local copies of catalog ids `target` (+ `draft`)."""
    if locate is None:
        return None
    target_path = locate(target)
    draft_path = locate(draft) if draft else None
    if target_path is None or (draft and draft_path is None):
        return None
    device = None if profile is None else "cuda" if profile.gpu is not None else "cpu"
    return measured_speed(target_path, draft_path, device)


def _reason(prediction: PairPrediction | None, measured: MeasuredSpeed | None) -> str:
    """The tooltip: the measured figure and what was predicted, or the prediction as a prior."""
    if measured is None:
        return f"{prediction.reason}. Speed {PRIOR_NOTE}." if prediction is not None else ""
    text = measured.describe()
    said = f"{text[:1].upper()}{text[1:]} (writing speed, after the prompt is read)."
    if prediction is None:
        return said
    return (f"{said} The benchmark predicted {format_rate(prediction.tokens_per_second)} tok/s "
            f"({prediction.reason}).")


def _option(pair_id: str, title: str, description: str, target: CatalogModel, draft: CatalogModel | None,
            profile: HardwareProfile | None, quant: str, starter: str, locate: Locate | None) -> PairOption:
    size = download_bytes(target, starter) + (download_bytes(draft, starter) if draft else 0)
    if target.id == starter:
        about: dict[str, Any] = dict(target_format=STARTER_FORMAT, target_source=STARTER_SOURCE)
    else:
        source = f"{target.repo_id}:{target.gguf_file}" if target.gguf_file else target.repo_id
        about = dict(target_format=target.format_label, target_source=source)
    # the starter runs as its PyPI wheel's Q4_1 GGUF, packed for the CPU kernel: priced so
    priced = replace(target, prequantised="gguf", dtype="gguf-q4_1") if target.id == starter else target
    prediction = _predict(profile, priced, draft, quant)
    measured = measured_for(locate, target.id, draft.id if draft else "", profile)
    reason = _reason(prediction, measured)
    about["draft_role"] = draft.role if draft is not None else ""
    if prediction is None:
        return PairOption(pair_id, title, description, target.id, draft.id if draft else "", size,
                          fit="unknown" if profile is None else "no prediction", reason=reason, measured=measured,
                          **about)
    fit = prediction.fit
    if measured is not None and fit == "fits" and measured.tokens_per_second < 1.0:
        fit = "slow"  # what it ran at here outranks the prior
    return PairOption(
        pair_id, title, description, target.id, draft.id if draft else "", size, fit=fit,
        tokens_per_second=prediction.tokens_per_second, budget=prediction.budget, reason=reason,
        measured=measured, **about,
    )


def pair_options(catalog: Catalog, profile: HardwareProfile | None, quant: str = "auto",
                 locate: Locate | None = None) -> list[PairOption]:
    """Every catalog pair, then the starter alone, each priced on `profile` when there is one
    and given what this computer measured for it (`locate` finds a catalog id's local copy)."""
    options = []
    for pair in catalog.pairs:
        target = catalog.find(pair.target)
        draft = None if pair.draft_free else catalog.find(pair.draft)  # draft-free: trees from the context
        assert target is not None and (draft is not None or pair.draft_free), "load_catalog validated the pair"
        options.append(_option(pair.id, pair.id, pair.description, target, draft, profile, quant, catalog.starter,
                               locate))
    starter = catalog.find(catalog.starter)
    assert starter is not None
    options.append(_option(STARTER_PAIR_ID, f"Starter ({starter.id})",
                           "A small model that runs anywhere, even without a GPU. No draft.",
                           starter, None, profile, quant, catalog.starter, locate))
    return options


def download_warning(option: PairOption, missing_bytes: int, folder: Path) -> str:
    """Why downloading `option` (`missing_bytes` still to fetch into `folder`) deserves a second
    look, or "" when it does not: a pair that does not fit, a large download, or more than the
    free disk space."""
    if missing_bytes <= 0:
        return ""
    reasons = []
    if option.fit == "too big":
        reasons.append("It does not fit this computer: its weights would be read from disk on every pass"
                       + (f" (about {format_rate(option.speed)} tok/s)." if option.speed else "."))
    free = _free_bytes(folder)
    if free is not None and missing_bytes > free:
        reasons.append(f"It needs {format_bytes(missing_bytes)} but only {format_bytes(free)} is free on {folder}: "
                       "the download will stop for lack of space unless you free some first.")
    elif missing_bytes >= LARGE_DOWNLOAD_BYTES:
        reasons.append(f"It is a large download: {format_bytes(missing_bytes)}.")
    if not reasons:
        return ""
    return f"Download {option.title} ({format_bytes(missing_bytes)})? " + " ".join(reasons)


def _free_bytes(folder: Path) -> int | None:
    """Free space where `folder` is (or would be created), None when it cannot be told."""
    for candidate in (folder, *folder.parents):
        if candidate.exists():
            try:
                return shutil.disk_usage(candidate).free
            except OSError:
                return None
    return None


def recommend(options: list[PairOption], profile: HardwareProfile | None) -> list[PairOption]:
    """What the wizard offers, best first: with no profile (or a quick one's rough figures on a
    CPU-only machine) the starter; on a CPU-only machine the starter, then the targets without a
    draft model that fit and run at reading speed or faster there (READING_TOK_S: the MoE models,
    whose tokens read ~3B of their weights: Qwen3-30B-A3B predicted at ~10 tok/s on 2 cores),
    fastest first; with a GPU, the pairs that fit (fastest first), then those that are slow, then
    the starter."""
    starter = [o for o in options if o.pair_id == STARTER_PAIR_ID]
    if profile is None:
        return starter
    if not profile_has_gpu(profile):
        if profile.quick:
            return starter
        readable = (o for o in options if o.pair_id != STARTER_PAIR_ID and not o.draft and o.fit == "fits"
                    and (o.speed or 0.0) >= READING_TOK_S)
        return starter + sorted(readable, key=lambda o: -(o.speed or 0.0))
    fits = sorted((o for o in options if o.fit == "fits" and o.pair_id != STARTER_PAIR_ID),
                  key=lambda o: -(o.speed or 0.0))
    slow = sorted((o for o in options if o.fit == "slow" and o.pair_id != STARTER_PAIR_ID),
                  key=lambda o: -(o.speed or 0.0))
    return fits + slow + starter


def predicted_curve(profile: HardwareProfile | None, target: CatalogModel, draft: CatalogModel | None,
                    quant: str = "auto") -> list[tuple[int, float]]:
    """The planner's tok/s per budget, or [] when there is nothing to plot."""
    if profile is None or draft is None:
        return []
    try:
        curve = planner.predict_curve(profile, target, draft, quant=quant, curve=pair_curve(draft))  # as the table's
        return [(int(b), float(t)) for b, t in curve]
    except (EngineError, ValueError, KeyError, ZeroDivisionError) as exc:
        log.info("no curve for %s + %s: %s", target.id, draft.id, exc)
        return []
