"""Models on disk, read off the GUI thread: LM Studio's and Ollama's folders, and whether the
local models' files are whole.

`ScanWorker.scan` runs engine.store.discover.discover_models (walks the other apps' folders and
reads each GGUF's header: seconds on a large or network folder) and
engine.store.integrity.model_damage for each model path it is given (headers and sizes, never
the weights), and emits one `DiskScan`. It keeps one HeaderFacts, so a header is read again
only when its file changed. `ScanHost` is the GUI side: `scan(paths)` returns a request id the
result echoes (a newer scan makes an older result stale).

What this does not do: list the models folder itself (fast, the page does it), or decide
anything about what is shown.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from PySide6.QtCore import QObject, Signal, Slot

from app.workers.host import WorkerHost
from engine.store import Discovery, HeaderFacts, discover_models
from engine.store.integrity import model_damage

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DiskScan:
    """found: LM Studio's and Ollama's models and the problems met reading them; damage: why
    each damaged model (by the path asked about) is damaged (whole ones are absent)."""

    found: Discovery
    damage: Mapping[Path, str] = field(default_factory=dict)


class ScanWorker(QObject):
    """Reads the disk in its own thread. Signals: scanned(int, object): request id, DiskScan."""

    scanned = Signal(int, object)

    def __init__(self) -> None:
        super().__init__()
        self._facts = HeaderFacts()  # used in this thread only

    @Slot(int, object)
    def scan(self, request_id: int, paths: tuple[Path, ...]) -> None:
        try:
            found = discover_models(facts=self._facts)
        except Exception:  # noqa: BLE001 - the other apps' models are a convenience, never a crash
            log.exception("reading LM Studio's and Ollama's folders failed")
            found = Discovery((), ("LM Studio's and Ollama's folders could not be read; details are in the log.",))
        damage = {path: why for path in paths if (why := model_damage(path))}
        self.scanned.emit(request_id, DiskScan(found, damage))


class ScanHost(WorkerHost):
    """The GUI thread's handle on the ScanWorker. Signals: scanned(int, object) (the worker's,
    queued into the GUI thread)."""

    worker: ScanWorker

    _scan_requested = Signal(int, object)

    def __init__(self, parent: QObject | None = None) -> None:
        super().__init__(ScanWorker(), "disk-scan", parent)
        self._scan_requested.connect(self.worker.scan)
        self._last = 0
        self._start()

    def scan(self, paths: tuple[Path, ...]) -> int:
        """Queue a scan that also checks `paths` for damage; returns its request id."""
        self._last += 1
        self._scan_requested.emit(self._last, paths)
        return self._last

    @property
    def latest(self) -> int:
        """The id of the newest scan asked for (its result is the one that counts)."""
        return self._last
