"""What an engine learned as it decoded, kept between processes: the pass costs (costs.PassCosts)
and the acceptance models (acceptance.AcceptanceModels) of one model pair on one machine, and for
an MoE target the experts its passes woke (engine.kernels.expert_unions.union_totals: what the planner
prices its trees by, engine.decoding.auto_budget.routed_shape).

Without it every process starts from priors: a one-shot `specchat generate`, and the first
answer after the app starts, pay for exploring (trees priced optimistically, candidates
estimated from a weak prior) and end just as the estimates are good. With it a fresh process
starts where the last one with the same models ended.

One JSON file per (target fingerprint, draft fingerprint, CPU threads, CPU kernel build: a
faster kernel makes the old costs wrong) in the user data folder
beside the hardware profile (`<data>/learned/<key>.json`). A fingerprint names the weights'
files, their sizes and times, the quantisation, the compute dtype and the device kind
(engine.loading.load.model_fingerprint), so a re-downloaded model, another quantisation or
the GPU instead of the CPU starts afresh. Saved after each answer, written atomically; the
newest KEEP files are kept.

The file is untrusted input: read with a size and depth bound (engine.untrusted), every field
checked (lengths, finite, not negative, hits <= seen); anything else is ignored with one log
line and the engine starts from its priors. A data folder that cannot be written is logged
once and never fails an answer.

What this module does not do: learn (generation.py, costs.py, acceptance.py).
"""

from __future__ import annotations

import hashlib
import logging
import math
from pathlib import Path

import torch

from engine import paths
from engine.decoding.acceptance import CONTEXT_PRIOR, LOGQ_EDGES, SHARED_PRIOR, TAUS, AcceptanceModels
from engine.decoding.costs import PassCosts
from engine.errors import EngineError
from engine.kernels import build
from engine.kernels.expert_unions import UnionTotals
from engine.model.causal_lm import CausalLM
from engine.untrusted import read_json_file

log = logging.getLogger(__name__)

VERSION = 2  # 2: pass costs per size bucket (costs.PassCosts), not one line
KEEP = 32  # files kept (the newest): one per model pair and thread count
MAX_BYTES = 256 * 1024
REGIMES = ("greedy", "t<=0.5", "t<=1", "t>1")
MAX_BUCKETS = 40  # routing rows: passes of up to 2^40 tokens


class LearnedFile:
    """One model pair's learned state on disk."""

    def __init__(self, path: Path, key: str) -> None:
        self.path = path
        self.key = key
        self._warned = False
        self.routing: UnionTotals = {}  # restored with the rest ({} without a file or for a dense target)

    def restore(self, costs: PassCosts, acceptance: AcceptanceModels) -> bool:
        """Fill `costs` and `acceptance` from the file; False (nothing changed) when there is
        none or it does not hold a valid state for this key."""
        self.routing = {}
        if not self.path.is_file():
            return False
        try:
            data = read_json_file(self.path, what="the learned costs", max_bytes=MAX_BYTES)
            state = _checked(data, self.key)
        except (EngineError, OSError, ValueError) as exc:
            log.info("ignoring %s: %s", self.path.name, getattr(exc, "user_message", exc))
            return False
        costs.restore(state["costs"])
        acceptance.restore(state["acceptance"])
        self.routing = state["routing"]
        log.info("pass costs and acceptance from %s", self.path.name)
        return True

    def save(self, costs: PassCosts, acceptance: AcceptanceModels, routing: UnionTotals | None = None) -> None:
        state: dict = {"version": VERSION, "key": self.key, "costs": costs.state(), "acceptance": acceptance.state()}
        if routing:
            state["routing"] = [[b, *t] for b, t in sorted(routing.items())]
        try:
            paths.write_json_atomic(self.path, state, indent=None)
            _prune(self.path.parent)
        except OSError as exc:
            if not self._warned:
                log.warning("could not save the learned costs to %s: %s", self.path.parent, exc)
                self._warned = True


