"""A conversation on a remote engine (Settings > Engines): against a stand-in that answers like
vLLM and against `specchat serve` on loopback. It streams into the same chat view, stops and
regenerates, names each failure (unreachable, wrong key, model gone), keeps and marks the
partial answer when the server goes away mid-answer, and the app stays usable."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from PySide6.QtCore import Qt
from pytestqt.qtbot import QtBot
from remote_helpers import SERVE_KEY, VLLM_MODEL, ServeProcess, VllmStandIn

from app.main_window import MainWindow
from app.state.conversations import ConversationStore
from app.state.preferences_store import PreferencesStore
from app.state.remote_engines import encode_choice

KEY = "token-abc123"
ANSWER_MS = 60_000


@pytest.fixture
def vllm() -> Iterator[VllmStandIn]:
    server = VllmStandIn(api_key=KEY).start()
    yield server
    server.stop()


def engines(*servers: tuple[str, str, str, tuple[str, ...]]) -> str:
    return json.dumps([{"name": n, "url": u, "api_key": k, "models": list(m)} for n, u, k, m in servers])




def pick(qtbot: QtBot, window: MainWindow, choice: str) -> None:
    """Choose an engine in the menu above the chat as a user does (keyboard on the combo box)."""
    picker = window.chat.engine_picker
    assert picker.isVisibleTo(window)
    picker.setFocus()
    index = picker.findData(choice)
    assert index >= 0, [picker.itemText(i) for i in range(picker.count())]
    while picker.currentIndex() != index:
        qtbot.keyClick(picker, Qt.Key.Key_Down if picker.currentIndex() < index else Qt.Key.Key_Up)


def send(qtbot: QtBot, window: MainWindow, text: str) -> list[str]:
    """Send a message and wait for the answer; returns how it finished."""
    box = window.chat.composer.input
    box.setFocus()
    with qtbot.waitSignal(window.chat.answer_finished, timeout=ANSWER_MS) as finished:
        qtbot.keyClicks(box, text)
        qtbot.keyClick(box, Qt.Key.Key_Return)
    return finished.args


def db(store: ConversationStore, window: MainWindow) -> list[tuple[str, str, bool]]:
    return [(m.role, m.content, m.complete) for m in store.messages(window.chat.conversation_id)]


def test_a_conversation_on_a_vllm_server(qtbot: QtBot, open_window, make_prefs, vllm: VllmStandIn,
                                         conversations: ConversationStore) -> None:
    prefs = make_prefs(remote_engines=engines(("gpu-box", vllm.url, KEY, (VLLM_MODEL,))), temperature=0.0)
    window = open_window(prefs, wait_loaded=False)  # no local model at all
    chat = window.chat
    assert chat.model_state == "none" and chat.stack.currentWidget() is chat.empty
    choice = encode_choice("gpu-box", VLLM_MODEL)
    pick(qtbot, window, choice)
    assert chat.stack.currentWidget() is chat.view  # a remote model answers without a local one
    rendered: list[str] = []
    chat.view.rendered.connect(rendered.append)

    assert send(qtbot, window, "hello there") == ["eos"]
    assert chat.view.messages[-1].text == "You said: hello there " and rendered
    assert db(conversations, window) == [("user", "hello there", True), ("assistant", "You said: hello there ", True)]
    assert conversations.get(chat.conversation_id).engine == choice
    sent = vllm.requests[-1]
    assert sent["model"] == VLLM_MODEL and sent["stream"] and sent["temperature"] == 0.0
    assert sent["messages"][-1] == {"role": "user", "content": "hello there"}

    # regenerate replaces the answer
    with qtbot.waitSignal(chat.answer_finished, timeout=ANSWER_MS):
        qtbot.mouseClick(chat.view.messages[-1].regenerate_button, Qt.MouseButton.LeftButton)
    assert [m for m in db(conversations, window)] == [("user", "hello there", True),
                                                      ("assistant", "You said: hello there ", True)]

    # stop keeps what came, marked
    vllm.pause = 0.2
    box = chat.composer.input
    qtbot.keyClicks(box, " ".join(["word"] * 60))
    qtbot.keyClick(box, Qt.Key.Key_Return)
    qtbot.waitUntil(lambda: "word" in chat.view.answer_text, timeout=ANSWER_MS)
    with qtbot.waitSignal(chat.answer_finished, timeout=ANSWER_MS) as stopped:
        qtbot.keyClick(window, Qt.Key.Key_Escape)
    assert stopped.args == ["cancelled"]
    last = chat.view.messages[-1]
    assert last.note.text() == "stopped" and last.text.startswith("You said: word") and last.text.count("word") < 60
    assert db(conversations, window)[-1] == ("assistant", last.text, False)
    qtbot.waitUntil(lambda: vllm.disconnects == 1, timeout=10_000)  # the server saw the client leave
    vllm.pause = 0.0

    # the server goes away mid-answer: the part that came is kept, marked, and said
    url, vllm.die_after = vllm.url, 3
    assert send(qtbot, window, "one two three four five") == ["error"]
    last = chat.view.messages[-1]
    assert last.text == "You said: one " and last.note.text() == "failed"
    assert db(conversations, window)[-1] == ("assistant", "You said: one ", False)
    assert "went away" in chat.banner.message and "kept" in chat.banner.message
    assert send(qtbot, window, "anyone?") == ["error"]  # nothing listens now
    assert "Cannot reach" in chat.banner.message and url in chat.banner.message
    # it comes back (same port): the same conversation carries on
    vllm.die_after = None
    vllm.start()
    assert send(qtbot, window, "welcome back") == ["eos"]
    assert chat.view.messages[-1].text == "You said: welcome back " and not chat.busy


def test_remote_errors_name_their_cause_and_the_choice_belongs_to_the_conversation(
        qtbot: QtBot, open_window, make_prefs, vllm: VllmStandIn, chat_prefs: PreferencesStore,
        conversations: ConversationStore) -> None:
    chat_prefs.update(max_new_tokens=6, remote_engines=engines(
        ("gpu-box", vllm.url, "wrong-key", (VLLM_MODEL,)), ("old-box", vllm.url, KEY, ("retired-model",))))
    window = open_window(chat_prefs, wait_loaded=False)
    chat = window.chat
    qtbot.waitUntil(lambda: chat.model_state == "ready", timeout=120_000)
    assert send(qtbot, window, "local first") == ["length"]  # the local tiny model
    local_id = chat.conversation_id
    chat.new_conversation()
    pick(qtbot, window, encode_choice("gpu-box", VLLM_MODEL))
    assert send(qtbot, window, "hi") == ["error"]
    assert "API key" in chat.banner.message and "401" in chat.banner.message
    assert chat.view.messages[-1].note.text() == "failed"
    pick(qtbot, window, encode_choice("old-box", "retired-model"))
    assert send(qtbot, window, "hi") == ["error"]
    assert "retired-model" in chat.banner.message and "does not exist" in chat.banner.message
    remote_id = chat.conversation_id
    # each conversation keeps its engine
    chat.open_conversation(local_id)
    assert chat.engine_picker.choice() == ""
    chat.open_conversation(remote_id)
    assert chat.engine_picker.choice() == encode_choice("old-box", "retired-model")
    # a server removed from the settings is named, not silently replaced by the local model
    chat_prefs.update(remote_engines=engines(("gpu-box", vllm.url, KEY, (VLLM_MODEL,))))
    assert "(not in Settings)" in chat.engine_picker.currentText()
    before = db(conversations, window)
    box = chat.composer.input
    qtbot.keyClicks(box, "still there?")
    qtbot.keyClick(box, Qt.Key.Key_Return)
    assert "no longer in Settings" in chat.banner.message and "old-box" in chat.banner.message
    assert not chat.busy and db(conversations, window) == before  # refused before anything was written


def test_a_conversation_on_specchat_serve(qtbot: QtBot, open_window, make_prefs, tiny_target_path: Path,
                                          tiny_draft_path: Path, conversations: ConversationStore) -> None:
    server = ServeProcess(["--target", tiny_target_path, "--draft", tiny_draft_path, "--device", "cpu",
                           "--budget", 8, "--max-depth", 4, "--keep-draft", "--api-key", SERVE_KEY])
    try:
        server.wait_for(lambda line: line.startswith("ready:"))
        name = tiny_target_path.name
        prefs = make_prefs(remote_engines=engines(("workstation", server.url, SERVE_KEY, (name,))),
                           temperature=0.0, max_new_tokens=10)
        window = open_window(prefs, wait_loaded=False)
        pick(qtbot, window, encode_choice("workstation", name))
        assert send(qtbot, window, "hello") == ["length"]
        answer = window.chat.view.messages[-1].text
        assert answer and db(conversations, window)[-1] == ("assistant", answer, True)
        per_pass = window.status.per_pass.text()  # the served engine's own figures, through usage.specchat
        assert per_pass.endswith("tok/pass") and float(per_pass.split()[0]) > 1
        server.wait_for(lambda line: line.startswith("request 1:") and line.endswith("length"))
    finally:
        server.stop()


def test_a_server_answering_in_the_wrong_shape_is_named_not_a_bug(qtbot: QtBot, open_window, make_prefs,
                                                                  vllm: VllmStandIn) -> None:
    prefs = make_prefs(remote_engines=engines(("gpu-box", vllm.url, KEY, (VLLM_MODEL,))), temperature=0.0)
    window = open_window(prefs, wait_loaded=False)
    chat = window.chat
    pick(qtbot, window, encode_choice("gpu-box", VLLM_MODEL))
    chunk = b'{"id": "c", "object": "chat.completion.chunk", "choices": %s}'
    for events, said in (([chunk % b'[{"index": 0, "delta": {"content": "part "}}]', chunk % b'"abc"'],
                          "'choices' is a string"),
                         ([chunk % b'[{"index": 0, "delta": "abc"}]'], "'delta' is a string"),
                         ([b"[" * 100_000 + b"]" * 100_000], "nests arrays or objects 100000 levels deep")):
        vllm.events = events
        assert send(qtbot, window, "hi") == ["error"]
        message = chat.banner.message
        assert vllm.url in message and said in message and "bug" not in message.lower(), message
        assert chat.view.messages[-1].note.text() == "failed" and not chat.busy
    assert [m.text for m in chat.view.messages][1] == "part "  # what came before the bad event is kept
    vllm.events = None
    assert send(qtbot, window, "fine now") == ["eos"]
    assert chat.view.messages[-1].text == "You said: fine now "
