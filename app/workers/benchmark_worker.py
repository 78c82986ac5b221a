"""Measurements off the GUI thread: the hardware benchmark and the short calibration run.

Same pattern as the engine and download workers: a worker QObject lives in its own QThread, the
request arrives by a queued signal, cancel is a `threading.Event` the engine checks, and signals
carry plain data (floats, strings, frozen dataclasses). `TaskRunner` is the GUI-side handle:
`start(arg)`, `cancel()`, `shutdown()`.

- `BenchmarkWorker`: `engine.planning.profile.measure_hardware(...)`, then `save_profile`; its result
  is the `HardwareProfile`.
- `CalibrationWorker`: loads a pair with `engine.decoding.pair.load_engine`, generates a few tokens
  greedily through AutoBudget (budget "auto" as the chat runs it) and reports tokens per pass and
  tokens per second (`CalibrationResult`); the speed is
  recorded as this computer's first measurement of the pair (engine.planning.measured), so the
  predictions give way to it. The engine is dropped afterwards: the chat worker loads its own.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from PySide6.QtCore import QObject, Signal, Slot

from app.workers.host import WorkerHost
from engine.errors import Cancelled, EngineError
from engine.planning.calibration import record_calibration
from engine.planning.measured import MeasuredSpeed, SpeedKey, record_answer, speed_key
from engine.planning.profile import save_profile
from engine.types import (
    Completion,
    GenerationRequest,
    GenerationStats,
    LoadProgress,
    LoadSettings,
    SamplingSettings,
    SpeculationSettings,
)

log = logging.getLogger(__name__)


class TaskWorker(QObject):
    """One kind of long task run in a worker thread. Subclasses implement `work`.

    Signals:
        progressed(float, str): fraction 0..1 and a line for the user.
        finished(object): the task's result.
        failed(str): a message the user can act on.
        cancelled(): the task stopped at the user's request.
    """

    progressed = Signal(float, str)
    finished = Signal(object)
    failed = Signal(str)
    cancelled = Signal()

    def __init__(self) -> None:
        super().__init__()
        self.cancel_event = threading.Event()

    def work(self, arg: Any) -> object:
        raise NotImplementedError

    @Slot(object)
    def run(self, arg: object) -> None:
        try:
            result = self.work(arg)
        except Cancelled:
            self.cancelled.emit()
        except EngineError as exc:
            self.failed.emit(exc.user_message)
        except Exception as exc:  # keep the thread alive and tell the user
            log.exception("%s failed", type(self).__name__)
            self.failed.emit(f"{type(exc).__name__}: {exc}")
        else:
            self.finished.emit(result)


class TaskRunner(WorkerHost):
    """Owns one TaskWorker and its thread (worker_host.WorkerHost).

    Signals: progressed(float, str), finished(object), failed(str), cancelled() — forwarded
    from the worker, delivered in the GUI thread.
    """

    worker: TaskWorker

    progressed = Signal(float, str)
    finished = Signal(object)
    failed = Signal(str)
    cancelled = Signal()
    _requested = Signal(object)

    def __init__(self, worker: TaskWorker, name: str, parent: QObject | None = None) -> None:
        super().__init__(worker, name, parent)
        self._running = False
        self._requested.connect(worker.run)
        worker.progressed.connect(self.progressed)
        for signal, slot in ((worker.finished, self.finished), (worker.failed, self.failed),
                             (worker.cancelled, self.cancelled)):
            signal.connect(self._on_worker_done)
            signal.connect(slot)
        self._start()

    @property
    def running(self) -> bool:
        return self._running

    def start(self, arg: object = None) -> bool:
        """Start the task; False if it is already running."""
        if self._running:
            return False
        self._running = True
        self.worker.cancel_event.clear()
        self._requested.emit(arg)
        return True

    def cancel(self) -> None:
        self.worker.cancel_event.set()

    def _cancel(self) -> None:
        self.worker.cancel_event.set()

    def _on_worker_done(self, *args: object) -> None:
        self._running = False


class BenchmarkWorker(TaskWorker):
    """`run(options)`: options is a mapping of extra keyword arguments for measure_hardware
    (e.g. a quick layer shape in tests), or None."""

    def work(self, arg: Any) -> object:
        from engine.planning.measure import (
            measure_hardware,  # imports torch: in the worker thread
        )

        options: Mapping[str, Any] = arg or {}
        profile = measure_hardware(
            progress=lambda fraction, text: self.progressed.emit(float(fraction), str(text)),
            cancel=self.cancel_event, **options,
        )
        save_profile(profile)
        return profile


@dataclass(frozen=True)
class CalibrationRequest:
    target: Path
    draft: Path | None = None
    load_settings: LoadSettings = field(default_factory=LoadSettings)
    speculation: SpeculationSettings = field(default_factory=SpeculationSettings)
    max_new_tokens: int = 24
    prompt: str = "The three most useful things to know about a new city are"


@dataclass(frozen=True)
class CalibrationResult:
    new_tokens: int
    tokens_per_pass: float
    tokens_per_second: float
    seconds: float
    load_seconds: float
    text: str
    placement: str = ""
    measured: MeasuredSpeed | None = None  # the pair's measured speed here, this run included


class CalibrationWorker(TaskWorker):
    """`run(CalibrationRequest)`: load the pair, generate a few tokens, report the speed."""

    def work(self, arg: Any) -> object:
        from engine.decoding.auto_budget import AutoBudget  # imports torch: in the worker thread
        from engine.decoding.pair import load_engine

        request: CalibrationRequest = arg
        started = time.monotonic()

        def on_load(event: LoadProgress) -> None:
            self.progressed.emit(0.8 * event.fraction, event.message or f"Loading the {event.stage}")

        engine = load_engine(request.target, request.draft, request.load_settings, progress=on_load,
                             cancel=self.cancel_event)
        load_seconds = time.monotonic() - started
        self.progressed.emit(0.8, "Generating a few test tokens")
        generation = GenerationRequest(
            raw_prompt=request.prompt, max_new_tokens=request.max_new_tokens,
            sampling=SamplingSettings(temperature=0.0),
            speculation=request.speculation if request.draft is not None
            else SpeculationSettings(mode="autoregressive"),
        )
        produced = 0
        completion: Completion | None = None
        for event in AutoBudget(engine).generate(generation, self.cancel_event):  # budget 0: as the chat runs it
            if isinstance(event, Completion):
                completion = event
            else:
                produced += len(event.token_ids)
                fraction = 0.8 + 0.2 * min(1.0, produced / request.max_new_tokens)
                self.progressed.emit(fraction, f"{produced} of {request.max_new_tokens} test tokens")
        assert completion is not None, "generate() always ends with a Completion"
        if completion.finish_reason == "cancelled":
            raise Cancelled("The calibration was cancelled.")
        stats = completion.stats
        measured = _feed_planner(speed_key(request.target, request.draft, engine.placement), stats)
        self.progressed.emit(1.0, "Done")
        return CalibrationResult(
            new_tokens=stats.new_tokens, tokens_per_pass=stats.tokens_per_pass,
            tokens_per_second=stats.tokens_per_second, seconds=stats.seconds, load_seconds=load_seconds,
            text=completion.text, placement=stats.placement.describe() if stats.placement else "",
            measured=measured,
        )


def _feed_planner(key: SpeedKey, stats: GenerationStats) -> MeasuredSpeed | None:
    """Give the measured acceptance to the planner's calibration and the measured speed to
    the predictions; the result is shown either way."""
    try:
        record_calibration(stats)
        return record_answer(key, stats)
    except OSError:
        log.exception("the planner could not record the calibration")
        return None


def benchmark_runner(parent: QObject | None = None) -> TaskRunner:
    return TaskRunner(BenchmarkWorker(), "benchmark", parent)


def calibration_runner(parent: QObject | None = None) -> TaskRunner:
    return TaskRunner(CalibrationWorker(), "calibration", parent)
