"""How long the GUI thread stalls while a model loads and while an answer streams.

A 5 ms heartbeat QTimer in the GUI thread records the longest gap between its ticks; the stall
is that gap less the interval. The goal is <= 50 ms (figures in the PR note); the assertion is only
a guard against a frozen window (work moved into the GUI thread), far above the goal, so a busy
CI machine does not make it flaky. Run with `-s` to see the figures.
"""

from __future__ import annotations

from pathlib import Path

from chat_helpers import WorkerEvents
from PySide6.QtCore import QElapsedTimer, QObject, QTimer
from pytestqt.qtbot import QtBot

from app.main_window import MainWindow
from app.state.conversations import ConversationStore
from engine.testing.synthetic import tiny_model

TICK_MS = 5
FROZEN_MS = 1000


class Heartbeat(QObject):
    def __init__(self) -> None:
        super().__init__()
        self.clock = QElapsedTimer()
        self.timer = QTimer(self)
        self.timer.setInterval(TICK_MS)
        self.timer.timeout.connect(self._on_timer_timeout)
        self.longest_ms = 0

    def start(self) -> None:
        self.longest_ms = 0
        self.clock.start()
        self.timer.start()

    def _on_timer_timeout(self) -> None:
        self.longest_ms = max(self.longest_ms, self.clock.restart())

    @property
    def stall_ms(self) -> int:
        return max(0, self.longest_ms - TICK_MS)


def test_ui_thread_stalls_while_loading_and_generating(qtbot: QtBot, make_host, make_prefs, model_cache: Path,
                                                       conversations: ConversationStore, tiny_target_path: Path, tiny_draft_path: Path,
                                                       record_property) -> None:
    # an 8-layer, 512-wide target (74 MB): long enough a load and slow enough steps to watch
    target = tiny_model("llama", seed=0, layers=8, hidden=512, cache_dir=model_cache)
    prefs = make_prefs(temperature=0.0, max_new_tokens=120, device="cpu", budget=8, max_depth=4)
    host = make_host()
    events = WorkerEvents(host)
    with qtbot.waitSignal(events.warmed_up, timeout=120_000):
        window = MainWindow(prefs, conversations, host=host)  # no model yet: it warms the engine up
    qtbot.addWidget(window)
    window.show()
    qtbot.waitExposed(window)
    beat = Heartbeat()

    beat.start()
    with qtbot.waitSignal(events.loaded, timeout=120_000):
        prefs.update(target=str(target), draft=str(tiny_draft_path))
    qtbot.waitUntil(lambda: window.chat.model_state == "ready", timeout=10_000)
    qtbot.wait(50)
    load_stall = beat.stall_ms

    beat.start()
    with qtbot.waitSignal(window.chat.answer_finished, timeout=120_000):
        window.chat.send("hello")
    qtbot.wait(50)
    generate_stall = beat.stall_ms
    answer = window.chat.view.messages[-1].text

    # a long answer from the fast 2-layer pair: ~1500 tokens of text re-rendered as it streams
    with qtbot.waitSignal(events.loaded, timeout=120_000):
        prefs.update(target=str(tiny_target_path), max_new_tokens=1500)
    qtbot.waitUntil(lambda: window.chat.model_state == "ready", timeout=10_000)
    window.chat.new_conversation()
    beat.start()
    with qtbot.waitSignal(window.chat.answer_finished, timeout=120_000):
        window.chat.send("hello")
    qtbot.wait(50)
    long_stall = beat.stall_ms
    long_answer = window.chat.view.messages[-1].text
    window.close()

    print(f"\nlongest GUI-thread stall: loading {load_stall} ms, generating {generate_stall} ms "
          f"({len(answer)} characters streamed), long answer {long_stall} ms ({len(long_answer)} characters)")
    record_property("load_stall_ms", load_stall)
    record_property("generate_stall_ms", generate_stall)
    record_property("long_answer_stall_ms", long_stall)
    assert load_stall < FROZEN_MS and generate_stall < FROZEN_MS and long_stall < FROZEN_MS
