"""How each kind of draft did for a target on this machine, kept between processes, so the draft
choice (draft_choice.choose_draft) prices a kind by its measured tokens per pass rather than by
its published prior once it has run: a self-draft that agrees less with this target than
SubSpec's figure says, or an MTP head that agrees more, is chosen or passed over on what it did.

One JSON file per target fingerprint (which names the weights, the quantisation, the dtype and
the device kind, so the GPU and the CPU keep apart) in the user data folder
(`<data>/draft-rates/<key>.json`), holding per draft kind ("mtp", "assistant", "self",
"catalog") and budget the summed passes of answers decoded with that kind's trees: passes,
tokens, draft passes, draft seconds and target seconds (types.PassTotals). Each answer adds its
own; a self-draft's width is not part of the key (the choice sizes it to the memory left, the
same on one machine).

The file is untrusted input: read with a size bound (engine.untrusted), every field checked;
anything else is ignored with one log line (and overwritten by the next answer). A data folder
that cannot be written is logged once and never fails an answer.

What this module does not do: choose (draft_choice.py) or decode (generation.py).
"""

from __future__ import annotations

import hashlib
import logging
import math
from dataclasses import replace
from pathlib import Path
from typing import Any

from engine import paths
from engine.decoding.draft_choice import prior_curve
from engine.errors import EngineError
from engine.model.causal_lm import CausalLM
from engine.planning.calibration import AcceptanceCurve
from engine.types import PassTotals
from engine.untrusted import read_json_file

log = logging.getLogger(__name__)

VERSION = 1
KINDS = ("mtp", "assistant", "self", "catalog")
MAX_BYTES = 64 * 1024
MAX_BUDGETS = 64  # per kind: the budgets an answer can run at (auto picks among a few)
KEEP = 64  # files kept (the newest): one per target
MIN_PASSES = 16  # a kind's record counts once it holds this many passes (one short answer does not turn the choice)


class DraftRates:
    """One target's file, and the draft kind its engine runs (what `add` records under)."""

    def __init__(self, path: Path, target: str, kind: str) -> None:
        self.path, self.target, self.kind = path, target, kind
        self._warned = False

    def add(self, budget: int, totals: PassTotals) -> None:
        """Add one answer's passes at `budget` to this kind's record on disk."""
        data = read_rates(self.path, self.target)
        rows = data.setdefault(self.kind, {})
        if str(budget) not in rows and len(rows) >= MAX_BUDGETS:
            return
        rows[str(budget)] = rows.get(str(budget), PassTotals()) + totals
        state = {"version": VERSION, "target": self.target,
                 "kinds": {k: {b: [t.passes, t.tokens, t.draft_passes, t.draft_seconds, t.target_seconds]
                               for b, t in v.items()} for k, v in data.items()}}
        try:
            paths.write_json_atomic(self.path, state, indent=None)
            _prune(self.path.parent)
        except OSError as exc:
            if not self._warned:
                log.warning("could not save the draft's measured rates to %s: %s", self.path.parent, exc)
                self._warned = True


def rates_file(target: CausalLM, root: Path | None = None) -> Path | None:
    """This target's file (None when it has no fingerprint)."""
    if not target.fingerprint:
        return None
    name = hashlib.sha256(target.fingerprint.encode()).hexdigest()[:32] + ".json"
    return (root or paths.data_dir() / "draft-rates") / name


def rates_for(target: CausalLM, kind: str, root: Path | None = None) -> DraftRates | None:
    """Where an engine running `target` with a draft of `kind` records its passes (None for
    draft-free, an unknown kind or a target without a fingerprint)."""
    path = rates_file(target, root)
    if path is None or kind not in KINDS:
        return None
    return DraftRates(path, target.fingerprint, kind)


def measured_curves(target: CausalLM, root: Path | None = None) -> dict[str, AcceptanceCurve]:
    """The measured acceptance curve of each kind that has run at least MIN_PASSES passes with
    `target` (from_records: a fitted slope and each budget's own means), with the kind's depth
    cap (a head is not credited with deeper paths than its prior was measured at)."""
    path = rates_file(target, root)
    if path is None:
        return {}
    out = {}
    for kind, rows in read_rates(path, target.fingerprint).items():
        curve = AcceptanceCurve.from_records({("specexec", int(b)): t for b, t in rows.items()})
        if sum(m.passes for m in curve.measured) >= MIN_PASSES:
            out[kind] = replace(curve, depth_cap=prior_curve(kind).depth_cap)
    return out


def read_rates(path: Path, target: str) -> dict[str, dict[str, PassTotals]]:
    """The file's records by kind and budget; {} when there is none or it is not valid for `target`."""
    if not path.is_file():
        return {}
    try:
        data = read_json_file(path, what="the draft's measured rates", max_bytes=MAX_BYTES)
        return _checked(data, target)
    except (EngineError, OSError, ValueError) as exc:
        log.info("ignoring %s: %s", path.name, getattr(exc, "user_message", exc))
        return {}


def _checked(data: Any, target: str) -> dict[str, dict[str, PassTotals]]:
    if not isinstance(data, dict) or data.get("version") != VERSION or data.get("target") != target:
        raise ValueError("another version or another model's file")
    kinds = data.get("kinds")
    if not isinstance(kinds, dict) or not set(kinds) <= set(KINDS):
        raise ValueError("unknown draft kinds")
    out: dict[str, dict[str, PassTotals]] = {}
    for kind, rows in kinds.items():
        if not isinstance(rows, dict) or len(rows) > MAX_BUDGETS:
            raise ValueError(f"{kind}: not a table of budgets")
        out[kind] = {}
        for budget, row in rows.items():
            if not (isinstance(budget, str) and budget.isdigit() and 1 <= int(budget) <= 1 << 16):
                raise ValueError(f"{kind}: budget {budget!r}")
            if not (isinstance(row, list) and len(row) == 5 and all(
                    isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= 0 for v in row)):
                raise ValueError(f"{kind}, budget {budget}: not five finite counts")
            passes, tokens, draft_passes = (int(v) for v in row[:3])
            if row[:3] != [passes, tokens, draft_passes] or tokens < passes:
                raise ValueError(f"{kind}, budget {budget}: counts that cannot be")
            out[kind][budget] = PassTotals(passes, tokens, draft_passes, float(row[3]), float(row[4]))
    return out


def _prune(folder: Path) -> None:
    files = sorted(folder.glob("*.json"), key=lambda p: p.stat().st_mtime, reverse=True)
    for old in files[KEEP:]:
        old.unlink(missing_ok=True)
