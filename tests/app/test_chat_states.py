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

import json

from PySide6.QtCore import QEvent, QObject, Qt
from pytestqt.qtbot import QtBot

from app.chat.composer import PLACEHOLDER
from app.main_window import MainWindow
from app.state.conversations import ConversationStore
from app.state.preferences_store import PreferencesStore

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




def test_the_message_box_says_ready_once_the_model_is_loaded(qtbot: QtBot, open_window,
                                                             chat_prefs: PreferencesStore) -> None:
    window = open_window(chat_prefs, wait_loaded=False)
    qtbot.waitExposed(window)
    log = PaintLog(window)
    window.chat.composer.input.viewport().update()
    qtbot.waitUntil(lambda: log.painted[-1:] == ["Loading the model…"], timeout=5_000)
    qtbot.waitUntil(lambda: window.chat.model_state == "ready", timeout=LOAD_MS)
    qtbot.waitUntil(lambda: log.painted[-1] == PLACEHOLDER, timeout=5_000)  # what the screen shows now


def _db(store: ConversationStore, conversation_id: int) -> list[tuple[str, str, bool]]:
    return [(m.role, m.content, m.complete) for m in store.messages(conversation_id)]


def _click(qtbot: QtBot, window: MainWindow, conversation_id: int) -> None:
    """A real mouse click on a conversation in the sidebar."""
    sidebar = window.chat.sidebar
    item = next(i for i in sidebar.conversation_items() if i.data(Qt.ItemDataRole.UserRole) == conversation_id)
    sidebar.list.scrollToItem(item)
    qtbot.mouseClick(sidebar.list.viewport(), Qt.MouseButton.LeftButton,
                     pos=sidebar.list.visualItemRect(item).center())
    qtbot.waitUntil(lambda: window.chat.conversation_id == conversation_id, timeout=5_000)


def test_switching_conversations_lets_the_answer_finish_in_the_background(
        qtbot: QtBot, open_window, chat_prefs: PreferencesStore, conversations: ConversationStore) -> None:
    chat_prefs.update(max_new_tokens=400)
    other = conversations.create("Other chat")
    conversations.add_message(other.id, "user", "an older question")
    conversations.add_message(other.id, "assistant", "an older answer")
    window = open_window(chat_prefs)
    chat = window.chat
    shown: list[str] = []
    chat.view.rendered.connect(shown.append)
    chat.new_conversation()
    chat.send("hello")
    first = chat.conversation_id
    qtbot.waitUntil(lambda: len(shown) >= 2, timeout=ANSWER_MS)

    _click(qtbot, window, other.id)
    sidebar = window.chat.sidebar
    assert sidebar.current_id() == other.id  # the highlight follows the shown conversation
    assert chat.busy and [m.text for m in chat.view.messages] == ["an older question", "an older answer"]
    writing = [i.text() for i in sidebar.conversation_items() if i.data(Qt.ItemDataRole.UserRole) == first]
    assert writing == ["✎ hello"]
    composer = chat.composer
    assert composer.stop_button.isVisibleTo(window) and "“hello”" in composer.input.placeholderText()
    saved = _db(conversations, first)[-1][1]
    qtbot.waitUntil(lambda: len(_db(conversations, first)[-1][1]) > len(saved), timeout=ANSWER_MS)  # goes on

    _click(qtbot, window, first)  # back while it is still being written: it streams on here
    answer = chat.view.messages[-1]
    if chat.busy:
        assert answer.note.text() == "writing…"
    with qtbot.waitSignal(chat.answer_finished, timeout=ANSWER_MS) as finished:
        pass
    assert finished.args == ["length"]
    role, text, complete = _db(conversations, first)[-1]
    assert role == "assistant" and complete and text == answer.text and len(text) > len(saved)
    assert sidebar.current_id() == first
    assert all(not i.text().startswith("✎") for i in sidebar.conversation_items())


def test_an_answer_finished_in_the_background_is_kept_whole(
        qtbot: QtBot, open_window, chat_prefs: PreferencesStore, conversations: ConversationStore) -> None:
    chat_prefs.update(max_new_tokens=60)
    window = open_window(chat_prefs)
    chat = window.chat
    chat.new_conversation()
    with qtbot.waitSignal(chat.answer_finished, timeout=ANSWER_MS) as finished:
        chat.send("hello")
        first = chat.conversation_id
        chat.new_conversation()  # away at once: the whole answer is written in the background
    assert finished.args == ["length"] and chat.conversation_id == 0
    role, text, complete = _db(conversations, first)[-1]
    assert role == "assistant" and complete and text
    assert chat.composer.send_button.isVisibleTo(window) and chat.composer.send_button.isEnabled()
    chat.open_conversation(first)
    answer = chat.view.messages[-1]
    assert answer.text == text and "token limit" in answer.note.text()
    qtbot.waitUntil(lambda: answer.continue_button.isVisibleTo(window), timeout=5_000)  # Qt shows new rows queued


def test_an_answer_cut_by_the_token_limit_says_so_and_continues(
        qtbot: QtBot, open_window, chat_prefs: PreferencesStore, conversations: ConversationStore) -> None:
    chat_prefs.update(max_new_tokens=12)
    window = open_window(chat_prefs)
    chat = window.chat
    with qtbot.waitSignal(chat.answer_finished, timeout=ANSWER_MS) as finished:
        chat.send("tell me a long story")
    assert finished.args == ["length"]
    cut = chat.view.messages[-1]
    assert cut.note.text() == "cut at the token limit (12 new tokens) · Continue writes on"
    assert cut.continue_button.isVisibleTo(window) and cut.regenerate_button.isVisibleTo(window)
    before = cut.text
    with qtbot.waitSignal(chat.answer_finished, timeout=ANSWER_MS):
        qtbot.mouseClick(cut.continue_button, Qt.MouseButton.LeftButton)
    assert chat.view.messages[-1] is cut and len(chat.view.messages) == 2  # the same answer, longer
    assert cut.text.startswith(before) and len(cut.text) > len(before)
    assert _db(conversations, chat.conversation_id) == [("user", "tell me a long story", True),
                                                        ("assistant", cut.text, True)]


