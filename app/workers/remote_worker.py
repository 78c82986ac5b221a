"""The worker thread that talks to remote engines (RemoteWorker, RemoteHost)."""

from __future__ import annotations

import itertools
import logging
import threading

from PySide6.QtCore import QObject, Signal, Slot

from app.workers.engine_worker import EngineWorker
from app.workers.host import WorkerHost
from engine.errors import EngineError
from engine.types import GenerationRequest, RemoteModel

log = logging.getLogger(__name__)


class RemoteWorker(EngineWorker):
    """An EngineWorker for remote models (see the module docstring); lives in RemoteHost's thread.

    Signals (besides EngineWorker's):
        models_listed(int, object): request id and the server's model ids (a tuple of str).
        models_failed(int, str): request id and a user message.
    """

    models_listed = Signal(int, object)
    models_failed = Signal(int, str)

    @Slot(int, object, object, object)
    def generate_remote(self, request_id: int, request: GenerationRequest, cancel: threading.Event,
                        remote: RemoteModel) -> None:
        from engine.serving.remote import (
            RemoteEngine,  # httpx2: imported in this thread, when first used
        )

        self._engine = RemoteEngine(remote)
        self.generate(request_id, request, cancel)

    @Slot(int, str, str)
    def list_models(self, request_id: int, url: str, api_key: str) -> None:
        from engine.serving.remote import list_models

        try:
            self.models_listed.emit(request_id, list_models(url, api_key))
        except EngineError as exc:
            self.models_failed.emit(request_id, exc.user_message)
        except Exception as exc:  # noqa: BLE001 - a banner, never a crash
            log.exception("listing the models of %s failed", url)
            self.models_failed.emit(request_id, f"Listing the models failed: {type(exc).__name__}: {exc}")

    def _plan(self) -> None:
        """A remote server plans its own decoding."""


class RemoteHost(WorkerHost):
    """The GUI thread's handle on the RemoteWorker (the same pattern as EngineHost)."""

    worker: RemoteWorker

    _generate_requested = Signal(int, object, object, object)
    _list_requested = Signal(int, str, str)

    def __init__(self, parent: QObject | None = None) -> None:
        super().__init__(RemoteWorker(), "remote", parent)
        self._ids = itertools.count(1 << 30)  # far from EngineHost's (Qt ints are 32-bit): a page hears both
        self._cancel_event = threading.Event()
        self._generate_requested.connect(self.worker.generate_remote)
        self._list_requested.connect(self.worker.list_models)
        self._start()

    def generate(self, request: GenerationRequest, remote: RemoteModel) -> int:
        request_id = next(self._ids)
        self._cancel_event.set()
        self._cancel_event = threading.Event()
        self._generate_requested.emit(request_id, request, self._cancel_event, remote)
        return request_id

    def cancel_generation(self) -> None:
        self._cancel_event.set()

    def list_models(self, url: str, api_key: str) -> int:
        request_id = next(self._ids)
        self._list_requested.emit(request_id, url, api_key)
        return request_id

    def _cancel(self) -> None:
        self._cancel_event.set()
