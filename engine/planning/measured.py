"""Decode speeds measured on this computer: what answers really ran at, per model, format,
draft and device, kept in the data folder so predictions can give way to them.

The planner (planner.py) predicts tok/s from the hardware benchmark: a prior, and an optimistic
one for formats and sizes it prices roughly. Once a model has answered here, the app's wizard,
models page and tooltips show what was measured ("measured here: 2.9 tok/s over 10 answers")
and say "predicted" only where nothing was.

- `SpeedKey(target, fmt, draft, device)`: the model as it ran. `target` and `draft` are the
  resolved paths of the file or folder loaded (this computer's identity of a model; "" = no
  draft), `fmt` how its decoder layers ran ("FP32", "BF16", "NF4", "GGUF Q4_1", ...: see
  `run_format`), `device` "cpu" or "cuda".
- `record_answer(key, stats)`: add one finished answer (the engine's GenerationStats). The
  writing speed counts: new tokens over the seconds after the prompt was read
  (`seconds - prefill_seconds`), the part a prediction is about. Answers of fewer than
  MIN_TOKENS tokens say little and are skipped. The newest RECENT_ANSWERS per key are kept, so a
  machine that got faster or slower shows it.
- `measured_speed(target, draft, device, fmt=None)`: the MeasuredSpeed for a model, or None.
  Without `fmt`, the format measured last.

The file (`measured_speeds.json` beside the hardware profile) is JSON written atomically (a
temporary file, then os.replace) and read through engine.untrusted with a size bound; a damaged
file counts as empty and is replaced by the next write. Two threads recording at the same
moment can lose one answer's figures, never corrupt the file.

What this module does not do: predict (planner.py) or measure anything itself.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TypedDict, TypeGuard

from engine.errors import MalformedInput
from engine.planning.profile import profile_path
from engine.shapes import Placement
from engine.types import GenerationStats
from engine.untrusted import read_json_file

log = logging.getLogger(__name__)

FILE_VERSION = 1
RECENT_ANSWERS = 20  # per key: the newest answers the figure is made of
MAX_ENTRIES = 200  # keys kept, newest first
MIN_TOKENS = 4  # an answer of fewer new tokens is mostly fixed costs
MAX_FILE_BYTES = 2 * 1024 * 1024


@dataclass(frozen=True)
class SpeedKey:
    """A model as it ran: resolved target path, layer format, draft path ("" = none), device."""

    target: str
    fmt: str
    draft: str
    device: str


@dataclass(frozen=True)
class MeasuredSpeed:
    """What `answers` recent answers of one key ran at (writing speed, tokens per second)."""

    key: SpeedKey
    answers: int  # in the figure (at most RECENT_ANSWERS)
    total_answers: int  # ever recorded for this key
    tokens: int
    seconds: float
    last_mode: str  # the engine's StepMode of the newest answer: specexec, context, autoregressive
    updated: float  # time.time() of the newest answer

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    def describe(self) -> str:
        """"measured here: 2.9 tok/s over 10 answers" (the wording every view uses)."""
        many = "answer" if self.answers == 1 else "answers"
        last = " the last" if self.total_answers > self.answers else ""
        return f"measured here: {format_rate(self.tokens_per_second)} tok/s over{last} {self.answers} {many}"


class _Entry(TypedDict):
    """One key's figures as the file keeps them (`_valid` checks an entry read back)."""

    target: str
    fmt: str
    draft: str
    device: str
    answers: int
    recent: list[list[float]]  # [new tokens, seconds] of the newest answers, oldest first
    last_mode: str
    updated: float


def format_rate(tok_s: float) -> str:
    """Two significant digits below 10 ("0.031", "4.2"), whole numbers above."""
    if tok_s >= 10:
        return f"{tok_s:.0f}"
    if tok_s >= 1:
        return f"{tok_s:.1f}"
    return f"{tok_s:.2g}"


def measured_path() -> Path:
    return profile_path().with_name("measured_speeds.json")


def device_kind(device: str) -> str:
    """"cuda:0" -> "cuda"; "cpu" -> "cpu"."""
    return "cuda" if device.startswith("cuda") else "cpu"


def run_format(path: Path | str, placement: Placement | None) -> str:
    """How a loaded model's decoder layers ran: "FP32" or "BF16" (16-bit on a GPU, 32-bit on a
    CPU, whatever the checkpoint stored), "NF4", "AWQ INT4", "GPTQ INT4", or "GGUF Q4_1" (the
    file's own blocks; the type read from its header). On a CPU a GGUF runs by the packed
    kernel, or de-quantised at load, and AWQ/GPTQ de-quantised at load (Placement.resident_form):
    the same model, named the same."""
    packing = placement.quant if placement is not None else "none"
    device = placement.device if placement is not None else "cpu"
    if packing == "gguf":
        return f"GGUF {gguf_type(Path(path))}".strip()
    if packing == "none":
        return "BF16" if device_kind(device) == "cuda" else "FP32"
    return {"nf4": "NF4", "awq": "AWQ INT4", "gptq": "GPTQ INT4"}.get(packing, packing.upper())


