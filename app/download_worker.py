"""Model downloads off the GUI thread: one `DownloadWorker` in one QThread, fed by a queue.

`DownloadQueue` is what widgets use: `enqueue(spec)`, `pause(spec)`, `resume(spec)`,
`cancel(spec)`, `shutdown()`. Requests reach the worker by a queued signal, so downloads run one
after another in the order asked for; pause and cancel are `threading.Event`s that
`engine.store.download_model` checks between chunks, so they act at once even mid-file. A paused
download holds the queue (its connection is closed; the data stays) until it is resumed or
cancelled. Signals carry plain data: `DownloadProgress` and strings.

The worker never blocks on the GUI and the GUI never blocks on the worker, except `shutdown()`,
which cancels everything (partial data is kept for a later resume) and joins the thread.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from PySide6.QtCore import QObject, Signal, Slot

from app.worker_host import WorkerHost
from engine.errors import Cancelled, EngineError
from engine.store import DownloadSettings, download_model
from engine.types import DownloadProgress

log = logging.getLogger(__name__)

StarterSource = Callable[[Path], Path]


@dataclass(frozen=True)
class DownloadOptions:
    """Where downloads go and how; the same for every download of one queue."""

    models_dir: Path
    endpoint: str | None = None
    settings: DownloadSettings = field(default_factory=DownloadSettings)
    hf_cache_dir: Path | None = None
    starter_source: StarterSource | None = None
    keep_partial: bool = True


@dataclass
class _Controls:
    cancel: threading.Event = field(default_factory=threading.Event)
    pause: threading.Event = field(default_factory=threading.Event)


class DownloadWorker(QObject):
    """Runs downloads in its own thread, one at a time.

    Signals:
        progressed(object): a DownloadProgress.
        finished(str, str): model spec, local path.
        failed(str, str): model spec, a message the user can act on.
        cancelled(str): model spec.
    """

    progressed = Signal(object)
    finished = Signal(str, str)
    failed = Signal(str, str)
    cancelled = Signal(str)

    def __init__(self, options: DownloadOptions, controls: dict[str, _Controls], lock: threading.Lock) -> None:
        super().__init__()
        self._options = options
        self._controls = controls
        self._lock = lock

    @Slot(str)
    def download(self, spec: str) -> None:
        with self._lock:
            controls = self._controls.get(spec)
        if controls is None or controls.cancel.is_set():  # cancelled while waiting its turn
            self._forget(spec)
            self.cancelled.emit(spec)
            return
        opts = self._options
        try:
            path = download_model(
                spec, opts.models_dir, on_progress=self.progressed.emit, cancel=controls.cancel,
                pause=controls.pause, endpoint=opts.endpoint, settings=opts.settings,
                hf_cache_dir=opts.hf_cache_dir, starter_source=opts.starter_source,
                keep_partial=opts.keep_partial,
            )
        except Cancelled:
            self._forget(spec)
            self.cancelled.emit(spec)
        except EngineError as exc:
            self._forget(spec)
            self.failed.emit(spec, exc.user_message)
        except Exception as exc:  # a bug or an unexpected OS error: report it, keep the thread alive
            log.exception("download of %s failed", spec)
            self._forget(spec)
            self.failed.emit(spec, f"The download of {spec} failed unexpectedly ({exc}). Try again.")
        else:
            self._forget(spec)
            self.finished.emit(spec, str(path))

    def _forget(self, spec: str) -> None:
        with self._lock:
            self._controls.pop(spec, None)


class DownloadQueue(WorkerHost):
    """The GUI-side handle on one download thread.

    Signals:
        progressed(object): a DownloadProgress (model_id is the catalog id or the spec).
        queued(str): spec accepted; it starts when the ones before it are done.
        finished(str, str): spec, local path.
        failed(str, str): spec, message.
        cancelled(str): spec.
    """

    progressed = Signal(object)
    queued = Signal(str)
    finished = Signal(str, str)
    failed = Signal(str, str)
    cancelled = Signal(str)
    _requested = Signal(str)

    worker: DownloadWorker

    def __init__(self, options: DownloadOptions, parent: QObject | None = None) -> None:
        lock, controls = threading.Lock(), {}
        super().__init__(DownloadWorker(options, controls, lock), "downloads", parent)
        self._lock = lock
        self._controls: dict[str, _Controls] = controls
        self._options = options
        self._requested.connect(self.worker.download)  # queued: the worker lives in the thread
        self.worker.progressed.connect(self.progressed)
        self.worker.finished.connect(self.finished)
        self.worker.failed.connect(self.failed)
        self.worker.cancelled.connect(self.cancelled)
        self._start()

    @property
    def options(self) -> DownloadOptions:
        return self._options

    def is_active(self, spec: str) -> bool:
        """Queued, running or paused."""
        with self._lock:
            return spec in self._controls

    def active(self) -> list[str]:
        with self._lock:
            return list(self._controls)

    def enqueue(self, spec: str) -> bool:
        """Ask for `spec`; False if it is already queued or running."""
        with self._lock:
            if spec in self._controls:
                return False
            self._controls[spec] = _Controls()
        self.queued.emit(spec)
        self._requested.emit(spec)
        return True

    def pause(self, spec: str) -> None:
        with self._lock:
            controls = self._controls.get(spec)
        if controls is not None:
            controls.pause.set()

    def resume(self, spec: str) -> None:
        with self._lock:
            controls = self._controls.get(spec)
        if controls is not None:
            controls.pause.clear()

    def is_paused(self, spec: str) -> bool:
        with self._lock:
            controls = self._controls.get(spec)
        return controls is not None and controls.pause.is_set()

    def cancel(self, spec: str) -> None:
        with self._lock:
            controls = self._controls.get(spec)
        if controls is not None:
            controls.cancel.set()

    def _cancel(self) -> None:
        """Cancel every download (partial data is kept for a later resume)."""
        with self._lock:
            for controls in self._controls.values():
                controls.cancel.set()


def describe_progress(event: DownloadProgress) -> str:
    """'1.2 GB of 4.0 GB · 35.1 MB/s · 1 min 20 s left' (the models page's and wizard's wording)."""
    from engine.units import format_bytes

    if event.state == "done":
        return "Done"
    if event.state == "paused":
        return f"Paused at {format_bytes(event.bytes_done)} of {format_bytes(event.bytes_total)}"
    if event.state in ("failed", "cancelled"):
        return event.message or event.state.capitalize()
    if event.state == "checking":
        return event.message or "Checking"
    parts = []
    if event.bytes_total:
        parts.append(f"{format_bytes(event.bytes_done)} of {format_bytes(event.bytes_total)}")
    if event.bytes_per_second > 0:
        parts.append(f"{format_bytes(event.bytes_per_second)}/s")
    if event.eta_seconds is not None:
        parts.append(f"{format_duration(event.eta_seconds)} left")
    if event.state in ("verifying", "retrying") and event.message:
        parts.append(event.message)
    return " · ".join(parts) or event.message or event.state.capitalize()


def format_duration(seconds: float) -> str:
    seconds = max(0, round(seconds))
    if seconds < 60:
        return f"{seconds} s"
    minutes, seconds = divmod(seconds, 60)
    if minutes < 60:
        return f"{minutes} min {seconds:02d} s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes:02d} min"


def progress_fraction(event: DownloadProgress) -> float:
    if event.state == "done":
        return 1.0
    return min(1.0, event.bytes_done / event.bytes_total) if event.bytes_total else 0.0
