"""One generation at a time, in arrival order, with a bounded queue: the API server's jobs
reach the one engine through this.

`GenerationQueue` owns one consumer thread. `submit()` (called on the server's event loop)
refuses at once when the model is not ready (NotReady -> 503) or the queue is full (QueueFull
-> 429); otherwise the job waits its turn. The consumer runs a job's choices one after another
through the backend (the Engine in `specchat serve`, the app's engine thread in the app) and
hands every event to the job's asyncio queue with `call_soon_threadsafe`, so the HTTP side
never blocks and the engine never waits for a slow client. A job's `cancel` Event (set when
its client disconnects, or on shutdown) drops it if it is still waiting and ends its
generation after the current step if it runs; the engine is then free for the next job.

What this does not do: HTTP (app.py), or load models (the owner sets the backend and the
model's state with `set_model`).
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

from engine.errors import EngineError
from engine.types import Completion, GenerationBackend, GenerationRequest, TokenEvent

log = logging.getLogger(__name__)

ModelStatus = Literal["loading", "ready", "failed", "none"]


@dataclass(frozen=True)
class ModelState:
    """What the server serves. id: the name clients pass as "model"; status "loading" (503 with
    `detail`, e.g. "layer 12 of 80"), "ready", "failed" (503 with the load's error) or "none"
    (no model chosen, in the app); context_length 0 when unknown; chat_template the model's
    ("" when unknown: no tools), which says whether it takes tools and how its answers are
    split (engine.serving.formats)."""

    id: str
    status: ModelStatus = "loading"
    detail: str = ""
    context_length: int = 0
    created: int = field(default_factory=lambda: int(time.time()))
    chat_template: str = field(default="", repr=False)


@dataclass(frozen=True)
class QueueState:
    """For status lines: whether a job runs now and how many wait behind it."""

    running: bool
    waiting: int


class QueueFull(Exception):
    """More jobs are waiting than the queue holds."""


class NotReady(Exception):
    """The model is loading, failed to load, or none is chosen (the message says which)."""


class Interrupted(Exception):
    """The server ended a running job before the model ended it (the message says why). Posted
    at once, so an open stream can say so without waiting for the engine's current step."""


@dataclass(frozen=True)
class Started:
    """The first choice passed validation and is running (its events follow)."""


@dataclass(frozen=True)
class Finished:
    """The job's last event: every choice's Completion has been posted (or an error was)."""


JobEvent = tuple[int, TokenEvent | Completion] | Started | Finished | BaseException


@dataclass(eq=False)
class Job:
    """One API request: its choices, where its events go, and its cancel Event.

    Times are time.monotonic(): `submitted`, `started` (its turn came), `stopped` (the first
    stop(): its client left or the server cut it). `cut` says why the server ended it ("" when
    its client left or it was not stopped): an answer ended that way is not complete."""

    id: int
    choices: tuple[GenerationRequest, ...]
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue[JobEvent]
    cancel: threading.Event = field(default_factory=threading.Event)
    submitted: float = field(default_factory=time.monotonic)
    started: float | None = None
    stopped: float | None = None
    cut: str = ""
    completions: list[Completion] = field(default_factory=list)

    def stop(self, cut: str = "") -> None:
        """Cancel the job (once; later calls change nothing): `cut` is the server's reason."""
        if not self.cancel.is_set():
            self.stopped = time.monotonic()
            self.cut = cut
            self.cancel.set()

    def waited(self) -> float:
        """Seconds from submission until its turn came, or until it was stopped waiting."""
        end = self.started if self.started is not None else self.stopped
        return (end if end is not None else time.monotonic()) - self.submitted

    def post(self, event: JobEvent) -> None:
        """From the consumer thread to the job's event loop (dropped once that loop is closed)."""
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:  # the server's loop has ended: nobody is listening any more
            self.stop()


class GenerationQueue:
    """Runs jobs one at a time in arrival order on one thread (see the module docstring).

    capacity: most jobs waiting behind the running one. on_change(QueueState) is called from
    whichever thread changed the queue (the owner marshals it, e.g. to the GUI thread), one call
    at a time, so the last call made carries the queue's state then;
    on_done(job, error) after each job, for logging."""

    def __init__(self, capacity: int = 32, on_change: Callable[[QueueState], None] | None = None,
                 on_done: Callable[[Job, BaseException | None], None] | None = None) -> None:
        if capacity < 0:
            raise ValueError("capacity must be 0 or more")
        self.capacity = capacity
        self._on_change = on_change
        self._on_done = on_done
        self._lock = threading.Condition()
        self._notifying = threading.Lock()
        self._waiting: collections.deque[Job] = collections.deque()
        self._running: Job | None = None
        self._backend: GenerationBackend | None = None
        self._model = ModelState("")
        self._closed = False
        self._ids = itertools.count(1)
        self._thread = threading.Thread(target=self._consume, name="specchat-serve", daemon=True)
        self._thread.start()

    # ---- the owner's side --------------------------------------------------------------------
    @property
    def model(self) -> ModelState:
        return self._model

    def set_model(self, model: ModelState, backend: GenerationBackend | None = None) -> None:
        """What is served now; a ready model needs its backend. Waiting jobs stay queued (they
        run on the new backend) unless the model is not ready, when they are refused."""
        assert model.status != "ready" or backend is not None, "a ready model needs a backend"
        with self._lock:
            self._model = model
            if backend is not None or model.status != "ready":
                self._backend = backend if model.status == "ready" else None
            dropped = list(self._waiting) if model.status != "ready" else []
            if dropped:
                self._waiting.clear()
            self._lock.notify_all()
        for job in dropped:
            job.post(NotReady(_not_ready_message(model)))
        if dropped:
            self._changed()

    def state(self) -> QueueState:
        with self._lock:
            return QueueState(self._running is not None, len(self._waiting))

    def close(self, wait: float | None = 10.0) -> None:
        """Cancel every job (waiting ones get NotReady) and end the consumer thread."""
        with self._lock:
            self._closed = True
            dropped = list(self._waiting)
            self._waiting.clear()
            running = self._running
            if running is not None:
                running.stop("the server is shutting down")
            self._lock.notify_all()
        if running is not None:
            running.post(Interrupted(running.cut))
        for job in dropped:
            job.stop("the server is shutting down")
            job.post(NotReady("The server is shutting down."))
        self._thread.join(wait)

    # ---- the server's side -------------------------------------------------------------------
    def submit(self, choices: tuple[GenerationRequest, ...], loop: asyncio.AbstractEventLoop) -> Job:
        """Queue a job; its events arrive in `job.events` on `loop`. Raises NotReady or QueueFull."""
        with self._lock:
            if self._closed:
                raise NotReady("The server is shutting down.")
            if self._model.status != "ready":
                raise NotReady(_not_ready_message(self._model))
            if len(self._waiting) >= self.capacity and (self._running is not None or self._waiting):
                raise QueueFull(f"The server is busy: {len(self._waiting)} requests are already waiting "
                                f"(--queue-size {self.capacity}). Retry later.")
            job = Job(next(self._ids), choices, loop, asyncio.Queue())
            self._waiting.append(job)
            self._lock.notify_all()
        self._changed()
        return job

    # ---- the consumer thread -----------------------------------------------------------------
    def _next(self) -> tuple[Job, GenerationBackend] | None:
        with self._lock:
            while True:
                if self._closed:
                    return None
                while self._waiting and self._waiting[0].cancel.is_set():  # its client left while it waited
                    gone = self._waiting.popleft()
                    gone.post(Finished())
                    self._report(gone, None)
                if self._waiting and self._backend is not None:
                    job = self._waiting.popleft()
                    self._running = job
                    return job, self._backend
                self._lock.wait()

    def _consume(self) -> None:
        while (item := self._next()) is not None:
            job, backend = item
            self._changed()
            error: BaseException | None = None
            try:
                self._run(job, backend)
            except BaseException as exc:  # noqa: BLE001 - handed to the request, which answers with it
                error = exc
                job.post(exc)
            job.post(Finished())
            with self._lock:
                self._running = None
            self._report(job, error)
            self._changed()

    def _run(self, job: Job, backend: GenerationBackend) -> None:
        job.started = time.monotonic()
        seen: dict[GenerationRequest, Completion] = {}
        for index, request in enumerate(job.choices):
            if request in seen:  # greedy choices with equal requests: the same text, decoded once
                done = seen[request]
                if done.text:
                    job.post((index, TokenEvent(done.token_ids, done.text)))
                job.post((index, done))
                job.completions.append(done)
                continue
            events = backend.generate(request, job.cancel)  # raises here for a bad request
            if index == 0:
                job.post(Started())
            for event in events:
                job.post((index, event))
                if isinstance(event, Completion):
                    job.completions.append(event)
                    seen[request] = event
            if job.cancel.is_set():
                break

    def _report(self, job: Job, error: BaseException | None) -> None:
        if self._on_done is not None:
            try:
                self._on_done(job, error)
            except Exception:  # noqa: BLE001 - a log line must never stop the queue
                log.exception("reporting job %d failed", job.id)

    def _changed(self) -> None:
        # one notification at a time, its state read inside: a state read by one thread and
        # handed on after another thread's newer one would leave the owner showing a stale state
        if self._on_change is not None:
            with self._notifying:
                self._on_change(self.state())


def _not_ready_message(model: ModelState) -> str:
    if model.status == "loading":
        return f"The model is still loading{': ' + model.detail if model.detail else ''}. Retry in a moment."
    if model.status == "failed":
        return f"The model failed to load: {model.detail}"
    return model.detail or "No model is loaded: choose one in SpecChat first."


def describe_error(error: BaseException) -> str:
    return error.user_message if isinstance(error, EngineError) else f"{type(error).__name__}: {error}"
