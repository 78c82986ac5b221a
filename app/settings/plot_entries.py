"""What the settings' speed plot can show: every catalog pair, the starter alone, and the loaded
model when it is neither, each with the speed measured here.

Plain data, no widgets (app/settings/plot.py draws; app/settings/dialog.py picks). A pair with a draft
plots the planner's tok/s per tree budget; a model without a draft has no tree to size, so it
plots one point, one token per pass (draft-free decoding adds context trees only where text
repeats). A model the catalog does not describe has no prediction, only what was measured.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from app.models.recommend import pair_curve, predicted_curve
from app.state.preferences import Preferences
from app.state.running import RunningPair
from engine.errors import EngineError
from engine.planning import planner
from engine.planning.calibration import saved_curve
from engine.planning.measured import MeasuredSpeed, format_rate, measured_speed
from engine.planning.profile import HardwareProfile
from engine.store import find_local_model, hf_hub_cache_dir
from engine.store.catalog import Catalog, CatalogModel
from engine.store.pypi import built_starter

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PlotEntry:
    """One choice of the plot's menu: `key` is the catalog pair id, "starter" or "loaded"."""

    key: str
    label: str
    short: str  # the chart's title names it so
    target: CatalogModel | None  # None: a loaded model the catalog does not describe
    draft: CatalogModel | None
    active: bool  # the pair that is loaded (or chosen)
    measured: MeasuredSpeed | None

    def curve(self, profile: HardwareProfile | None, quant: str) -> tuple[list[tuple[int, float]], int | None]:
        """(budget, predicted tok/s) points and the planner's chosen budget; [] without a prediction."""
        if profile is None or self.target is None:
            return [], None
        try:
            if self.draft is None:  # one token per pass
                plain = planner.predict_pair(profile, self.target, None, quant, curve=saved_curve())
                return [(1, plain.tokens_per_second)], 1
            return (predicted_curve(profile, self.target, self.draft, quant),
                    planner.predict_pair(profile, self.target, self.draft, quant, curve=pair_curve(self.draft)).budget)
        except (EngineError, ValueError, KeyError, ZeroDivisionError) as exc:
            log.info("no prediction for %s: %s", self.label, exc)
            return [], None

    def title(self, points: list[tuple[int, float]]) -> str:
        measured = f"; {self.measured.describe()}" if self.measured is not None else ""
        if self.draft is None and points:
            return f"{self.short}, no draft: predicted {format_rate(points[0][1])} tok/s{measured}"
        if not points:
            return f"{self.short}: no prediction{measured}"
        return f"{self.short}: predicted tok/s by tree budget{measured}"


def plot_entries(catalog: Catalog, prefs: Preferences, running: RunningPair | None) -> list[PlotEntry]:
    """Every catalog pair, then the starter alone, then the loaded model if it is neither."""
    starter_path = built_starter()

    def local(model_id: str) -> Path | None:
        if model_id == catalog.starter:
            return starter_path
        found = find_local_model(model_id, prefs.models_path(), hf_hub_cache_dir(), catalog)
        return found.path if found is not None else None

    loaded = (_resolved(running.target), _resolved(running.draft)) if running is not None else \
        (_resolved(prefs.target), _resolved(prefs.draft))
    entries = []
    for pair in catalog.pairs:
        target = catalog.find(pair.target)
        draft = None if pair.draft_free else catalog.find(pair.draft)
        if target is None or (draft is None and not pair.draft_free):
            continue
        paths = (local(target.id), local(draft.id) if draft is not None else None)
        here = paths[0] is not None and (draft is None or paths[1] is not None)
        entries.append(PlotEntry(pair.id, pair.id, pair.id, target, draft, _is(loaded, paths, (pair.target, pair.draft), prefs),
                                 _measured(*paths) if here else None))
    starter = catalog.find(catalog.starter)
    if starter is not None:
        paths = (starter_path, None)
        entries.append(PlotEntry("starter", f"Starter ({starter.id}), no draft", "Starter", starter, None,
                                 _is(loaded, paths, (starter.id, ""), prefs),
                                 _measured(starter_path, None) if starter_path is not None else None))
    if running is not None and not any(e.active for e in entries):
        name = running.name + (f" + {Path(running.draft).name}" if running.draft else "")
        entries.append(PlotEntry("loaded", f"Loaded: {name}", name, None, None, True, running.measured()))
    return entries


def _measured(target: Path | None, draft: Path | None) -> MeasuredSpeed | None:
    return measured_speed(target, draft) if target is not None else None


def _resolved(spec: str) -> str:
    if not spec:
        return ""
    path = Path(spec).expanduser()
    try:
        return str(path.resolve()) if path.exists() else spec
    except (OSError, RuntimeError):
        return spec


def _is(loaded: tuple[str, str], paths: tuple[Path | None, Path | None], ids: tuple[str, str],
        prefs: Preferences) -> bool:
    """Whether an entry is the loaded pair: by the paths it loads, or by the catalog ids chosen."""
    have_all = all(p is not None for p, i in zip(paths, ids) if i)
    by_path = have_all and bool(loaded[0]) and tuple(_resolved(str(p)) if p is not None else "" for p in paths) == loaded
    return by_path or (prefs.target, prefs.draft) == ids
