"""The chat window end to end: real worker thread, real tiny engine, real SQLite.

send -> tokens stream -> stop (Esc) -> regenerate; edit-and-resend; conversations survive a new
window over the same database; errors as a banner; the no-model empty state; shortcuts; copy.
"""

from __future__ import annotations

import json
from pathlib import Path

from answers import Answers
from PySide6.QtCore import Qt, QUrl
from PySide6.QtGui import QGuiApplication
from PySide6.QtWidgets import (
    QAbstractButton,
    QComboBox,
    QLineEdit,
    QListWidget,
    QPlainTextEdit,
    QTextBrowser,
)
from pytestqt.qtbot import QtBot

from app.main_window import MainWindow
from app.state.conversations import ConversationStore
from app.state.preferences_store import PreferencesStore

LOAD_MS = 120_000




def _db_messages(store: ConversationStore, window: MainWindow) -> list[tuple[str, str, bool]]:
    return [(m.role, m.content, m.complete) for m in store.messages(window.chat.conversation_id)]


def _type_and_send(qtbot: QtBot, window: MainWindow, text: str) -> None:
    box = window.chat.composer.input
    box.setFocus()
    qtbot.keyClicks(box, text)
    qtbot.keyClick(box, Qt.Key.Key_Return)


def test_send_stream_stop_regenerate(qtbot: QtBot, open_window, chat_prefs: PreferencesStore,
                                     conversations: ConversationStore) -> None:
    window = open_window(chat_prefs)
    chat = window.chat
    shown: list[str] = []
    chat.view.rendered.connect(shown.append)
    # Shift+Enter is a newline, Enter sends
    box = chat.composer.input
    qtbot.keyClicks(box, "hello")
    qtbot.keyClick(box, Qt.Key.Key_Return, Qt.KeyboardModifier.ShiftModifier)
    qtbot.keyClicks(box, "there")
    assert box.toPlainText() == "hello\nthere" and not chat.busy
    qtbot.keyClick(box, Qt.Key.Key_Return)
    assert chat.busy and box.toPlainText() == ""
    qtbot.waitUntil(lambda: len(shown) >= 2, timeout=60_000)  # streamed in several renders
    assert shown[1].startswith(shown[0]) and len(shown[1]) > len(shown[0])
    # what is shown is already in the database, and the answer is marked incomplete
    role, text, complete = _db_messages(conversations, window)[-1]
    assert role == "assistant" and not complete and text.startswith(shown[-1][: len(text)])

    with qtbot.waitSignal(chat.answer_finished, timeout=60_000) as blocker:
        qtbot.keyClick(window, Qt.Key.Key_Escape)
    assert blocker.args == ["cancelled"]
    stopped = chat.view.messages[-1]
    assert stopped.note.text() == "stopped" and not stopped.complete
    assert _db_messages(conversations, window) == [("user", "hello\nthere", True), ("assistant", stopped.text, False)]
    assert stopped.text == shown[-1] and stopped.text
    assert stopped.regenerate_button.isVisibleTo(window) and chat.view.messages[0].edit_button.isVisibleTo(window)
    assert "tok/s" in window.status.speed.text()

    chat_prefs.update(max_new_tokens=12)
    with qtbot.waitSignal(chat.answer_finished, timeout=60_000) as blocker:
        qtbot.mouseClick(stopped.regenerate_button, Qt.MouseButton.LeftButton)
    assert blocker.args == ["length"]
    msgs = _db_messages(conversations, window)
    assert [(r, c) for r, _, c in msgs] == [("user", True), ("assistant", True)]  # replaced, not appended
    assert msgs[1][1] == chat.view.messages[-1].text and len(chat.view.messages) == 2
    stats = window.status
    assert "tok/pass" in stats.per_pass.text() and "first token" in stats.ttft.text()
    assert stats.budget.text() == "budget: 8"
    assert "tiny-llama" in stats.pair.text() and "draft" in stats.pair.text()
    assert stats.placement.text() == "all 2 layers in RAM" and "resident" in stats.placement.toolTip()


