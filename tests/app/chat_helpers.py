"""Helpers for the chat tests (imported by name; tests/app is on sys.path like pages_fixtures)."""

from __future__ import annotations

from PySide6.QtCore import QObject, Signal, Slot

from app.main_window import MainWindow
from app.workers.engine_worker import EngineWorker
from app.workers.generation import GenerationHost


class WorkerEvents(QObject):
    """The worker's signals re-emitted (and recorded) in the GUI thread.

    pytest-qt's waitSignal and plain Python callables connected straight to a worker signal
    run in the worker thread (no receiver object), so tests listen here instead.
    """

    loaded = Signal(int, str, str, object, int, str)
    load_failed = Signal(int, str)
    tokens_generated = Signal(int, str, int)
    generation_finished = Signal(int, object)
    generation_failed = Signal(int, str)
    warmed_up = Signal()

    def __init__(self, host: GenerationHost) -> None:
        super().__init__()
        self.progress: list[object] = []
        self.chunks: list[tuple[int, str, int]] = []
        self.finished: dict[int, object] = {}
        self.failed: dict[int, str] = {}
        self.chosen: dict[int, object] = {}
        w = host.worker
        w.tokens_generated.connect(self._on_tokens)
        w.generation_finished.connect(self._on_finished)
        w.generation_failed.connect(self._on_failed)
        if isinstance(w, EngineWorker):  # the local engine's own signals
            w.load_progressed.connect(self._on_progress)
            w.loaded.connect(self._on_loaded)
            w.load_failed.connect(self._on_load_failed)
            w.warmed_up.connect(self._on_warmed_up)
            w.budget_chosen.connect(self._on_budget_chosen)

    @Slot(object)
    def _on_progress(self, p: object) -> None:
        self.progress.append(p)

    @Slot(int, str, str, object, int, str)
    def _on_loaded(self, i: int, t: str, d: str, p: object, context: int, template: str) -> None:
        self.loaded.emit(i, t, d, p, context, template)

    @Slot(int, str)
    def _on_load_failed(self, i: int, m: str) -> None:
        self.load_failed.emit(i, m)

    @Slot(int, str, int)
    def _on_tokens(self, i: int, t: str, n: int) -> None:
        self.chunks.append((i, t, n))
        self.tokens_generated.emit(i, t, n)

    @Slot(int, object)
    def _on_finished(self, i: int, c: object) -> None:
        self.finished[i] = c
        self.generation_finished.emit(i, c)

    @Slot(int, str)
    def _on_failed(self, i: int, m: str) -> None:
        self.failed[i] = m
        self.generation_failed.emit(i, m)

    @Slot(int, object)
    def _on_budget_chosen(self, i: int, choice: object) -> None:
        self.chosen[i] = choice

    @Slot()
    def _on_warmed_up(self) -> None:
        self.warmed_up.emit()


State = tuple[str, bool, str]  # on each render of the answer: its text, whether the block is open, the reasoning


def record_renders(window: MainWindow) -> list[State]:
    """The answer's State at each render of the chat's last message (its Thinking block)."""
    view, states = window.chat.view, []

    def on_rendered(text: str) -> None:
        block = view.messages[-1].thinking
        states.append((text, block is not None and block.is_open, block.text if block is not None else ""))

    view.rendered.connect(on_rendered)
    return states
