"""What the window says around answers, end to end (real worker thread, tiny models, SQLite,
the real API server over HTTP): issue 26 items 7, 9 and 11.

- Status-bar figures belong to their conversation: another conversation shows none (not even
  while an answer streams in the background), coming back shows its own, another model forgets.
- A draft loaded beside plain decoding says why in the mode field.
- A failed load's banner goes once another load works; a store notice outlives neither.
- An answer waiting behind an API request says so in its bubble until its first token.
"""

from __future__ import annotations

import dataclasses
import json
import threading
import time
import urllib.request
from pathlib import Path

import pytest
from pytestqt.qtbot import QtBot

from app.chat.turn_status import WAITING_FOR_API
from app.main_window import MainWindow
from app.state.conversations import ConversationStore
from app.state.preferences_store import PreferencesStore
from engine.planning.profile import LAYER_SHAPES, HardwareProfile, LayerTiming, save_profile
from engine.planning.reference import reference_profile

LOAD_MS = 120_000
ANSWER_MS = 120_000




def _figures(window: MainWindow) -> list[str]:
    return [label.text() for label in window.status.figures]


def _answer(qtbot: QtBot, window: MainWindow, text: str) -> None:
    with qtbot.waitSignal(window.chat.answer_finished, timeout=ANSWER_MS):
        window.chat.send(text)


def test_figures_follow_the_shown_conversation_and_go_with_the_model(
        qtbot: QtBot, open_window, chat_prefs: PreferencesStore) -> None:
    chat_prefs.update(max_new_tokens=8)
    window = open_window(chat_prefs)
    chat = window.chat
    _answer(qtbot, window, "hello")
    first, shown = chat.conversation_id, _figures(window)
    assert shown[0].endswith("tok/s") and shown[2].startswith("first token") and shown[3] == "budget: 8"

    chat.new_conversation()
    assert _figures(window) == ["", "", "", ""]  # not the other conversation's
    _answer(qtbot, window, "another")
    second = chat.conversation_id
    chat.open_conversation(first)
    assert _figures(window) == shown  # its own figures again
    chat.open_conversation(second)
    assert _figures(window) != shown and _figures(window)[0]

    chat_prefs.update(context_length=1024)  # another load of the pair
    qtbot.waitUntil(lambda: chat.model_state == "ready", timeout=LOAD_MS)
    assert _figures(window) == ["", "", "", ""]
    chat.open_conversation(first)
    assert _figures(window) == ["", "", "", ""]  # measured with the last load: forgotten


def test_an_answer_in_the_background_shows_no_figures_beside_another_conversation(
        qtbot: QtBot, open_window, chat_prefs: PreferencesStore, conversations: ConversationStore) -> None:
    chat_prefs.update(max_new_tokens=300)
    other = conversations.create("Other chat")
    conversations.add_message(other.id, "user", "an older question")
    window = open_window(chat_prefs)
    chat = window.chat
    rendered: list[str] = []
    chat.view.rendered.connect(rendered.append)
    chat.new_conversation()
    chat.send("hello")
    writing = chat.conversation_id
    qtbot.waitUntil(lambda: len(rendered) >= 2, timeout=ANSWER_MS)
    done: list[str] = []
    chat.answer_finished.connect(done.append)
    chat.open_conversation(other.id)
    seen: list[list[str]] = []
    deadline = time.monotonic() + ANSWER_MS / 1000
    while not done and time.monotonic() < deadline:  # while it is written in the background, and after
        seen.append(_figures(window))
        qtbot.wait(20)
    seen.append(_figures(window))
    assert done == ["length"]
    assert seen and all(figures == ["", "", "", ""] for figures in seen)
    chat.open_conversation(writing)
    assert _figures(window)[0].endswith("tok/s") and _figures(window)[1].endswith("tok/pass")


def test_an_answer_stopped_by_a_new_load_leaves_no_figures_beside_it(
        qtbot: QtBot, open_window, chat_prefs: PreferencesStore) -> None:
    chat_prefs.update(max_new_tokens=1500)
    window = open_window(chat_prefs)
    chat = window.chat
    rendered: list[str] = []
    chat.view.rendered.connect(rendered.append)
    at_end: list[tuple[str, list[str]]] = []
    chat.answer_finished.connect(lambda reason: at_end.append((reason, _figures(window))))
    chat.send("hello")
    qtbot.waitUntil(lambda: len(rendered) >= 2, timeout=ANSWER_MS)
    chat_prefs.update(context_length=1024)  # another load: the answer is stopped
    qtbot.waitUntil(lambda: bool(at_end), timeout=ANSWER_MS)
    assert at_end == [("cancelled", ["", "", "", ""])]  # not the last model's figures beside "Loading…"
    qtbot.waitUntil(lambda: chat.model_state == "ready", timeout=LOAD_MS)
    assert _figures(window) == ["", "", "", ""]


def test_a_draft_beside_plain_decoding_says_why(qtbot: QtBot, open_window, chat_prefs: PreferencesStore) -> None:
    chat_prefs.update(max_new_tokens=6, tree_mode="autoregressive")
    window = open_window(chat_prefs)
    assert " · draft: " in window.status.pair.text()  # the draft that runs (engine.decoding.draft_choice)
    _answer(qtbot, window, "hello")
    mode = window.status.budget
    assert mode.text() == "plain (Settings)" and "Settings > Engine > Mode" in mode.toolTip()
    assert window.status.per_pass.text() == "1.00 tok/pass"


def _profile_where_trees_do_not_pay() -> HardwareProfile:
    """A CPU whose layer costs 16x more for 16 tokens than for 1: the draft's trees cannot pay."""
    shape = LAYER_SHAPES["llama-70b"]
    steep = LayerTiming(shape, "cpu", "float32", shape.params * 4, ((1, 0.3), (16, 4.8), (128, 38.4)), 0.0)
    return dataclasses.replace(reference_profile("rtx4090"), gpus=(), layer_timing=steep)


