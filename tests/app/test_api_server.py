"""The app's API server (Settings > Server): it serves the model loaded in the window through
the one engine thread, taking turns with the chat (each waits for the other's answer, the
status bar says so), answers 503 without a model, and reports a port it cannot use."""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time
from pathlib import Path

import openai
import pytest
from PySide6.QtCore import Qt
from pytestqt.qtbot import QtBot

from app.main_window import MainWindow
from app.state.preferences_store import PreferencesStore

KEY = "sk-app-test"
LOAD_MS = 120_000




def _send(qtbot: QtBot, window: MainWindow, text: str) -> None:
    box = window.chat.composer.input
    box.setFocus()
    qtbot.keyClicks(box, text)
    qtbot.keyClick(box, Qt.Key.Key_Return)


class ApiCall(threading.Thread):
    """One streamed chat completion from a client thread (the GUI thread keeps running events)."""

    def __init__(self, client: openai.OpenAI, model: str, max_tokens: int, leave: threading.Event | None = None) -> None:
        super().__init__(daemon=True)
        self.client, self.model, self.max_tokens, self.leave = client, model, max_tokens, leave
        self.chunks: list[str] = []
        self.first_at: float | None = None
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            stream = self.client.chat.completions.create(
                model=self.model, messages=[{"role": "user", "content": "hello"}], max_tokens=self.max_tokens,
                stream=True)
            for chunk in stream:
                if chunk.choices and chunk.choices[0].delta.content:
                    self.first_at = self.first_at or time.monotonic()
                    self.chunks.append(chunk.choices[0].delta.content)
                if self.leave is not None and self.leave.is_set():
                    stream.close()  # the client goes away
                    return
        except BaseException as exc:  # noqa: BLE001 - the test looks at it
            self.error = exc


def test_the_api_and_the_chat_take_turns_on_the_one_engine(qtbot: QtBot, open_window, chat_prefs: PreferencesStore,
                                                           tiny_target_path: Path,
                                                           request: pytest.FixtureRequest) -> None:
    # a chat answer long enough to still be running when the API request arrives (Esc ends it)
    chat_prefs.update(server_enabled=True, server_port=0, server_api_key=KEY, max_new_tokens=4000)
    window = open_window(chat_prefs)
    api, chat = window.api, window.chat
    statuses: list[str] = []
    api.status_changed.connect(statuses.append)
    assert window.status.api.text() == "API: " + api.url.removeprefix("http://").removesuffix("/v1")
    client = openai.OpenAI(base_url=api.url, api_key=KEY, max_retries=0, timeout=120)
    [card] = client.models.list().data
    assert card.id == tiny_target_path.name

    # a chat answer runs; an API request waits for it, and the status bar says so
    chat_done: list[float] = []  # when the worker finished the chat (a direct connection runs in its thread)
    window.host.worker.generation_finished.connect(lambda _id, _c: chat_done.append(time.monotonic()))
    rendered: list[str] = []
    chat.view.rendered.connect(rendered.append)
    # the worker holds after its first tokens until the API request is queued, so a fast answer
    # cannot end before the request arrives (a direct connection runs in the worker's thread)
    queued = threading.Event()
    request.addfinalizer(queued.set)  # a failing test still lets the worker go before the window closes
    window.host.worker.tokens_generated.connect(lambda *_: queued.wait(60), Qt.ConnectionType.DirectConnection)
    _send(qtbot, window, "tell me a long story")
    qtbot.waitUntil(lambda: bool(rendered), timeout=60_000)
    waiting = ApiCall(client, card.id, max_tokens=6)
    waiting.start()
    qtbot.waitUntil(lambda: "waiting for the chat" in window.status.api.text(), timeout=30_000)
    queued.set()
    assert waiting.first_at is None and window.status.api.isVisible()
    with qtbot.waitSignal(chat.answer_finished, timeout=60_000) as finished:
        qtbot.keyClick(window, Qt.Key.Key_Escape)
    assert finished.args == ["cancelled"]
    qtbot.waitUntil(lambda: not waiting.is_alive(), timeout=60_000)
    assert waiting.error is None and waiting.chunks and waiting.first_at > chat_done[0]
    assert any(text.startswith("API: answering") for text in statuses)

    # an API answer runs; a chat message waits for it until that client leaves
    chat_prefs.update(max_new_tokens=6)
    leave = threading.Event()
    running = ApiCall(client, card.id, max_tokens=1500, leave=leave)
    running.start()
    qtbot.waitUntil(lambda: len(running.chunks) >= 2, timeout=60_000)
    before = len(rendered)
    _send(qtbot, window, "are you there?")
    assert chat.busy
    qtbot.waitUntil(lambda: len(running.chunks) >= 10, timeout=60_000)
    assert len(rendered) == before and chat.view.answer_text == ""  # the chat waits its turn
    with qtbot.waitSignal(chat.answer_finished, timeout=60_000) as finished:
        leave.set()  # the API client leaves: its generation is cancelled, the chat answers
    assert finished.args == ["length"] and chat.view.messages[-1].text
    running.join(30)
    assert running.error is None
    qtbot.waitUntil(lambda: window.status.api.text().startswith("API: 127.0.0.1:"), timeout=30_000)


