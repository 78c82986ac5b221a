"""A real API server on 127.0.0.1 over a scripted backend (no model: each request answers
"hello world" in two pieces, and counts itself, so a test can tell that no generation ran), and
raw HTTP to it with any Host, Origin and Content-Type a web page or a hostile client sends.
Imported by name (tests/engine/serving is on sys.path)."""

from __future__ import annotations

import http.client
import json
import threading
from collections.abc import Iterator
from dataclasses import dataclass

from engine.serving.protocol import RequestDefaults
from engine.serving.scheduler import GenerationQueue, ModelState
from engine.serving.server import Server, ServeSettings
from engine.types import Completion, FinishReason, GenerationRequest, GenerationStats, TokenEvent

MODEL = "scripted-model"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}


def stats(new_tokens: int) -> GenerationStats:
    return GenerationStats(prompt_tokens=3, new_tokens=new_tokens, target_passes=new_tokens, tokens_per_pass=1.0,
                           draft_passes=0, budget=0, seconds=0.01, ttft_seconds=0.005, tokens_per_second=100.0,
                           peak_rss_bytes=0, mode="autoregressive")


class ScriptedBackend:
    """engine.types.GenerationBackend without a model: "hello world" (or the given `pieces`,
    ending as `finish` says), or with `hold` set, a piece every `hold` seconds until cancelled
    (then a "cancelled" Completion, as the Engine). `requests` keeps what it was asked."""

    def __init__(self, hold: float | None = None, pieces: tuple[str, ...] = ("hello ", "world"),
                 finish: FinishReason = "length") -> None:
        self.calls = 0
        self.hold = hold
        self.pieces = pieces
        self.finish = finish
        self.requests: list[GenerationRequest] = []
        self._lock = threading.Lock()

    def generate(self, request: GenerationRequest,
                 cancel: threading.Event | None = None) -> Iterator[TokenEvent | Completion]:
        with self._lock:
            self.calls += 1
            self.requests.append(request)
        return self._events(cancel or threading.Event())

    def _events(self, cancel: threading.Event) -> Iterator[TokenEvent | Completion]:
        if self.hold is None:
            pieces = self.pieces
            for i, piece in enumerate(pieces):
                yield TokenEvent((i + 1,), piece)
            yield Completion("".join(pieces), tuple(range(1, len(pieces) + 1)), self.finish, stats(len(pieces)))
            return
        count = 0
        while not cancel.wait(self.hold):
            count += 1
            yield TokenEvent((count,), "word ")
        yield Completion("word " * count, tuple(range(count)), "cancelled", stats(count))


def start_server(backend: ScriptedBackend | None = None, context_length: int = 2048, chat_template: str = "",
                 **settings: object) -> Server:
    queue = GenerationQueue(capacity=4)
    if backend is not None:
        queue.set_model(ModelState(MODEL, "ready", context_length=context_length, chat_template=chat_template),
                        backend)
    server = Server(ServeSettings(port=0, **settings), queue, RequestDefaults)  # type: ignore[arg-type]
    server.start()
    return server


@dataclass
class Reply:
    status: int
    headers: dict[str, str]
    body: bytes

    def json(self) -> dict:
        return json.loads(self.body)

    def error(self) -> dict:
        """The OpenAI-shaped error: exactly {"error": {message, type, param, code}}."""
        body = self.json()
        assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
        assert body["error"]["message"]
        return body["error"]


def raw(port: int, method: str, path: str, body: bytes | str | dict | None = None,
        headers: list[tuple[str, str]] | None = None, host: str | None = "default", timeout: float = 30) -> Reply:
    """One request with exactly the given headers (`host` None: no Host header; "default":
    127.0.0.1:PORT), over a fresh connection."""
    data = json.dumps(body).encode() if isinstance(body, dict) else body.encode() if isinstance(body, str) else body
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.putrequest(method, path, skip_host=True, skip_accept_encoding=True)
        if host == "default":
            host = f"127.0.0.1:{port}"
        if host is not None:
            conn.putheader("Host", host)
        for name, value in headers or []:
            conn.putheader(name, value)
        if data is not None:
            conn.putheader("Content-Length", str(len(data)))
        conn.endheaders(data)
        resp = conn.getresponse()
        return Reply(resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read())
    finally:
        conn.close()


JSON = [("Content-Type", "application/json")]
