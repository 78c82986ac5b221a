"""The turn controller (app/chat/turn.py) without a window, a QApplication or a model: a real
SQLite file, the requests it would send recorded, the clock stepped by hand. What it builds from
the history, and what the database holds at each moment of an answer (the save rule)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from app.chat.turn import TurnController, TurnSettings
from app.state.conversations import ConversationStore, default_path
from app.state.preferences import Preferences
from app.state.remote_engines import RemoteEngineEntry, dump_engines, encode_choice
from engine.errors import RemoteError
from engine.types import Completion, GenerationRequest, GenerationStats, Message, RemoteModel

REPO = Path(__file__).resolve().parents[2]
PREFS = Preferences(system_presets=(("Default", "Be brief."),), max_new_tokens=77)


class Engine:
    """Where the controller sends requests: it records them, and what the database held then."""

    def __init__(self, store: ConversationStore) -> None:
        self.store = store
        self.sent: list[tuple[GenerationRequest, RemoteModel | None]] = []
        self.rows_when_sent: list[list[tuple[str, str, bool]]] = []
        self.next_id = 41

    def send(self, request: GenerationRequest, remote: RemoteModel | None) -> int:
        self.sent.append((request, remote))
        conversation = int(request.conversation.rsplit("-", 1)[1])
        self.rows_when_sent.append(rows(self.store, conversation))
        self.next_id += 1
        return self.next_id


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def rows(store: ConversationStore, conversation_id: int) -> list[tuple[str, str, bool]]:
    return [(m.role, m.content, m.complete) for m in store.messages(conversation_id)]


def completion(text: str, reason: str = "stop", new_tokens: int = 3) -> Completion:
    stats = GenerationStats(prompt_tokens=9, new_tokens=new_tokens, target_passes=2, tokens_per_pass=1.5,
                            draft_passes=0, budget=64, seconds=0.5, ttft_seconds=0.1, tokens_per_second=6.0,
                            peak_rss_bytes=0)
    return Completion(text, (1, 2, 3), reason, stats)  # type: ignore[arg-type]


@pytest.fixture
def store(tmp_path: Path) -> ConversationStore:
    s = ConversationStore(default_path(tmp_path))
    yield s  # type: ignore[misc]
    s.close()


@pytest.fixture
def engine(store: ConversationStore) -> Engine:
    return Engine(store)


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def turn(store: ConversationStore, engine: Engine, clock: Clock) -> TurnController:
    return TurnController(store, engine.send, TurnSettings(background_save_seconds=0.5), clock)


def test_a_first_message_makes_the_conversation_and_the_request_carries_its_history(
        turn: TurnController, engine: Engine, store: ConversationStore) -> None:
    cid, message = turn.post(0, "What is a tree budget, in a word?", "Be brief.", engine="")
    conv = store.get(cid)
    assert conv is not None and conv.title == "What is a tree budget, in a word?" and conv.system_prompt == "Be brief."
    assert message.role == "user" and rows(store, cid) == [("user", "What is a tree budget, in a word?", True)]
    answer = turn.begin(cid, PREFS, "Be brief.")
    [(request, remote)] = engine.sent
    assert remote is None and answer.request_id == 42 and turn.busy and turn.answering_in == cid
    assert request.messages == (Message("system", "Be brief."), Message("user", "What is a tree budget, in a word?"))
    assert request.conversation == f"conversation-{cid}" and request.max_new_tokens == 77
    assert request.speculation.budget == 0  # budget "auto": the worker's AutoBudget chooses, per request
    assert not request.continue_final
    # the answer's row existed, empty and incomplete, before the request left
    assert engine.rows_when_sent == [[("user", "What is a tree budget, in a word?", True), ("assistant", "", False)]]


def test_the_save_rule_in_the_background_and_on_screen(turn: TurnController, engine: Engine, store: ConversationStore,
                                                       clock: Clock) -> None:
    cid, _ = turn.post(0, "hello", "", "")
    answer = turn.begin(cid, PREFS, "")
    first = turn.tokens(answer.request_id, "Hel", 1, shown=False)
    assert first is not None and first.first and first.tokens == 1
    assert rows(store, cid)[-1] == ("assistant", "", False)  # not yet: the last save is fresh
    clock.now += 0.6
    later = turn.tokens(answer.request_id, "lo", 1, shown=False)
    assert later is not None and not later.first and later.seconds == pytest.approx(0.6)
    assert rows(store, cid)[-1] == ("assistant", "Hello", False)  # due: written with the chunk
    clock.now += 0.1
    turn.tokens(answer.request_id, " there", 1, shown=False)
    assert rows(store, cid)[-1] == ("assistant", "Hello", False)
    turn.save()  # its conversation is left (or shown again): written at once
    assert rows(store, cid)[-1] == ("assistant", "Hello there", False)
    clock.now += 5
    turn.tokens(answer.request_id, "!", 1, shown=True)  # on screen: the view saves before it renders
    assert rows(store, cid)[-1] == ("assistant", "Hello there", False)
    turn.save_shown("Hello there!")
    assert rows(store, cid)[-1] == ("assistant", "Hello there!", False)
    assert turn.tokens(answer.request_id + 1, "not ours", 1, shown=True) is None  # another request's events

    ending = turn.finish(answer.request_id, completion("Hello there!"))
    assert ending is not None and ending.complete and ending.note == "" and not ending.can_continue
    [user, done] = store.messages(cid)
    assert (done.content, done.complete) == ("Hello there!", True)
    assert json.loads(done.stats)["finish_reason"] == "stop" and json.loads(done.stats)["new_tokens"] == 3
    assert not turn.busy and turn.finish(answer.request_id, completion("again")) is None


def test_a_stopped_a_cut_and_a_failed_answer(turn: TurnController, store: ConversationStore) -> None:
    cid, _ = turn.post(0, "tell me a story", "", "")
    answer = turn.begin(cid, PREFS, "")
    turn.tokens(answer.request_id, "Once", 1, shown=False)
    stopped = turn.finish(answer.request_id, completion("Once", reason="cancelled"))
    assert stopped is not None and (stopped.note, stopped.complete) == ("stopped", False)
    assert rows(store, cid)[-1] == ("assistant", "Once", False)

    answer = turn.begin(cid, PREFS, "")
    turn.tokens(answer.request_id, "A long one", 3, shown=True)
    cut = turn.finish(answer.request_id, completion("A long one", reason="length", new_tokens=3))
    assert cut is not None and cut.can_continue and cut.complete and "token limit (3 new tokens)" in cut.note

    answer = turn.begin(cid, PREFS, "")
    turn.tokens(answer.request_id, "Half", 1, shown=False)
    failed = turn.fail(answer.request_id)
    assert failed is not None and (failed.reason, failed.note, failed.complete) == ("error", "failed", False)
    assert rows(store, cid)[-1] == ("assistant", "Half", False)  # its text kept


def test_continue_writes_on_into_the_same_message_and_an_edit_replaces_what_followed(
        turn: TurnController, engine: Engine, store: ConversationStore) -> None:
    cid, _ = turn.post(0, "count to ten", "", "")
    answer = turn.begin(cid, PREFS, "")
    turn.finish(answer.request_id, completion("1 2 3", reason="length"))
    resumed = turn.begin(cid, PREFS, "", resume=(answer.message_id, "1 2 3"))
    request = engine.sent[-1][0]
    assert resumed.message_id == answer.message_id and resumed.text == "1 2 3" and request.continue_final
    assert request.messages[-1] == Message("assistant", "1 2 3")
    assert engine.rows_when_sent[-1][-1] == ("assistant", "1 2 3", False)  # marked incomplete before it runs
    turn.tokens(resumed.request_id, " 4 5", 2, shown=False)
    turn.finish(resumed.request_id, completion(" 4 5"))
    assert rows(store, cid) == [("user", "count to ten", True), ("assistant", "1 2 3 4 5", True)]

    first_user = store.messages(cid)[0].id
    same, _ = turn.post(cid, "count to three", "", "", replace_from=first_user)
    assert same == cid and rows(store, cid) == [("user", "count to three", True)]


def test_a_deleted_conversations_answer_is_dropped_and_remote_choices_are_routed(
        turn: TurnController, engine: Engine, store: ConversationStore) -> None:
    cid, _ = turn.post(0, "hi", "", "")
    answer = turn.begin(cid, PREFS, "")
    assert not turn.forget(cid + 1)
    store.delete(cid)
    assert turn.forget(cid) and not turn.busy
    assert turn.tokens(answer.request_id, "late", 1, shown=False) is None  # its events find nothing to write

    prefs = Preferences(remote_engines=dump_engines((RemoteEngineEntry("box", "http://box:8000/v1", "k"),)))
    remote = turn.route(encode_choice("box", "llama"), prefs)
    assert remote == RemoteModel("http://box:8000/v1", "llama", "k", "box") and turn.route("", prefs) is None
    with pytest.raises(RemoteError, match="no longer in Settings > Engines"):
        turn.route(encode_choice("gone", "llama"), prefs)
    cid, _ = turn.post(0, "hi", "", encode_choice("box", "llama"))
    assert store.get(cid).engine == encode_choice("box", "llama")  # type: ignore[union-attr]
    assert turn.begin(cid, prefs, "", remote).remote and engine.sent[-1][1] == remote


def test_the_turn_controller_imports_no_qt() -> None:
    code = "import sys, app.chat.turn; print(sorted(m for m in sys.modules if m.startswith(('PySide6', 'shiboken'))))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO,
                         env={**os.environ, "PYTHONPATH": str(REPO)})
    assert out.stdout.strip() == "[]"
