"""The app's API server (Settings > Server): `specchat serve`'s OpenAI-compatible API over the
model loaded in the app.

It shares the one engine with the chat window and never touches it from another thread: every
API request goes to the EngineWorker (EngineHost.serve) and runs in the worker's thread, queued
with the chat's answers in arrival order. engine.serving's GenerationQueue hands the worker one
API request at a time, so a chat message waits behind at most the API answer in progress, and
API requests wait for the chat's. The status bar label says when the API is answering or
waiting. The server follows the app: it answers 503 while a model loads, after a load failed
or when none is chosen (and /v1/models then lists nothing), and serves the loaded pair under its
short name with the app's sampling settings as defaults (budget "auto" is resolved per request by
the worker's AutoBudget), and refuses a `max_tokens` beyond the loaded model's context, which
the worker's `loaded` signal carries with the model's chat template (as `specchat serve` does:
the template says whether the model takes tools and how its answers split into content,
reasoning and calls). Like `specchat serve` it refuses what a web page could send
(engine.serving.guard), letting in the hosts and web pages the Server tab allows.

What this does not do: load models (the main window does), show settings (server_tab.py) or
draw its status field (the status bar shows `status_text()` and `tooltip()` when
`status_changed` says so).
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Iterator

from PySide6.QtCore import QObject, Signal, Slot

from app.state.names import short_name
from app.state.preferences import Preferences
from app.workers.engine_worker import SERVE_STARTED, EngineHost
from engine.errors import Cancelled, EngineError
from engine.serving.guard import split_list
from engine.serving.protocol import RequestDefaults
from engine.serving.scheduler import GenerationQueue, ModelState, QueueState
from engine.serving.server import Server, ServeSettings
from engine.types import (
    Completion,
    GenerationRequest,
    LoadProgress,
    TokenEvent,
)

log = logging.getLogger(__name__)

POLL_SECONDS = 0.05
NO_MODEL = "No model is loaded in SpecChat: choose one on its Models page."


class WorkerBackend:
    """engine.types.GenerationBackend over the app's EngineWorker: generate() hands the request
    to the worker and waits (cancellably) until it runs there and passes validation."""

    def __init__(self, host: EngineHost) -> None:
        self._host = host

    def generate(self, request: GenerationRequest,
                 cancel: threading.Event | None = None) -> Iterator[TokenEvent | Completion]:
        cancel = cancel or threading.Event()
        mailbox: queue.Queue[object] = queue.Queue()
        self._host.serve(request, cancel, mailbox)
        while True:  # behind a chat answer or a model load: the client may leave meanwhile
            try:
                first = mailbox.get(timeout=POLL_SECONDS)
                break
            except queue.Empty:
                if cancel.is_set():
                    raise Cancelled("The request was cancelled before its turn came.") from None
        if isinstance(first, BaseException):
            raise first
        assert first == SERVE_STARTED, first
        return _events(mailbox)


def _events(mailbox: queue.Queue[object]) -> Iterator[TokenEvent | Completion]:
    while True:  # the worker always ends with a Completion or an exception
        item = mailbox.get()
        if isinstance(item, BaseException):
            raise item
        assert isinstance(item, (TokenEvent, Completion))
        yield item
        if isinstance(item, Completion):
            return


class ApiServer(QObject):
    """Runs the API server while the preferences say so (`apply`), over `host`'s engine.

    `url` is the API's base URL while it runs; `error` why it does not run (port in use, a
    network address without a key), else "".

    Signals:
        status_changed(str): the status field's new text ("" when the server is off);
            `tooltip()` explains it.
    """

    status_changed = Signal(str)
    _queue_changed = Signal(object)  # a QueueState, emitted from the server's threads

    def __init__(self, host: EngineHost, parent: QObject | None = None) -> None:
        super().__init__(parent)
        self._host = host
        self._backend = WorkerBackend(host)
        self._server: Server | None = None
        self._key: tuple[object, ...] | None = None
        self._prefs = Preferences()
        self._defaults = RequestDefaults()
        self._model = ModelState("", "none", NO_MODEL)
        self._queue_state = QueueState(False, 0)
        self._busy = False
        self.error = ""
        self._queue_changed.connect(self._on_queue_changed)
        worker = host.worker
        worker.load_progressed.connect(self._on_worker_load_progressed)
        worker.loaded.connect(self._on_worker_loaded)
        worker.load_failed.connect(self._on_worker_load_failed)
        worker.serving.connect(self._on_worker_serving)

    @property
    def url(self) -> str:
        return self._server.url if self._server is not None else ""

    @property
    def model(self) -> ModelState:
        return self._model

    # ---- settings -----------------------------------------------------------------------------
    def apply(self, prefs: Preferences) -> None:
        """Start, restart or stop the server as `prefs` say; the request defaults follow them."""
        self._prefs = prefs
        self._update_defaults()
        key = (prefs.server_enabled, prefs.server_port, prefs.server_api_key, prefs.server_lan,
               prefs.server_allowed_hosts, prefs.server_allowed_origins)
        if key == self._key:
            return
        self._key = key
        self.stop()
        self.error = ""
        if prefs.server_enabled:
            try:
                settings = ServeSettings(host="0.0.0.0" if prefs.server_lan else "127.0.0.1", port=prefs.server_port,
                                         api_key=prefs.server_api_key,
                                         allowed_hosts=split_list(prefs.server_allowed_hosts),
                                         allowed_origins=split_list(prefs.server_allowed_origins))
                queue_ = GenerationQueue(on_change=self._queue_changed.emit)
                queue_.set_model(self._model, self._backend if self._model.status == "ready" else None)
                try:
                    self._server = Server(settings, queue_, lambda: self._defaults)
                except EngineError:
                    queue_.close(wait=0)
                    raise
                self._server.start()
                log.info("API server at %s", self._server.url)
            except EngineError as exc:
                self.error = exc.user_message
                log.warning("the API server did not start: %s", exc.user_message)
        self._show()

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop()
            self._server = None
            self._queue_state = QueueState(False, 0)
        self._show()

    def _update_defaults(self) -> None:
        prefs = self._prefs
        request = GenerationRequest(max_new_tokens=prefs.max_new_tokens, sampling=prefs.sampling(),
                                    speculation=prefs.speculation())
        self._defaults = RequestDefaults(request=request)  # read by the server's thread: replaced, never changed

    # ---- the model ------------------------------------------------------------------------------
    def _set_model(self, model: ModelState) -> None:
        self._model = model
        if self._server is not None:
            self._server.queue.set_model(model, self._backend if model.status == "ready" else None)

    @Slot(object)
    def _on_worker_load_progressed(self, progress: LoadProgress) -> None:
        # the worker dropped the old pair; the new one's name comes with `loaded`: no id till then
        if self._model.status != "loading" or progress.message:
            self._set_model(ModelState("", "loading", progress.message or "loading"))

    @Slot(int, str, str, object, int, str)
    def _on_worker_loaded(self, _load_id: int, target: str, _draft: str, _placement: object, context: int,
                          chat_template: str) -> None:
        self._set_model(ModelState(short_name(target), "ready", context_length=context, chat_template=chat_template))

    @Slot(int, str)
    def _on_worker_load_failed(self, _load_id: int, message: str) -> None:
        self._set_model(ModelState("", "failed", message))  # nothing is loaded: nothing is listed

    # ---- the status field ----------------------------------------------------------------------
    @Slot(bool)
    def _on_worker_serving(self, busy: bool) -> None:
        self._busy = busy
        self._show()

    @Slot(object)
    def _on_queue_changed(self, state: QueueState) -> None:
        self._queue_state = state
        self._show()

    def status_text(self) -> str:
        if self.error:
            return "API: off (see Settings > Server)"
        if self._server is None:
            return ""
        waiting = self._queue_state.waiting
        if self._busy:
            return "API: answering a request" + (f", {waiting} waiting" if waiting else "")
        if self._queue_state.running:  # handed to the worker, which is busy with the chat
            return f"API: {waiting + 1} request{'s' if waiting else ''} waiting for the chat"
        return f"API: {self._server.url.removeprefix('http://').removesuffix('/v1')}"

    def tooltip(self) -> str:
        return self.error or (f"OpenAI-compatible API at {self.url}" if self.url else "")

    def _show(self) -> None:
        self.status_changed.emit(self.status_text())