def test_edit_and_resend_the_last_user_message(qtbot: QtBot, open_window, chat_prefs: PreferencesStore,
                                               conversations: ConversationStore) -> None:
    chat_prefs.update(max_new_tokens=10, budget=0)  # budget auto: no hardware profile here, the engine default
    window = open_window(chat_prefs)
    chat = window.chat
    for text in ("first question", "second question"):
        with qtbot.waitSignal(chat.answer_finished, timeout=60_000):
            _type_and_send(qtbot, window, text)
    first_answer = _db_messages(conversations, window)[1]
    qtbot.mouseClick(chat.view.messages[2].edit_button, Qt.MouseButton.LeftButton)
    assert chat.composer.input.toPlainText() == "second question"
    chat.composer.input.selectAll()
    with qtbot.waitSignal(chat.answer_finished, timeout=60_000):
        _type_and_send(qtbot, window, "better question")
    msgs = _db_messages(conversations, window)
    assert [(r, t) for r, t, _ in msgs[:3]] == [("user", "first question"), first_answer[:2], ("user", "better question")]
    assert len(msgs) == 4 and msgs[3][0] == "assistant" and msgs[3][2]
    assert [m.text for m in chat.view.messages] == [t for _, t, _ in msgs]
    assert window.status.budget.text() == "budget: auto (64)"


def test_conversations_survive_a_restart(qtbot: QtBot, open_window, chat_prefs: PreferencesStore,
                                         conversations: ConversationStore, tmp_path: Path) -> None:
    chat_prefs.update(max_new_tokens=8)
    window = open_window(chat_prefs)
    with qtbot.waitSignal(window.chat.answer_finished, timeout=60_000):
        _type_and_send(qtbot, window, "remember me")
    window.chat.system_edit.setText("You are terse.")
    window.chat.system_edit.editingFinished.emit()
    before = _db_messages(conversations, window)
    window.close()

    again = ConversationStore(conversations.path)  # a new connection, as a new process would open
    try:
        second = open_window(chat_prefs, wait_loaded=False, store=again)
        chat = second.chat
        assert [i.text() for i in chat.sidebar.conversation_items()] == ["remember me"]
        assert chat.sidebar.list.item(0).text() == "Today"  # a date heading above it
        assert [(m.role, m.text, m.complete) for m in chat.view.messages] == before
        assert chat.system_edit.text() == "You are terse."
    finally:
        second.close()
        again.close()


def test_new_search_rename_and_delete_in_the_sidebar(qtbot: QtBot, open_window, make_prefs, answers: Answers,
                                                     conversations: ConversationStore) -> None:
    a = conversations.create("Apples")
    conversations.add_message(a.id, "user", "tell me about fruit")
    b = conversations.create("Boats")
    window = open_window(make_prefs(), wait_loaded=False)
    chat = window.chat
    assert chat.conversation_id == b.id  # the newest opens
    window.activateWindow()
    qtbot.waitUntil(window.isActiveWindow, timeout=5_000)
    qtbot.keyClick(window, Qt.Key.Key_F, Qt.KeyboardModifier.ControlModifier)
    qtbot.waitUntil(chat.sidebar.search.hasFocus, timeout=5_000)
    chat.sidebar.search.setText("fruit")
    qtbot.waitUntil(lambda: len(chat.sidebar.conversation_items()) == 1, timeout=5_000)
    chat.sidebar.list.setCurrentItem(chat.sidebar.conversation_items()[0])
    qtbot.waitUntil(lambda: chat.conversation_id == a.id, timeout=5_000)
    assert chat.view.messages[0].text == "tell me about fruit"
    answers.text = "Fruit talk"
    chat.sidebar.rename_current()
    assert conversations.get(a.id).title == "Fruit talk"  # type: ignore[union-attr]
    assert answers.asked[-1] == ("Rename conversation", "Title:")
    chat.sidebar.delete_current()  # No: it stays
    assert conversations.get(a.id) is not None
    answers.confirm = True
    chat.sidebar.delete_current()
    assert conversations.get(a.id) is None
    assert answers.asked[-1] == ("Delete conversation", "Delete “Fruit talk” and all its messages?")
    qtbot.keyClick(window, Qt.Key.Key_N, Qt.KeyboardModifier.ControlModifier)
    assert chat.conversation_id == 0 and chat.view.messages == []


