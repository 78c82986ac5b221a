"""Thinking models in the window, with real models whose answers are known: the two scripted tiny
models (engine/testing/scripted_model.py; Qwen 3 Thinking's <think> template and gpt-oss's
harmony template), each loaded with its noisy draft by a real worker thread. The reasoning
streams into an open Thinking block that folds when the answer begins; the block holds exactly
the script's reasoning and the answer bubble exactly its answer, with none of the format's
markers; SQLite keeps the two apart, and they come back with the conversation."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from chat_helpers import WorkerEvents, record_renders
from PySide6.QtCore import Qt
from pytestqt.qtbot import QtBot

from app.main_window import MainWindow
from app.state.conversations import ConversationStore
from app.state.export import thinking_title
from app.state.preferences_store import PreferencesStore
from engine.testing.thinking_scripts import ScriptedPair
from engine.types import Completion

ANSWER_MS = 120_000
MARKERS = ("<think>", "</think>", "<|", "|>", "analysis", "final")



@pytest.mark.parametrize("name", ["qwen3-thinking", "gpt-oss-harmony"])
def test_the_reasoning_goes_to_the_thinking_block_and_the_answer_to_the_bubble(
        name: str, qtbot: QtBot, open_window: Callable[..., MainWindow], make_prefs: Callable[..., PreferencesStore],
        thinking_models: dict[str, ScriptedPair],
        conversations: ConversationStore) -> None:
    pair = thinking_models[name]
    script = pair.script
    prefs = make_prefs(target=str(pair.target), draft=str(pair.draft), keep_draft=True, temperature=0.0,
                       max_new_tokens=60, device="cpu", budget=8, max_depth=4, repetition_penalty=1.0)
    window = open_window(prefs)
    chat = window.chat
    assert chat.answer_format.chat.reasoning == ("think" if name == "qwen3-thinking" else "harmony")
    events = WorkerEvents(window.host)
    states = record_renders(window)

    box = chat.composer.input
    box.setFocus()
    with qtbot.waitSignal(chat.answer_finished, timeout=ANSWER_MS) as finished:
        qtbot.keyClicks(box, "hello")
        qtbot.keyClick(box, Qt.Key.Key_Return)
    assert finished.args == ["eos"]
    qtbot.waitUntil(lambda: bool(events.finished))  # queued behind the page's own slot
    [completion] = events.finished.values()
    assert isinstance(completion, Completion) and completion.finish_reason == "eos"

    last = chat.view.messages[-1]
    assert last.text == script.answer and last.reasoning == script.reasoning
    assert not any(marker in last.text for marker in MARKERS)
    assert last.thinking is not None and not last.thinking.is_open  # folded once the answer came
    # open only while the reasoning streamed (renders are coalesced: a fast answer may show none
    # of those), and folded on every render of the answer
    opened = [s for s in states if s[1]]
    assert all(text == "" for text, _, _ in opened)
    assert all(reasoning == script.reasoning for text, open_, reasoning in states if text)
    assert states[-1][0] == script.answer and not states[-1][1]
    assert states == opened + [s for s in states if not s[1]]

    [user, row] = conversations.messages(chat.conversation_id)
    assert user.content == "hello"
    assert (row.content, row.reasoning, row.complete) == (script.answer, script.reasoning, True)
    assert last.thinking.title == thinking_title(row.reasoning_seconds)

    conversation = chat.conversation_id
    chat.new_conversation()
    chat.open_conversation(conversation)
    again = chat.view.messages[-1]
    assert (again.text, again.reasoning) == (script.answer, script.reasoning)
    assert again.thinking is not None and not again.thinking.is_open