def test_without_a_model_the_api_says_so_and_a_taken_port_is_reported(qtbot: QtBot, open_window,
                                                                        make_prefs) -> None:
    prefs = make_prefs(server_enabled=True, server_port=0)
    window = open_window(prefs, wait_loaded=False)
    client = openai.OpenAI(base_url=window.api.url, api_key="unused", max_retries=0)
    assert client.models.list().data == []
    with pytest.raises(openai.InternalServerError) as exc:
        client.chat.completions.create(model="any", messages=[{"role": "user", "content": "hi"}])
    assert exc.value.status_code == 503 and "No model is loaded" in exc.value.response.json()["error"]["message"]

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        prefs.update(server_port=port)
        assert str(port) in window.api.error and window.api.url == ""
        assert window.status.api.text() == "API: off (see Settings > Server)"
        assert str(port) in window.status.api.toolTip()
    prefs.update(server_port=0, server_lan=True)  # every network, no key: refused
    assert "API key" in window.api.error
    prefs.update(server_enabled=False)
    assert window.api.error == "" and not window.status.api.isVisible()


def _raw(port: int, method: str, path: str, body: bytes = b"", headers: dict[str, str] | None = None,
         host: str | None = None) -> tuple[int, dict[str, str], bytes]:
    """One request with exactly these headers (Host: 127.0.0.1:PORT unless given)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.putrequest(method, path, skip_host=True, skip_accept_encoding=True)
        conn.putheader("Host", host or f"127.0.0.1:{port}")
        for name, value in {**(headers or {}), "Content-Length": str(len(body))}.items():
            conn.putheader(name, value)
        conn.endheaders(body)
        resp = conn.getresponse()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
    finally:
        conn.close()


def test_the_apps_server_refuses_web_pages_and_lists_nothing_after_a_failed_load(
        qtbot: QtBot, open_window, chat_prefs: PreferencesStore, tiny_target_path: Path, tmp_path: Path) -> None:
    prefs = chat_prefs
    prefs.update(server_enabled=True, server_port=0)
    window = open_window(prefs)
    api = window.api
    port = int(api.url.rsplit(":", 1)[1].split("/")[0])
    status, _, body = _raw(port, "GET", "/v1/models")
    [card] = json.loads(body)["data"]
    assert card["id"] == tiny_target_path.name and card["max_model_len"] == 2048  # the loaded model's context
    # more than the model can read is refused at its real context, not at 2^20 (the worker's
    # `loaded` signal carries it)
    ask = json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2049}).encode()
    status, _, body = _raw(port, "POST", "/v1/chat/completions", ask, {"Content-Type": "application/json"})
    assert status == 400 and "this model's context, 2,048 tokens" in json.loads(body)["error"]["message"]
    prefs.update(target=str(tmp_path / "no-such-model"), draft="")  # the next load fails
    qtbot.waitUntil(lambda: api.model.status == "failed", timeout=LOAD_MS)
    status, _, body = _raw(port, "GET", "/v1/models")
    assert status == 200 and json.loads(body)["data"] == []  # neither the failed model nor the one unloaded
    for name in ("no-such-model", tiny_target_path.name):
        status, _, body = _raw(port, "GET", f"/v1/models/{name}")
        assert status == 404 and json.loads(body)["error"]["code"] == "model_not_found"
    assert _raw(port, "GET", "/health")[0] == 503
    chat = json.dumps({"messages": [{"role": "user", "content": "hi"}]}).encode()
    status, _, body = _raw(port, "POST", "/v1/chat/completions", chat, {"Content-Type": "application/json"})
    assert status == 503 and json.loads(body)["error"]["code"] == "model_not_ready"

    # what a web page can send is refused before anything else, naming the setting that allows it
    for headers, host, code, setting in (
            ({"Content-Type": "text/plain"}, None, 415, "Content-Type: application/json"),
            ({"Content-Type": "application/x-www-form-urlencoded"}, None, 415, "Content-Type: application/json"),
            ({"Content-Type": "application/json", "Origin": "null"}, None, 403, "Allowed web pages"),
            ({"Content-Type": "application/json", "Origin": "https://evil.example"}, None, 403, "Allowed web pages"),
            ({"Content-Type": "application/json"}, "evil.example", 403, "Allowed hosts")):
        status, reply_headers, body = _raw(port, "POST", "/v1/chat/completions", chat, headers, host)
        error = json.loads(body)["error"]
        assert status == code and setting in error["message"] and set(error) == {"message", "type", "param", "code"}
        assert "access-control-allow-origin" not in reply_headers

    prefs.update(server_allowed_hosts="gpu-box.lan", server_allowed_origins="http://localhost:3000")
    assert api.error == "" and api.url
    port = int(api.url.rsplit(":", 1)[1].split("/")[0])
    assert _raw(port, "GET", "/v1/models", host=f"gpu-box.lan:{port}")[0] == 200
    status, headers, _ = _raw(port, "OPTIONS", "/v1/chat/completions", headers={
        "Origin": "http://localhost:3000", "Access-Control-Request-Method": "POST"})
    assert status == 204 and headers["access-control-allow-origin"] == "http://localhost:3000"
    prefs.update(server_allowed_origins="localhost:3000")  # no scheme: not an origin
    assert "localhost:3000" in api.error and api.url == ""