def test_edit_mode_is_shown_and_can_be_left(qtbot: QtBot, open_window, chat_prefs: PreferencesStore) -> None:
    chat_prefs.update(max_new_tokens=6)
    window = open_window(chat_prefs)
    chat = window.chat
    with qtbot.waitSignal(chat.answer_finished, timeout=ANSWER_MS):
        chat.send("first try")
    composer, question = chat.composer, chat.view.messages[0]
    assert not composer.edit_bar.isVisibleTo(window)
    qtbot.mouseClick(question.edit_button, Qt.MouseButton.LeftButton)
    assert composer.edit_bar.isVisibleTo(window) and "replaces it" in composer.edit_label.text()
    assert question.note.text() == "editing" and composer.send_button.text() == "Send edit"
    assert composer.input.toPlainText() == "first try"
    window.activateWindow()
    qtbot.waitUntil(window.isActiveWindow, timeout=5_000)
    qtbot.keyClick(composer.input, Qt.Key.Key_Escape)  # Esc leaves edit mode
    assert not composer.edit_bar.isVisibleTo(window) and question.note.text() == ""
    assert composer.input.toPlainText() == "" and composer.send_button.text() == "Send"


def test_stop_starts_no_further_target_pass(qtbot: QtBot, open_window, chat_prefs: PreferencesStore,
                                            conversations: ConversationStore) -> None:
    """Esc while a long conversation's prompt is read, then while the answer streams: the pass
    under way finishes, no new one starts (a prefill used to run to its end)."""
    chat_prefs.update(max_new_tokens=1500)
    conv = conversations.create("Long")
    for i in range(2):  # ~1,400 prompt tokens: several prefill chunks, within the 2,048 context
        conversations.add_message(conv.id, "user", f"Question {i}: " + "tell me more about that, " * 20)
        conversations.add_message(conv.id, "assistant", f"Answer {i}: " + "here is a long reply, " * 25)
    window = open_window(chat_prefs)
    chat = window.chat
    chat.open_conversation(conv.id)
    engine = window.host.worker._engine
    passes: list[bool] = []  # per target pass: whether Stop had been pressed when it started
    forward = engine.target.forward

    def counted(*args, **kwargs):  # type: ignore[no-untyped-def]
        passes.append(window.host._generation_cancel.is_set())
        return forward(*args, **kwargs)

    engine.target.forward = counted
    try:
        for wait_for in ("prefill", "tokens"):
            passes.clear()
            shown: list[str] = []
            chat.view.rendered.connect(shown.append)
            chat.send("and now?")
            if wait_for == "prefill":
                qtbot.waitUntil(lambda: len(passes) >= 1, timeout=ANSWER_MS)
            else:
                qtbot.waitUntil(lambda: len(shown) >= 2, timeout=ANSWER_MS)
            with qtbot.waitSignal(chat.answer_finished, timeout=ANSWER_MS) as finished:
                qtbot.keyClick(window, Qt.Key.Key_Escape)
            chat.view.rendered.disconnect(shown.append)
            assert finished.args == ["cancelled"]
            assert sum(passes) <= 1, f"{sum(passes)} target passes started after Stop ({wait_for})"
            stats = json.loads(conversations.messages(conv.id)[-1].stats or "{}")
            assert stats["prompt_tokens"] > 1000  # a prompt of several prefill chunks
    finally:
        engine.target.forward = forward


def test_the_window_fits_half_a_screen_and_long_status_text_never_widens_it(
        qtbot: QtBot, open_window, make_prefs, conversations: ConversationStore) -> None:
    """It used to demand 1129x572, overlap the models page at 640x480, elide the sidebar's
    buttons to "R…e", and widen itself to fit a loading message."""
    from PySide6.QtWidgets import QAbstractButton

    from engine.types import LoadProgress

    conversations.create("A conversation with a title far longer than the sidebar is wide")
    window = open_window(make_prefs(), wait_loaded=False)
    window.resize(640, 480)
    for show in (window.show_chat, window.show_models, window.show_chat):
        show()
        qtbot.waitUntil(lambda: window.size().toTuple() == (640, 480), timeout=5_000)
        hint = window.minimumSizeHint()
        assert hint.width() <= 640 and hint.height() <= 480, (show.__name__, hint)
    buttons = window.chat.sidebar.findChildren(QAbstractButton)
    assert buttons and all(b.width() >= b.sizeHint().width() for b in buttons if b.isVisible())
    window.show_models()
    assert window.models_page.catalog.table.rowCount() > 0
    table = window.models_page.catalog.table
    assert table.viewport().height() >= 2 * table.rowHeight(0)  # rows show, not just a header
    window.show_chat()
    window.statusBar().show_load_progress(LoadProgress("target", 0.5, "streaming " + "layer weights " * 40))
    qtbot.wait(50)
    assert window.width() == 640


def test_the_starter_size_is_one_figure(qtbot: QtBot, open_window, make_prefs) -> None:
    from PySide6.QtWidgets import QLabel

    from engine.store.pypi import STARTER_GGUF_BYTES
    from engine.units import format_bytes

    window = open_window(make_prefs(), wait_loaded=False)
    texts = " ".join(label.text() for label in window.chat.empty.findChildren(QLabel))
    assert f"{format_bytes(STARTER_GGUF_BYTES)} from PyPI" in texts and "~93" not in texts