def test_load_errors_show_in_a_banner(qtbot: QtBot, open_window, make_prefs, tmp_path: Path) -> None:
    window = open_window(make_prefs(target=str(tmp_path / "missing-model"), device="cpu"), wait_loaded=False)
    qtbot.waitUntil(lambda: window.chat.model_state == "failed", timeout=LOAD_MS)
    banner = window.chat.banner
    assert banner.isVisible() and "No model at" in banner.message
    assert not window.chat.composer.send_button.isEnabled()
    qtbot.mouseClick(banner.close_button, Qt.MouseButton.LeftButton)
    assert not banner.isVisible()


def test_without_a_model_the_chat_offers_the_starter_and_models_page(qtbot: QtBot, open_window, make_prefs) -> None:
    window = open_window(make_prefs(), wait_loaded=False)
    chat = window.chat
    assert chat.model_state == "none" and chat.stack.currentWidget() is chat.empty
    assert chat.empty.starter_button.isVisibleTo(window) and chat.empty.models_button.isVisibleTo(window)
    assert not chat.composer.send_button.isEnabled()
    assert window.status.pair.text() == "No model loaded"
    # a first start: an empty new chat with the default system prompt
    assert chat.conversation_id == 0 and chat.system_edit.text() == make_prefs().load().system_presets[0][1]


def test_code_blocks_render_highlighted_with_a_copy_link(qtbot: QtBot, open_window, make_prefs) -> None:
    window = open_window(make_prefs(theme="dark"), wait_loaded=False)
    view = window.chat.view
    msg = view.add_message("assistant", "Here:\n\n```python\ndef f(x):\n    return x + 1\n```\n\n| a | b |\n|---|---|\n| 1 | 2 |\n")
    html = msg.body.toHtml()
    assert "def" in msg.body.toPlainText() and "return x + 1" in msg.body.toPlainText()
    assert "monospace" in html or "Mono" in html
    assert "<table" in html
    msg.body.anchorClicked.emit(QUrl("copy:0"))
    assert QGuiApplication.clipboard().text() == "def f(x):\n    return x + 1\n"
    qtbot.mouseClick(msg.copy_button, Qt.MouseButton.LeftButton)
    assert QGuiApplication.clipboard().text().startswith("Here:")


def test_every_control_has_an_accessible_name(qtbot: QtBot, open_window, make_prefs) -> None:
    window = open_window(make_prefs(), wait_loaded=False)
    window.chat.view.add_message("user", "hi")
    window.chat.view.add_message("assistant", "hello")
    kinds = (QAbstractButton, QLineEdit, QPlainTextEdit, QComboBox, QListWidget, QTextBrowser)
    unnamed = [f"{type(w).__name__} {getattr(w, 'text', lambda: '')()!r}"
               for kind in kinds for w in window.findChildren(kind)
               if w.isVisibleTo(window) and not w.accessibleName() and w.objectName() != "qt_toolbar_ext_button"]
    assert unnamed == []


def test_system_prompt_presets_are_saved_and_applied(qtbot: QtBot, open_window, make_prefs,
                                                     conversations: ConversationStore) -> None:
    prefs = make_prefs()
    window = open_window(prefs, wait_loaded=False)
    chat = window.chat
    conv = conversations.create("Pirates")
    chat.open_conversation(conv.id)
    chat.system_edit.setText("Talk like a pirate.")
    chat.system_row.save_preset("Pirate", "Talk like a pirate.")
    assert ("Pirate", "Talk like a pirate.") in prefs.load().system_presets
    index = chat.preset_combo.findText("Pirate")
    assert index > 0
    chat.system_edit.setText("")
    chat.preset_combo.activated.emit(index)
    assert chat.system_edit.text() == "Talk like a pirate."
    assert conversations.get(conv.id).system_prompt == "Talk like a pirate."  # type: ignore[union-attr]


