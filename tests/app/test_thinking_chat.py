"""A thinking model in the window, end to end: the tiny model given Qwen 3's thinking template
(its answers start inside <think>) loaded by a real worker thread, and a remote server that
streams a <think> block before its answer (a local HTTP server in vLLM's stream shape, run by
the remote worker's thread). The reasoning streams into an open Thinking block, folds when the
answer begins, is stored apart from the answer in SQLite and comes back with the conversation;
Settings > Server states what the API does with the model, and the app's API server takes
tools for it (it knows the model's chat template, as `specchat serve` does)."""

from __future__ import annotations

import json
import shutil
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import openai
import pytest
from chat_helpers import WorkerEvents, record_renders
from PySide6.QtCore import Qt
from pytestqt.qtbot import QtBot
from remote_helpers import templates

from app.main_window import MainWindow
from app.settings.dialog import SettingsDialog
from app.state.conversations import ConversationStore
from app.state.export import thinking_title
from app.state.remote_engines import encode_choice
from engine.decoding.text import FORMAT_MARKERS
from engine.types import Completion

KEY = "sk-thinking-test"
ANSWER_MS = 120_000
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}



@pytest.fixture(scope="module")
def thinking_model(tiny_target_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with Qwen 3 Thinking's tool template (the generation prompt opens <think>)."""
    folder = tmp_path_factory.mktemp("thinking") / "tiny-qwen3-thinking"
    shutil.copytree(tiny_target_path, folder)
    (folder / "chat_template.jinja").write_text(templates.QWEN_THINKING)
    return folder


def _send(qtbot: QtBot, window: MainWindow, text: str) -> list[str]:
    box = window.chat.composer.input
    box.setFocus()
    with qtbot.waitSignal(window.chat.answer_finished, timeout=ANSWER_MS) as finished:
        qtbot.keyClicks(box, text)
        qtbot.keyClick(box, Qt.Key.Key_Return)
    return finished.args


def test_a_thinking_models_reasoning_streams_in_its_block_and_the_api_takes_its_tools(
        qtbot: QtBot, open_window, make_prefs, thinking_model: Path, conversations: ConversationStore) -> None:
    prefs = make_prefs(target=str(thinking_model), draft="", temperature=0.0, max_new_tokens=200, device="cpu",
                       budget=8, max_depth=4, server_enabled=True, server_port=0, server_api_key=KEY)
    window = open_window(prefs)
    chat = window.chat
    assert chat.answer_format.chat.opens_thinking and chat.answer_format.chat.tools == "hermes"
    events = WorkerEvents(window.host)
    states = record_renders(window)

    assert _send(qtbot, window, "hello") in (["eos"], ["length"])
    qtbot.waitUntil(lambda: bool(events.finished))  # queued behind the page's own slot
    [completion] = events.finished.values()
    assert isinstance(completion, Completion)
    # the whole answer is reasoning (the random model never closes </think>): the block was open
    # on every render, with the reasoning growing and no answer text
    assert len(states) >= 2 and all(text == "" and open_ for text, open_, _ in states)
    assert all(a[2] == b[2][:len(a[2])] for a, b in zip(states, states[1:]))
    last = chat.view.messages[-1]
    assert last.text == "" and last.thinking is not None and last.thinking.is_open  # no answer: left open
    assert last.reasoning == completion.text.strip() and last.reasoning
    assert not any(marker in last.reasoning for marker in FORMAT_MARKERS)
    [_, row] = conversations.messages(chat.conversation_id)
    assert (row.content, row.reasoning, row.complete) == ("", last.reasoning, True)
    assert last.thinking.title == thinking_title(row.reasoning_seconds) != "Thinking…"

    # it comes back with the conversation
    conversation = chat.conversation_id
    chat.new_conversation()
    chat.open_conversation(conversation)
    again = chat.view.messages[-1]
    assert again.thinking is not None and again.reasoning == row.reasoning
    assert again.thinking.title == last.thinking.title

    # Settings > Server says what the API does with this model
    dialog = SettingsDialog(window.preferences, window, running=window.running)
    qtbot.addWidget(dialog)
    support = dialog.server_tab.support.text()
    assert "tiny-qwen3-thinking" in support and "<b>Tools:</b></td><td>yes" in support and "Hermes/Qwen" in support
    assert "<b>JSON output:</b></td><td>yes" in support and "&lt;think&gt; blocks come back as reasoning_content" in support
    dialog.reject()

    # the app's API server knows the chat template: tools are taken, the reasoning comes apart
    client = openai.OpenAI(base_url=window.api.url, api_key=KEY, max_retries=0, timeout=120)
    answers: list[Any] = []

    def call() -> None:
        try:
            answers.append(client.chat.completions.create(
                model=thinking_model.name, messages=[{"role": "user", "content": "Weather in Paris?"}],
                tools=[WEATHER], max_tokens=6))  # type: ignore[list-item]
        except BaseException as exc:  # noqa: BLE001 - the test looks at it
            answers.append(exc)

    thread = threading.Thread(target=call, daemon=True)
    thread.start()
    qtbot.waitUntil(lambda: not thread.is_alive(), timeout=ANSWER_MS)
    [answer] = answers
    assert not isinstance(answer, BaseException), answer
    message = answer.choices[0].message
    assert not message.content and not message.tool_calls
    assert (message.model_extra or {}).get("reasoning_content")


class ThinkingServer:
    """An OpenAI-compatible server that streams one scripted answer as vLLM streams chat
    deltas (a role chunk, one chunk per piece `pause` seconds apart, a finish chunk, [DONE]),
    as a server without a reasoning parser sends a thinking model's <think> block."""

    def __init__(self, pieces: list[str], pause: float) -> None:
        self.pieces, self.pause = pieces, pause
        owner = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - quiet in tests
                pass

            def do_POST(self) -> None:  # noqa: N802
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                base = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": int(time.time()),
                        "model": body.get("model", "")}
                deltas = [{"role": "assistant", "content": ""}] + [{"content": p} for p in owner.pieces]
                for delta in deltas:
                    self._chunk({**base, "choices": [{"index": 0, "delta": delta, "finish_reason": None}]})
                    time.sleep(owner.pause)
                self._chunk({**base, "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]})
                self._write(b"data: [DONE]\n\n")
                self._write(b"")

            def _chunk(self, event: dict[str, Any]) -> None:
                self._write(b"data: " + json.dumps(event).encode() + b"\n\n")

            def _write(self, data: bytes) -> None:
                self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
                self.wfile.flush()

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}/v1"

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()


@pytest.fixture
def thinking_server() -> Iterator[ThinkingServer]:
    server = ThinkingServer(["<think>", "The user", " says hi.", " I should", " greet back.", "</think>", "\n\n",
                             "Hello", " there", "!"], pause=0.15)
    yield server
    server.stop()


def test_a_remote_servers_think_block_streams_open_and_folds_when_the_answer_begins(
        qtbot: QtBot, open_window, make_prefs, thinking_server: ThinkingServer,
        conversations: ConversationStore) -> None:
    engines = json.dumps([{"name": "box", "url": thinking_server.url, "api_key": "", "models": ["thinker"]}])
    window = open_window(make_prefs(remote_engines=engines), wait_loaded=False)  # no local model
    chat = window.chat
    picker = chat.engine_picker
    picker.set_choice(encode_choice("box", "thinker"))
    picker.activated.emit(picker.currentIndex())
    states = record_renders(window)

    assert _send(qtbot, window, "hi") == ["eos"]  # the remote client says "eos" for "stop"
    opened = [s for s in states if s[1]]
    folded = [s for s in states if not s[1]]
    assert opened and folded and states == opened + folded  # open while it thought, folded once the answer came
    assert all(text == "" and reasoning for text, _, reasoning in opened)
    assert all(text for text, _, _ in folded)
    last = chat.view.messages[-1]
    assert last.text == "Hello there!" and last.reasoning == "The user says hi. I should greet back."
    [_, row] = conversations.messages(chat.conversation_id)
    assert (row.content, row.reasoning) == ("Hello there!", "The user says hi. I should greet back.")
    assert 0.3 < row.reasoning_seconds < 30 and last.thinking is not None
    assert last.thinking.title == thinking_title(row.reasoning_seconds)

    conversation = chat.conversation_id
    chat.new_conversation()
    chat.open_conversation(conversation)
    again = chat.view.messages[-1]
    assert again.text == "Hello there!" and again.thinking is not None and not again.thinking.is_open
    assert again.thinking.title == last.thinking.title