def gguf_type(path: Path) -> str:
    """The quantisation a GGUF's header names ("Q4_1", "Q4_K_M"), "" when it cannot be read."""
    from engine.store import HeaderFacts  # numpy and gguf-py constants, no torch

    try:
        return HeaderFacts().of(path)[1]
    except (OSError, ValueError) as exc:  # CorruptGGUF is a ValueError
        log.info("cannot read the GGUF header of %s: %s", path, exc)
        return ""


def speed_key(target: Path | str, draft: Path | str | None, placement: Placement | None) -> SpeedKey:
    """The key of a loaded pair: resolved paths, the target's run format, the device kind."""
    return SpeedKey(_identity(target), run_format(target, placement), _identity(draft) if draft else "",
                    device_kind(placement.device if placement is not None else "cpu"))


def _identity(spec: Path | str) -> str:
    """A model's identity here: its resolved path (a catalog or repo id is looked up in the
    model store first, as the loader does); the spec itself when it names nothing local."""
    path = Path(spec).expanduser()
    try:
        if not path.exists():
            from engine.store import resolve_model  # no torch

            found = resolve_model(str(spec))
            if found is None:
                return str(spec)
            path = Path(found)
        return str(path.resolve())
    except (OSError, RuntimeError, ValueError):  # RuntimeError: a symlink loop
        return str(spec)


# ---- the file ------------------------------------------------------------------------------------
def _read(path: Path) -> list[_Entry]:
    """The file's entries; [] when it is missing or damaged (said once in the log)."""
    try:
        raw = read_json_file(path, what="The measured speeds file", max_bytes=MAX_FILE_BYTES)
    except FileNotFoundError:
        return []
    except (OSError, MalformedInput) as exc:
        log.warning("ignoring the measured speeds file %s: %s", path, getattr(exc, "user_message", exc))
        return []
    if not isinstance(raw, dict) or raw.get("version") != FILE_VERSION or not isinstance(raw.get("entries"), list):
        log.warning("ignoring the measured speeds file %s: not version %d of it", path, FILE_VERSION)
        return []
    return [e for e in raw["entries"] if _valid(e)]


def _valid(entry: object) -> TypeGuard[_Entry]:
    if not isinstance(entry, dict):
        return False
    texts = all(isinstance(entry.get(k), str) for k in ("target", "fmt", "draft", "device", "last_mode"))
    recent = entry.get("recent")
    pairs = isinstance(recent, list) and 0 < len(recent) <= RECENT_ANSWERS and all(
        isinstance(r, list) and len(r) == 2 and isinstance(r[0], int) and not isinstance(r[0], bool)
        and isinstance(r[1], (int, float)) and r[0] > 0 and 0 < r[1] < 1e9 for r in recent)
    counts = isinstance(entry.get("answers"), int) and isinstance(entry.get("updated"), (int, float))
    return texts and pairs and counts


def _write(path: Path, entries: list[_Entry]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=path.name, suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            json.dump({"version": FILE_VERSION, "entries": entries}, handle, indent=1)
        os.replace(tmp, path)  # a reader sees the old file or the new one, never half of one
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _key_of(entry: _Entry) -> SpeedKey:
    return SpeedKey(str(entry["target"]), str(entry["fmt"]), str(entry["draft"]), str(entry["device"]))


def _speed(entry: _Entry) -> MeasuredSpeed:
    recent = entry["recent"]
    return MeasuredSpeed(_key_of(entry), len(recent), int(entry["answers"]),
                         sum(int(t) for t, _ in recent), sum(float(s) for _, s in recent),
                         str(entry["last_mode"]), float(entry["updated"]))


def record_answer(key: SpeedKey, stats: GenerationStats, path: Path | None = None) -> MeasuredSpeed | None:
    """Add one finished answer to `key`'s figures; returns the key's new MeasuredSpeed, or None
    when the answer was too short to count. OSError (a read-only data folder) passes through."""
    seconds = stats.seconds - stats.prefill_seconds
    if stats.new_tokens < MIN_TOKENS or not 0 < seconds < 1e9:
        return None
    target = path or measured_path()
    entries = _read(target)
    entry = next((e for e in entries if _key_of(e) == key), None)
    if entry is None:
        entry = {"target": key.target, "fmt": key.fmt, "draft": key.draft, "device": key.device,
                 "answers": 0, "recent": [], "last_mode": "", "updated": 0.0}  # the last two are set below
    else:
        entries.remove(entry)
    recent = list(entry["recent"])
    recent.append([int(stats.new_tokens), round(seconds, 4)])
    entry["recent"] = recent[-RECENT_ANSWERS:]
    entry["answers"] = int(entry["answers"]) + 1
    entry["last_mode"] = str(stats.mode)
    entry["updated"] = time.time()
    entries.insert(0, entry)
    _write(target, entries[:MAX_ENTRIES])
    return _speed(entry)


def measured_speed(target: Path | str, draft: Path | str | None, device: str | None = None,
                   fmt: str | None = None, path: Path | None = None) -> MeasuredSpeed | None:
    """What `target` (+ `draft`) measured here, or None. `device` None: any device kind;
    `fmt` None: whichever format ran last."""
    want_target, want_draft = _identity(target), _identity(draft) if draft else ""
    for entry in _read(path or measured_path()):  # newest first
        key = _key_of(entry)
        if (key.target, key.draft) != (want_target, want_draft):
            continue
        if (device is None or key.device == device_kind(device)) and (fmt is None or key.fmt == fmt):
            return _speed(entry)
    return None
