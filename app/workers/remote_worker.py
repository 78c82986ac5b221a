"""The worker thread that talks to remote engines: the OpenAI-compatible servers of Settings >
Engines (app/state/remote_engines.py has the entries and a conversation's choice).

`RemoteWorker` is a GenerationWorker (app/workers/generation.py) whose backend is an
engine.serving.remote.RemoteEngine, so a remote answer streams through the very code and
signals a local one does (coalesced `tokens_generated`, `generation_finished`,
`generation_failed` with the text kept); it adds listing a server's models. It has its own
thread (`RemoteHost`): a remote conversation never waits behind a local model's load or answer,
and the local engine's API requests never wait behind a remote answer. A remote server chooses
its own decoding: nothing here loads, plans or measures.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator

from PySide6.QtCore import QObject, Signal, Slot

from app.workers.generation import GenerationHost, GenerationWorker, log_failure
from engine.errors import EngineError
from engine.types import GenerationRequest, RemoteModel

log = logging.getLogger(__name__)


class RemoteWorker(GenerationWorker):
    """Streams answers from remote servers; lives in RemoteHost's thread.

    Signals (besides GenerationWorker's):
        models_listed(int, object): request id and the server's model ids (a tuple of str).
        models_failed(int, str): request id and a user message.
    """

    models_listed = Signal(int, object)
    models_failed = Signal(int, str)

    @Slot(int, object, object, object)
    def generate(self, request_id: int, request: GenerationRequest, cancel: threading.Event,
                 remote: RemoteModel) -> None:
        from engine.serving.remote import RemoteEngine  # httpx: imported in this thread, when first used

        self.stream(request_id, RemoteEngine(remote), request, cancel)

    @Slot(int, str, str)
    def list_models(self, request_id: int, url: str, api_key: str) -> None:
        from engine.serving.remote import list_models

        try:
            self.models_listed.emit(request_id, list_models(url, api_key))
        except Exception as exc:  # noqa: BLE001 - a banner, never a crash
            log_failure(f"listing the models of {url} failed", exc)
            self.models_failed.emit(request_id, exc.user_message if isinstance(exc, EngineError)
                                    else f"Listing the models failed: {type(exc).__name__}: {exc}")


class RemoteHost(GenerationHost):
    """The GUI thread's handle on the RemoteWorker (the same pattern as EngineHost). Pass the
    engine host's `ids` so a page that hears both never sees one id twice."""

    worker: RemoteWorker

    _generate_requested = Signal(int, object, object, object)
    _list_requested = Signal(int, str, str)

    def __init__(self, parent: QObject | None = None, ids: Iterator[int] | None = None) -> None:
        super().__init__(RemoteWorker(), "remote", parent, ids=ids)
        self._generate_requested.connect(self.worker.generate)
        self._list_requested.connect(self.worker.list_models)
        self._start()

    def generate(self, request: GenerationRequest, remote: RemoteModel) -> int:
        request_id, cancel = self._next_request()
        self._generate_requested.emit(request_id, request, cancel, remote)
        return request_id

    def list_models(self, url: str, api_key: str) -> int:
        request_id = next(self.ids)
        self._list_requested.emit(request_id, url, api_key)
        return request_id