def test_ctrl_comma_opens_the_settings_dialog(qtbot: QtBot, open_window, make_prefs) -> None:
    from PySide6.QtCore import QTimer
    from PySide6.QtWidgets import QApplication

    window = open_window(make_prefs(), wait_loaded=False)
    window.activateWindow()
    qtbot.waitUntil(window.isActiveWindow, timeout=5_000)
    seen: list[str] = []

    def close_dialog() -> None:
        dialog = QApplication.activeModalWidget()
        seen.append(type(dialog).__name__)
        if dialog is not None:
            dialog.reject()

    QTimer.singleShot(300, close_dialog)
    qtbot.keyClick(window, Qt.Key.Key_Comma, Qt.KeyboardModifier.ControlModifier)
    qtbot.waitUntil(lambda: bool(seen), timeout=5_000)
    assert seen == ["SettingsDialog"]


def test_a_generation_error_is_a_banner_and_the_chat_goes_on(qtbot: QtBot, open_window, chat_prefs: PreferencesStore,
                                                             conversations: ConversationStore) -> None:
    window = open_window(chat_prefs)
    chat = window.chat
    with qtbot.waitSignal(chat.answer_finished, timeout=60_000) as blocker:
        chat.send("hello " * 3000)  # more tokens than the tiny model's 2048-token context
    assert blocker.args == ["error"]
    assert chat.banner.isVisible() and "tokens long" in chat.banner.message
    failed = chat.view.messages[-1]
    assert failed.note.text() == "failed" and not chat.busy
    assert _db_messages(conversations, window)[-1] == ("assistant", "", False)
    chat.new_conversation()
    chat_prefs.update(max_new_tokens=5)
    with qtbot.waitSignal(chat.answer_finished, timeout=60_000) as blocker:
        _type_and_send(qtbot, window, "short")
    assert blocker.args == ["length"] and not chat.banner.isVisible()  # sending dismissed it


def test_a_long_conversation_continues_after_a_restart_without_reading_it_again(
        qtbot: QtBot, open_window, make_prefs, conversations: ConversationStore, tiny_target_path: Path,
        tmp_path: Path) -> None:
    """Closing the app saves the conversation's KV cache; after a restart the next answer reuses
    the whole history (stats.cached_tokens) and equals a decode of the same messages from
    nothing."""
    from engine.decoding.generation import Engine
    from engine.loading.load import load_model
    from engine.types import CacheSettings, GenerationRequest, Message

    prefs = make_prefs(target=str(tiny_target_path), draft="", temperature=0.0, max_new_tokens=8, device="cpu")
    target = load_model(tiny_target_path)
    line = "The quick brown fox jumps over the lazy dog. Paris is the capital of France. "
    conv = conversations.create("long chat")
    for i in range(10):
        conversations.add_message(conv.id, "user" if i % 2 == 0 else "assistant", line * 5)
    history = [Message(m.role, m.content) for m in conversations.messages(conv.id)]  # type: ignore[arg-type]
    fresh = Engine(target.model, target.tokenizer, cache=CacheSettings(enabled=False))
    assert 1500 < len(fresh.encode(GenerationRequest(messages=tuple(history)))) < 1900

    window = open_window(prefs)
    with qtbot.waitSignal(window.chat.answer_finished, timeout=60_000):
        _type_and_send(qtbot, window, "one more")
    window.close()  # saves the conversation's cache
    assert list((tmp_path / "cache" / "kv").rglob("*.safetensors"))

    again = ConversationStore(conversations.path)
    try:
        second = open_window(prefs, store=again)
        with qtbot.waitSignal(second.chat.answer_finished, timeout=60_000):
            _type_and_send(qtbot, second, "and another")
        *asked, last = again.messages(conv.id)
        stats = json.loads(last.stats)
        assert stats["cached_tokens"] > 1500 and "reused" in second.status.ttft.toolTip()
        request = GenerationRequest(messages=tuple(Message(m.role, m.content) for m in asked), max_new_tokens=8)
        reference = list(fresh.generate(request))[-1]
        assert last.content == reference.text
    finally:
        second.close()
        again.close()
