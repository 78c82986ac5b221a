"""RemoteEngine and `specchat chat --remote` against servers that do not answer like an OpenAI
server at all, as raw bytes on a real socket on 127.0.0.1: a web page, a redirect (to another
host: never followed, the request carries the API key), an empty 204, a stream that never ends
although max_tokens was 8; and URLs or API keys no HTTP request can carry. Each is one
RemoteError that says what the server did (not "closed the connection in the middle of the
answer", not "cannot reach"), never the "This is a bug" fallback, and memory stays bounded."""

from __future__ import annotations

import io
import socket
import threading
import time
from collections.abc import Callable, Iterator

import pytest

from engine.cli.main import main
from engine.errors import RemoteDisconnected, RemoteError
from engine.serving.remote import RemoteEngine, list_models
from engine.types import GenerationRequest, Message, RemoteModel, TokenEvent

Responder = Callable[[socket.socket, bytes], None]


class RawServer:
    """Accepts connections; each gets `responder(connection, request head)` after its request
    is read. `requests` holds the heads received."""

    def __init__(self, responder: Responder) -> None:
        self.responder = responder
        self.requests: list[bytes] = []
        self.ended = threading.Event()  # a responder saw the client go away
        self._sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._sock.getsockname()[1]}/v1"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            data = b""
            while b"\r\n\r\n" not in data:
                chunk = conn.recv(65536)
                if not chunk:
                    return
                data += chunk
            head, _, body = data.partition(b"\r\n\r\n")
            length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                           if line.lower().startswith(b"content-length:")), 0)
            while len(body) < length:
                body += conn.recv(65536)
            self.requests.append(head)
            try:
                self.responder(conn, head)
            except OSError:
                self.ended.set()

    def close(self) -> None:
        self._sock.close()


def answer(status: str, headers: list[tuple[str, str]], body: bytes = b"") -> Responder:
    head = "".join(f"{k}: {v}\r\n" for k, v in headers)
    data = f"HTTP/1.1 {status}\r\n{head}Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode() + body
    return lambda conn, _: conn.sendall(data)


def endless(conn: socket.socket, head: bytes) -> None:
    """A stream that ignores max_tokens: 400 MB of 4,000-character deltas unless the client leaves."""
    conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n\r\n")
    line = b'data: {"choices": [{"index": 0, "delta": {"content": "' + b"x" * 4000 + b'"}}]}\n\n'
    for _ in range(100_000):
        conn.sendall(line)


@pytest.fixture
def serve() -> Iterator[Callable[[Responder], RawServer]]:
    servers: list[RawServer] = []

    def start(responder: Responder) -> RawServer:
        servers.append(RawServer(responder))
        return servers[-1]

    yield start
    for server in servers:
        server.close()


def generate(url: str, key: str = "sk-secret") -> list[object]:
    request = GenerationRequest(messages=(Message("user", "hi"),), max_new_tokens=8)
    return list(RemoteEngine(RemoteModel(url, "m", key)).generate(request))


NOT_ANSWERS: list[tuple[str, Responder, str]] = [
    ("a web page", answer("200 OK", [("Content-Type", "text/html")], b"<html>Sign in</html>"), "text/html"),
    ("plain text", answer("200 OK", [("Content-Type", "text/plain")], b"It works!"), "text/plain"),
    ("no content", answer("204 No Content", []), "HTTP 204"),
    ("a redirect to another host", answer("302 Found", [("Location", "http://evil.example/v1/chat/completions")]),
     "redirects (HTTP 302) to http://evil.example/v1/chat/completions"),
    ("a redirect on the same host", answer("307 Temporary Redirect", [("Location", "/api/v1/chat/completions")]),
     "redirects (HTTP 307) to /api/v1/chat/completions"),
    ("a permanent redirect without a place", answer("308 Permanent Redirect", []), "redirects (HTTP 308) to nowhere"),
]


@pytest.mark.parametrize("case, responder, said", NOT_ANSWERS, ids=[c for c, _, _ in NOT_ANSWERS])
def test_an_answer_that_is_no_openai_answer_says_what_came(serve: Callable[[Responder], RawServer], case: str,
                                                           responder: Responder, said: str) -> None:
    server = serve(responder)
    with pytest.raises(RemoteError) as exc:
        generate(server.url)
    assert not isinstance(exc.value, RemoteDisconnected)  # the server did not go away mid-answer
    message = exc.value.user_message
    assert said in message and server.url in message and "middle of the answer" not in message, message
    assert len(server.requests) == 1  # a redirect is not followed: the key goes nowhere else


def test_a_server_that_ignores_max_tokens_is_stopped(serve: Callable[[Responder], RawServer]) -> None:
    server = serve(endless)
    request = GenerationRequest(messages=(Message("user", "hi"),), max_new_tokens=8)
    events = RemoteEngine(RemoteModel(server.url, "m")).generate(request)
    received = ""
    with pytest.raises(RemoteError) as exc:
        for event in events:
            assert isinstance(event, TokenEvent)
            received += event.text
    assert "more text than the 8 tokens asked for" in exc.value.user_message
    assert 0 < len(received) <= 8 * 1024  # what came before is kept, and no more (1,024 characters a token)
    assert server.ended.wait(10)  # the connection was closed: the server stopped sending


@pytest.mark.parametrize("url", ["http://\udcff/v1", "http://gpu-box\n/v1", "http://gpu-box/v1?\x7f",
                                 "http://gpu\x00box/v1"])
def test_a_url_no_request_can_carry_is_a_remote_error(url: str) -> None:
    with pytest.raises(RemoteError) as exc:
        list_models(url)
    assert "not an http(s) URL" in exc.value.user_message
    with pytest.raises(RemoteError):
        generate(url)


@pytest.mark.parametrize("key", ["sk-\r\nX-Injected: 1", "ключ", "sk-\udcff", "sk-\x00", "sk-é"])
def test_an_api_key_no_header_can_carry_is_a_remote_error(serve: Callable[[Responder], RawServer], key: str) -> None:
    server = serve(answer("200 OK", [("Content-Type", "application/json")], b'{"data": [{"id": "m"}]}'))
    for call in (lambda: list_models(server.url, key), lambda: generate(server.url, key)):
        with pytest.raises(RemoteError) as exc:
            call()
        assert "API key" in exc.value.user_message
    assert server.requests == []  # nothing was sent


@pytest.mark.parametrize("args", [["--remote", "http://gpu-box\n:8000/v1"], ["--remote", "http://\udce9t\u00e9/v1"],
                                  ["--remote", "{url}", "--api-key", "ключ"]])
def test_chat_remote_says_one_error_line_for_what_it_cannot_send(
        serve: Callable[[Responder], RawServer], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
        args: list[str]) -> None:
    server = serve(answer("200 OK", [("Content-Type", "application/json")], b'{"data": [{"id": "m"}]}'))
    monkeypatch.setattr("sys.stdin", io.StringIO("hi\n"))
    started = time.monotonic()
    rc = main(["chat", *(a.format(url=server.url) for a in args)])
    out, err = capsys.readouterr()
    assert rc == 1 and out == "" and err.startswith("error: ") and len(err.strip().splitlines()) == 1, err
    assert "bug" not in err and time.monotonic() - started < 10
