"""What the chat shows around a turn, end to end (real worker thread, tiny models, SQLite).

- The message box's placeholder is repainted when the model is ready (it kept saying
  "Loading the model…").
- Switching conversations while an answer streams: the answer goes on in the background, the
  sidebar marks and keeps the right conversation, coming back shows it (still streaming or done).
- An answer cut by the token limit says so and offers Continue, which writes on.
- Edit mode is shown, and can be left.
- A Stop starts no further target pass.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
from PySide6.QtCore import QEvent, QObject
from pytestqt.qtbot import QtBot

from app.composer import PLACEHOLDER
from app.conversations import ConversationStore
from app.main_window import MainWindow
from app.preferences import PreferencesStore

LOAD_MS = 120_000
ANSWER_MS = 120_000


class PaintLog(QObject):
    """The placeholder text each time the message box's viewport is painted."""

    def __init__(self, window: MainWindow) -> None:
        super().__init__()
        self.input = window.chat.composer.input
        self.painted: list[str] = []
        self.input.viewport().installEventFilter(self)

    def eventFilter(self, watched: QObject, event: QEvent) -> bool:  # noqa: N802
        if event.type() == QEvent.Type.Paint:
            self.painted.append(self.input.placeholderText())
        return False


@pytest.fixture
def open_window(qtbot: QtBot, make_host, conversations: ConversationStore) -> Iterator[Callable[..., MainWindow]]:
    windows: list[MainWindow] = []

    def open_(prefs: PreferencesStore, wait_loaded: bool = True) -> MainWindow:
        window = MainWindow(prefs, conversations, host=make_host())
        qtbot.addWidget(window)
        window.show()
        windows.append(window)
        if wait_loaded:
            qtbot.waitUntil(lambda: window.chat.model_state == "ready", timeout=LOAD_MS)
        return window

    yield open_
    for window in windows:
        window.close()


def test_the_message_box_says_ready_once_the_model_is_loaded(qtbot: QtBot, open_window,
                                                             chat_prefs: PreferencesStore) -> None:
    window = open_window(chat_prefs, wait_loaded=False)
    qtbot.waitExposed(window)
    log = PaintLog(window)
    window.chat.composer.input.viewport().update()
    qtbot.waitUntil(lambda: log.painted[-1:] == ["Loading the model…"], timeout=5_000)
    qtbot.waitUntil(lambda: window.chat.model_state == "ready", timeout=LOAD_MS)
    qtbot.waitUntil(lambda: log.painted[-1] == PLACEHOLDER, timeout=5_000)  # what the screen shows now
