"""The one wiring of a worker thread, used by the engine, the downloads and the measurements.

A worker QObject lives in its own QThread; the GUI-side host sends it requests through queued
signals (subclasses connect them to the worker's slots before `_start()`), reads its results
from its signals (delivered queued in the GUI thread), cancels through `threading.Event`s the
worker checks (a queued "cancel" would wait behind the very call it should stop), and
`shutdown()` cancels and joins the thread. The worker is deleted with its thread.
"""

from __future__ import annotations

import logging

from PySide6.QtCore import QCoreApplication, QObject, QThread, Signal, Slot

log = logging.getLogger(__name__)


class _Quitter(QObject):
    """Ends its thread's event loop from inside it, so a quit queued behind other requests
    runs after them (QThread.quit() from another thread drops what the worker's slot-in-progress
    had queued behind it: Qt delivers events posted during a slot only in the next round, and
    the loop checks its exit flag first)."""

    @Slot()
    def quit(self) -> None:
        thread = QThread.currentThread()
        if thread is not None:
            thread.quit()


class WorkerHost(QObject):
    """Owns one worker QObject and the QThread it runs in (see the module docstring).

    join_on_quit: shut down when the application quits (hosts the main window does not stop
    itself); the engine's host is stopped by the main window, which must know whether the
    thread ended in time."""

    _quit_requested = Signal()

    def __init__(self, worker: QObject, name: str, parent: QObject | None = None, join_on_quit: bool = True) -> None:
        super().__init__(parent)
        self.worker = worker
        self._thread = QThread()
        self._thread.setObjectName(name)
        worker.moveToThread(self._thread)
        self._thread.finished.connect(worker.deleteLater)
        self._quitter = _Quitter()
        self._quitter.moveToThread(self._thread)
        self._thread.finished.connect(self._quitter.deleteLater)
        self._quit_requested.connect(self._quitter.quit)
        if join_on_quit and (app := QCoreApplication.instance()) is not None:
            app.aboutToQuit.connect(self.shutdown)

    def _start(self) -> None:
        """Start the thread: call once the request signals are connected."""
        self._thread.start()

    def _cancel(self) -> None:
        """Set every cancel event the worker checks (subclasses)."""

    def shutdown(self, wait_ms: int | None = None) -> bool:
        """Cancel what runs and end the thread, waiting up to `wait_ms` (None: until it ends).
        Idempotent. Requests queued before it still run (the app's last "save the caches");
        False when the thread still runs after `wait_ms` (a step inside a library that cannot be
        interrupted): the caller must then not destroy it."""
        self._cancel()
        if not self._thread.isRunning():
            return True
        self._quit_requested.emit()  # queued: behind the requests already sent
        if self._thread.wait() if wait_ms is None else self._thread.wait(wait_ms):
            return True
        log.warning("the %s thread did not stop in %d ms", self._thread.objectName(), wait_ms)
        return False