def learned_file(target: CausalLM, draft: CausalLM | None, root: Path | None = None) -> LearnedFile | None:
    """The file of this pair on this machine (None when a model has no fingerprint)."""
    if not target.fingerprint or (draft is not None and not draft.fingerprint):
        return None
    key = (f"{target.fingerprint}+{draft.fingerprint if draft is not None else 'none'}+{torch.get_num_threads()}"
           f"+{build.identity()}")
    name = hashlib.sha256(key.encode()).hexdigest()[:32] + ".json"
    return LearnedFile((root or paths.data_dir() / "learned") / name, key)


def _prune(folder: Path) -> None:
    files = sorted(folder.glob("*.json"), key=lambda p: p.stat().st_mtime, reverse=True)
    for old in files[KEEP:]:
        old.unlink(missing_ok=True)


# ---- checking an untrusted state --------------------------------------------------------------
def _numbers(value: object, n: int | None, what: str) -> list[float]:
    if not isinstance(value, list) or (n is not None and len(value) != n):
        raise ValueError(f"{what}: not a list of {n} numbers")
    out = []
    for v in value:
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
            raise ValueError(f"{what}: {v!r} is not a finite number >= 0")
        out.append(float(v))
    return out


def _calibrator(value: object, n: int, what: str) -> dict[str, list[float]]:
    if not isinstance(value, dict):
        raise ValueError(f"{what}: not an object")
    hits, seen = _numbers(value.get("hits"), n, what + ".hits"), _numbers(value.get("seen"), n, what + ".seen")
    if any(h > s * (1 + 1e-9) + 1e-9 for h, s in zip(hits, seen)):
        raise ValueError(f"{what}: more hits than observations")
    return {"hits": hits, "seen": seen}


def _checked(data: object, key: str) -> dict:
    if not isinstance(data, dict) or data.get("version") != VERSION or data.get("key") != key:
        raise ValueError("another version or model pair")
    costs = data.get("costs")
    if not isinstance(costs, dict):
        raise ValueError("costs: not an object")
    fields = list(PassCosts.FIELDS)
    values = _numbers([costs.get(f) for f in fields], len(fields), "costs")
    acceptance = data.get("acceptance")
    if not isinstance(acceptance, dict) or not set(acceptance) <= set(REGIMES):
        raise ValueError("acceptance: not an object of known regimes")
    models = {}
    for name, model in acceptance.items():
        if not isinstance(model, dict):
            raise ValueError(f"acceptance.{name}: not an object")
        tau_ll = model.get("tau_ll")
        if not isinstance(tau_ll, list) or len(tau_ll) != len(TAUS) or not all(
                isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in tau_ll):
            raise ValueError(f"acceptance.{name}.tau_ll: not {len(TAUS)} finite numbers")  # log-likelihoods: any sign
        models[name] = {"tau_ll": [float(v) for v in tau_ll],
                        "backed": _calibrator(model.get("backed"), len(LOGQ_EDGES) + 1, f"acceptance.{name}.backed"),
                        "context": _calibrator(model.get("context"), len(CONTEXT_PRIOR), f"acceptance.{name}.context")}
        if "shared" in model:  # files written before the sibling table have none
            models[name]["shared"] = _calibrator(model["shared"], len(SHARED_PRIOR), f"acceptance.{name}.shared")
    return {"costs": dict(zip(fields, values)), "acceptance": models, "routing": _routing(data.get("routing", []))}


def _routing(value: object) -> UnionTotals:
    """[[bucket, calls, tokens, experts woken], ...]: buckets of 2+ tokens (log2), at most one
    row each, whole numbers, a pass of 2^(bucket-1) or more tokens each."""
    if not isinstance(value, list) or len(value) > MAX_BUCKETS:
        raise ValueError("routing: not a list of buckets")
    out: UnionTotals = {}
    for row in value:
        if not (isinstance(row, list) and len(row) == 4
                and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in row)):
            raise ValueError("routing: a row is not four whole numbers >= 0")
        bucket, calls, tokens, union = row
        if not 2 <= bucket <= MAX_BUCKETS or bucket in out or calls < 1 or tokens < calls << (bucket - 1) \
                or tokens >= calls << bucket or union < calls:
            raise ValueError(f"routing: bucket {bucket} does not hold passes of its size")
        out[bucket] = (calls, tokens, union)
    return out
