"""One generation worker for any backend, and the GUI side's handle on it.

`GenerationWorker` streams a backend's `generate(request, cancel)` (the local Engine behind
engine.decoding.auto_budget.AutoBudget, a remote server, a test double) in its own thread:
text coalesced to at most one `tokens_generated` per `coalesce_seconds`, so a fast model cannot
flood the GUI's event queue; `generation_finished` with the Completion (a stopped answer is a
Completion too, finish reason "cancelled"), or `generation_failed` with a user message, the text
written so far sent first. Cancellation is a `threading.Event` the GUI sets directly, because a
queued "cancel" would wait behind the very call it should stop. The local worker
(engine_worker) adds loading and the measured speeds on top; the remote one (remote_worker)
adds listing a server's models.

`GenerationHost` draws request ids from one counter, which the hosts of one window share (the
chat page hears every worker: no two requests may share an id), and keeps one cancel Event per
request, so a stopped answer stays stopped even if the next request is queued before the
worker reaches its next cancellation check.

What this does not do: touch widgets, the database or preferences; choose the tree budget
(AutoBudget does, in the local worker).
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Iterator
from typing import Protocol

from PySide6.QtCore import QObject, Signal

from app.workers.host import WorkerHost
from engine.errors import EngineError
from engine.types import Completion, GenerationRequest, TokenEvent

log = logging.getLogger(__name__)

COALESCE_SECONDS = 0.03


class Backend(Protocol):
    """engine.types.GenerationBackend: what the worker streams."""

    def generate(self, request: GenerationRequest,
                 cancel: threading.Event | None = None) -> Iterator[TokenEvent | Completion]: ...


def user_message(exc: BaseException) -> str:
    """What the user reads about a failure: an EngineError's own message, else a pointer to the log."""
    if isinstance(exc, EngineError):
        return exc.user_message
    return f"Unexpected error: {type(exc).__name__}: {exc}. Details are in the log."


def log_failure(what: str, exc: BaseException) -> None:
    """An EngineError is a condition the user is told about (a server that went away, a prompt
    too long): one WARNING line. Anything else is a bug: ERROR with its traceback."""
    if isinstance(exc, EngineError):
        log.warning("%s: %s", what, exc.user_message)
    else:
        log.error("%s", what, exc_info=exc)


class GenerationWorker(QObject):
    """Streams a backend's answers (see the module docstring); lives in a worker QThread.

    Signals:
        tokens_generated(int, str, int): request id, new text, new token count.
        generation_finished(int, object): request id and the Completion.
        generation_failed(int, str): request id and a user message.
    """

    tokens_generated = Signal(int, str, int)
    generation_finished = Signal(int, object)
    generation_failed = Signal(int, str)

    def __init__(self, coalesce_seconds: float = COALESCE_SECONDS) -> None:
        super().__init__()
        self.coalesce_seconds = coalesce_seconds

    def stream(self, request_id: int, backend: Backend, request: GenerationRequest,
               cancel: threading.Event) -> Completion | None:
        """Run one request to its end, emitting as it goes; the Completion, or None on failure."""
        pending, pending_tokens, last = "", 0, 0.0
        try:
            events = backend.generate(request, cancel)  # a request the backend refuses raises here
            self._started(request_id, request)
            for event in events:
                if isinstance(event, TokenEvent):
                    pending += event.text
                    pending_tokens += len(event.token_ids)
                    now = time.monotonic()
                    if pending and now - last >= self.coalesce_seconds:
                        self.tokens_generated.emit(request_id, pending, pending_tokens)
                        pending, pending_tokens, last = "", 0, now
                elif isinstance(event, Completion):
                    if pending or pending_tokens:
                        self.tokens_generated.emit(request_id, pending, pending_tokens)
                    self._completed(event)  # first: what the GUI shows next includes this answer
                    self.generation_finished.emit(request_id, event)
                    return event
            raise AssertionError("a backend's generate() ends with a Completion")
        except Exception as exc:  # noqa: BLE001 - every failure becomes a banner, never a crash
            log_failure("generation failed", exc)
            if pending:
                self.tokens_generated.emit(request_id, pending, pending_tokens)
            self.generation_failed.emit(request_id, user_message(exc))
            return None

    def _started(self, request_id: int, request: GenerationRequest) -> None:
        """The backend accepted the request (subclasses: say how it will run)."""

    def _completed(self, completion: Completion) -> None:
        """An answer ended, before `generation_finished` (subclasses: record it)."""


class GenerationHost(WorkerHost):
    """The GUI thread's handle on a GenerationWorker: request ids and per-request cancel Events.

    `ids`: the request-id counter; pass another host's `ids` so the two never hand out the same
    id (None: a counter of its own, from 1)."""

    worker: GenerationWorker

    def __init__(self, worker: GenerationWorker, name: str, parent: QObject | None = None,
                 ids: Iterator[int] | None = None, join_on_quit: bool = True) -> None:
        super().__init__(worker, name, parent, join_on_quit=join_on_quit)
        self.ids = ids if ids is not None else itertools.count(1)
        self._generation_cancel = threading.Event()

    def _next_request(self) -> tuple[int, threading.Event]:
        """A new request id and its cancel Event; the previous request's Event is set."""
        self._generation_cancel.set()
        self._generation_cancel = threading.Event()
        return next(self.ids), self._generation_cancel

    def cancel_generation(self) -> None:
        self._generation_cancel.set()

    def _cancel(self) -> None:
        self._generation_cancel.set()