def test_budget_auto_is_chosen_in_the_worker_and_the_mode_field_says_what_and_why(
        qtbot: QtBot, open_window, chat_prefs: PreferencesStore) -> None:
    """No GUI round trip: the request carries budget 0, AutoBudget chooses in the worker, and the
    choice comes back for display only. Without a hardware profile: the fallback, and why."""
    chat_prefs.update(max_new_tokens=6, budget=0)
    window = open_window(chat_prefs)
    _answer(qtbot, window, "hello")
    mode = window.status.budget
    assert mode.text().startswith("budget: auto (") and "no hardware profile" in mode.toolTip()

    # where the planner finds the draft's trees do not pay, the draft is left out: the answer
    # decodes draft-free, and the field says budget auto decided it (not a measured slowdown)
    save_profile(_profile_where_trees_do_not_pay())
    _answer(qtbot, window, "hello again")
    assert mode.text() == "draft off (auto)" and "budget auto left the draft out" in mode.toolTip()
    assert "does not pay" in mode.toolTip() or "do not pay" in mode.toolTip()
    assert window.running is not None  # what runs (Settings > Engine, the models page) says so too
    assert "budget auto leaves the draft out" in window.running.decoding_text()


def test_a_failed_load_banner_goes_when_a_load_works(qtbot: QtBot, open_window, chat_prefs: PreferencesStore,
                                                     tiny_target_path: Path, tmp_path: Path) -> None:
    good = chat_prefs.load().target
    chat_prefs.update(target=str(tmp_path / "missing-model"))
    window = open_window(chat_prefs, wait_loaded=False)
    chat = window.chat
    qtbot.waitUntil(lambda: chat.model_state == "failed", timeout=LOAD_MS)
    assert "No model at" in chat.banner.message
    chat.show_error("Conversations are kept in memory only.", "store")  # a notice of another cause
    chat_prefs.update(target=good)
    qtbot.waitUntil(lambda: chat.model_state == "ready", timeout=LOAD_MS)
    assert chat.banner.message == "Conversations are kept in memory only."  # the load's error went, not this
    chat.banner.dismiss()
    assert not chat.banner.isVisible()
    chat_prefs.update(target=str(tmp_path / "missing-model"))
    qtbot.waitUntil(lambda: chat.model_state == "failed", timeout=LOAD_MS)
    assert "No model at" in chat.banner.message
    chat_prefs.update(target="")  # nothing to load any more: nothing failed
    qtbot.waitUntil(lambda: chat.model_state == "none", timeout=LOAD_MS)
    assert not chat.banner.isVisible()


def test_an_answer_error_goes_when_an_answer_works(qtbot: QtBot, open_window, chat_prefs: PreferencesStore) -> None:
    chat_prefs.update(max_new_tokens=5)
    window = open_window(chat_prefs)
    chat = window.chat
    _answer(qtbot, window, "hello " * 3000)  # more than the tiny model's context
    assert "tokens long" in chat.banner.message
    chat.new_conversation()
    assert "tokens long" in chat.banner.message  # until an answer works
    _answer(qtbot, window, "short")
    assert not chat.banner.isVisible()


class _ApiRequest(threading.Thread):
    """A streamed chat completion over raw HTTP that reads until told to leave."""

    def __init__(self, url: str, max_tokens: int) -> None:
        super().__init__(daemon=True)
        self.url, self.max_tokens = url, max_tokens
        self.chunks = 0
        self.leave = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self._run()
        except BaseException as exc:  # noqa: BLE001 - the test looks at it
            self.error = exc

    def _run(self) -> None:
        with urllib.request.urlopen(f"{self.url}/models", timeout=30) as response:
            model = json.load(response)["data"][0]["id"]
        body = json.dumps({"model": model, "stream": True, "max_tokens": self.max_tokens,
                           "messages": [{"role": "user", "content": "tell me a long story"}]}).encode()
        request = urllib.request.Request(f"{self.url}/chat/completions", body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=120) as response:
            for line in response:
                if line.startswith(b"data: {"):
                    self.chunks += 1
                if self.leave.is_set():
                    return  # closing the connection cancels the generation


def test_an_answer_waiting_behind_an_api_request_says_so_in_its_bubble(
        qtbot: QtBot, open_window, chat_prefs: PreferencesStore, request: pytest.FixtureRequest) -> None:
    chat_prefs.update(server_enabled=True, server_port=0, max_new_tokens=6)
    window = open_window(chat_prefs)
    chat = window.chat
    api = _ApiRequest(window.api.url, max_tokens=1500)
    request.addfinalizer(api.leave.set)
    api.start()
    qtbot.waitUntil(lambda: api.chunks >= 2 or api.error is not None, timeout=ANSWER_MS)
    assert api.error is None
    chat.send("are you there?")
    bubble = chat.view.messages[-1]
    qtbot.waitUntil(bubble.placeholder.isVisible, timeout=5_000)
    assert bubble.text == "" and bubble.placeholder.text() == WAITING_FOR_API
    chat.new_conversation()  # away and back: it still says so
    chat.open_conversation(chat.answering_in)
    bubble = chat.view.messages[-1]
    qtbot.waitUntil(bubble.placeholder.isVisible, timeout=5_000)
    assert bubble.placeholder.text() == WAITING_FOR_API
    with qtbot.waitSignal(chat.answer_finished, timeout=ANSWER_MS) as finished:
        api.leave.set()
    assert finished.args == ["length"] and bubble.text and not bubble.placeholder.isVisible()
    api.join(30)
    assert api.error is None
