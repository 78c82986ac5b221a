"""Hostile request bodies as raw HTTP to a real server on 127.0.0.1: JSON nested 100,000 deep
(where it matters and where it is ignored), numbers of thousands of digits, every numeric field
with the wrong type or out of range, text that is not Unicode. Each is a 400 (413 for size) in
OpenAI's shape naming the field where there is one, nothing runs, and no traceback reaches stderr.
Also: a max_tokens beyond the model's context is refused, saying the limit."""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator

import pytest
from scripted import CHAT, JSON, MODEL, ScriptedBackend, raw, start_server
from serve_process import API_KEY, ServeProcess

from engine.serving.server import Server

DEEP = 100_000
USER = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def backend() -> ScriptedBackend:
    return ScriptedBackend()


@pytest.fixture(scope="module")
def server(backend: ScriptedBackend) -> Iterator[Server]:
    served = start_server(backend, context_length=2048)
    yield served
    served.stop()


def post(server: Server, body: bytes | dict, path: str = "/v1/chat/completions"):  # type: ignore[no-untyped-def]
    return raw(server.port, "POST", path, body, JSON)


def nested(depth: int, inner: str = "1") -> str:
    return "[" * depth + inner + "]" * depth


BODIES: list[tuple[str, bytes, str | None]] = [  # (case, body, the param named)
    ("deep messages", f'{{"messages": {nested(DEEP)}}}'.encode(), None),
    ("deep ignored field", f'{{"messages": {json.dumps(USER)}, "metadata": {nested(DEEP)}}}'.encode(), None),
    ("deep objects", ('{"messages": ' + json.dumps(USER) + ', "x": ' + '{"a":' * DEEP + "1" + "}" * DEEP + "}").encode(),
     None),
    ("deep unbalanced", b'{"messages": ' + b"[" * DEEP, None),
    ("5000-digit max_tokens", f'{{"messages": {json.dumps(USER)}, "max_tokens": {"9" * 5000}}}'.encode(), None),
    ("5000-digit ignored number", f'{{"messages": {json.dumps(USER)}, "user": -{"1" * 5000}}}'.encode(), None),
    ("NaN", f'{{"messages": {json.dumps(USER)}, "temperature": NaN}}'.encode(), None),
    ("Infinity in an ignored field", f'{{"messages": {json.dumps(USER)}, "x": -Infinity}}'.encode(), None),
    ("not UTF-8", b'{"messages": [{"role": "user", "content": "\xff\xfe"}]}', None),
    ("lone surrogate in content", b'{"messages": [{"role": "user", "content": "a\\ud800b"}]}', None),
    ("lone surrogate in model", b'{"model": "\\udfff", "messages": [{"role": "user", "content": "hi"}]}', None),
    ("lone surrogate in a key", b'{"\\ud800": 1, "messages": [{"role": "user", "content": "hi"}]}', None),
    ("empty", b"", None),
    ("truncated", b'{"messages": [', None),
    ("a list", b"[]", None),
    ("a string", b'"hi"', None),
    ("null", b"null", None),
]

FIELDS: list[tuple[str, object]] = [(name, value) for name, values in {
    "max_tokens": [True, False, 5.0, 5.5, -1, 0, "5", [5], {"n": 5}, 1e300, 10**12, 2049, 10**39],
    "max_completion_tokens": [True, 2.0, -5, 0, "8", 10**12],
    "n": [True, 1.0, 0, -1, 9, 10**30, "2", [1]],
    "seed": [True, 1.5, -1, 2**64, 10**39, "7", {}],
    "temperature": [True, "hot", -1, 101, 1e300, [], {}],
    "top_p": [True, 0, -0.5, 1.5, "1", [1.0]],
    "top_k": [True, -1, 1.5, "40", [40]],
    "min_p": [True, -0.1, 2, "0"],
    "repetition_penalty": [True, 0, -1, 1000, "1.1"],
    "stream": ["yes", 1, 0, [], {}],
    "model": [5, True, ["m"], {"id": "m"}],
    "stop": [5, True, [1], [[]], [{}], ["s"] * 17, {"a": "b"}],
    "messages": [None, "hi", 5, [], {}, ["hi"], [None], [[]], [{"role": []}], [{"role": {}}], [{"role": 5}],
                 [{"role": None, "content": "x"}], [{"role": "user", "content": 5}],
                 [{"role": "user", "content": {"text": "x"}}], [{"role": "user", "content": [5]}],
                 [{"role": "user", "content": [{"type": "text", "text": 5}]}], [{"role": "tool", "content": "x"}]],
    "response_format": ["json", [], {"type": []}, {"type": "xml"}, {"type": "json_schema"},
                        {"type": "json_schema", "json_schema": {"schema": False}},
                        {"type": "json_schema", "json_schema": {"schema": {"type": "object", "if": {}}}}],
    "logprobs": [5, 1.0, "yes", [True], {}],
    "top_logprobs": [21, -1, 2.5, "3", True, 10**30],
    "presence_penalty": ["0", True, 3, -2.5, [0]],
    "frequency_penalty": ["0", False, 1e300],
}.items() for value in values]


@pytest.mark.parametrize("case, body, param", BODIES, ids=[case for case, _, _ in BODIES])
def test_hostile_bodies_are_400_in_openais_shape(server: Server, backend: ScriptedBackend,
                                                 capfd: pytest.CaptureFixture[str], case: str, body: bytes,
                                                 param: str | None) -> None:
    before = backend.calls
    for path in ("/v1/chat/completions", "/v1/completions"):
        reply = post(server, body, path)
        assert reply.status == 400, (case, reply.body[:300])
        error = reply.error()
        assert error["type"] == "invalid_request_error" and len(error["message"]) < 1000
    assert backend.calls == before
    err = capfd.readouterr().err
    assert "Traceback" not in err and "RecursionError" not in err


@pytest.mark.parametrize("name, value", FIELDS, ids=[f"{n}={str(v)[:20]}" for n, v in FIELDS])
def test_every_field_with_a_wrong_type_or_range_is_400_naming_it(server: Server, backend: ScriptedBackend,
                                                                 capfd: pytest.CaptureFixture[str], name: str,
                                                                 value: object) -> None:
    before = backend.calls
    reply = post(server, {**CHAT, "temperature": 0.7, name: value})
    assert reply.status == 400, (name, value, reply.body[:300])
    error = reply.error()
    assert error["param"] in (name, "seed", None) and len(error["message"]) < 1000
    if error["param"] is None:  # the engine's own settings check words it: the field is still named
        assert name.replace("_", " ").split()[0] in error["message"].lower().replace("-", " ")
    assert backend.calls == before
    assert "Traceback" not in capfd.readouterr().err


def test_max_tokens_beyond_the_context_is_refused_saying_the_limit(server: Server, backend: ScriptedBackend) -> None:
    for name in ("max_tokens", "max_completion_tokens"):
        error = post(server, {**CHAT, name: 10**12}).error()
        assert error["param"] == name and "2048" in error["message"] and "1000000000000" in error["message"]
    error = post(server, {"prompt": "x", "max_tokens": 10**12}, "/v1/completions").error()
    assert error["param"] == "max_tokens" and "2048" in error["message"]
    assert post(server, {**CHAT, "max_tokens": 2048}).status == 200  # the whole context may be asked for


def test_a_body_over_the_limit_is_413(server: Server, backend: ScriptedBackend) -> None:
    before = backend.calls
    big = json.dumps({**CHAT, "x": "a" * (9 * 1024 * 1024)}).encode()
    reply = post(server, big)
    assert reply.status == 413 and reply.error()["code"] == "request_too_large"
    assert backend.calls == before


@pytest.mark.parametrize("expect", [False, True])
def test_a_body_declared_over_the_limit_is_413_before_it_is_sent(server: Server, backend: ScriptedBackend,
                                                                 expect: bool) -> None:
    """A client that declares 100 GB (and may send it slowly, or never) is answered at once,
    without "100 Continue": nothing is read, nothing waits for the body."""
    before = backend.calls
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as conn:
        conn.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 100000000000\r\n" + (b"Expect: 100-continue\r\n" if expect else b"")
                     + b"\r\n{")
        answer = b""
        while b"request_too_large" not in answer and (chunk := conn.recv(65536)):
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 413 "), answer[:200]
    assert b"100 Continue" not in answer and backend.calls == before


def test_a_body_that_stops_arriving_is_408_and_frees_the_connection(backend: ScriptedBackend) -> None:
    """A client that declares a body and stops sending (slowloris) is answered after the stall
    limit instead of holding the connection forever; nothing runs."""
    import time

    slow = start_server(backend, body_stall_s=0.5)
    try:
        before = backend.calls
        with socket.create_connection(("127.0.0.1", slow.port), timeout=10) as conn:
            conn.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                         b"Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"model\"")
            t0 = time.perf_counter()
            answer = b""
            while b"request_timeout" not in answer and (chunk := conn.recv(65536)):
                answer += chunk
            waited = time.perf_counter() - t0
        assert answer.startswith(b"HTTP/1.1 408 "), answer[:200]
        assert 0.4 < waited < 5 and backend.calls == before
    finally:
        slow.stop()


def test_the_server_answers_after_the_hostile_bodies(server: Server, backend: ScriptedBackend) -> None:
    for _, body, _ in BODIES:
        post(server, body)
    reply = post(server, CHAT)
    assert reply.status == 200 and reply.json()["choices"][0]["message"]["content"] == "hello world"
    assert reply.json()["model"] == MODEL


def test_specchat_serve_refuses_deep_json_without_a_traceback(tiny_server: ServeProcess) -> None:
    port = int(tiny_server.url.rsplit(":", 1)[1].split("/")[0])
    start, seen = len(tiny_server.lines), len(tiny_server.request_lines())
    auth = [("Authorization", f"Bearer {API_KEY}")]
    for body in (f'{{"messages": {nested(DEEP)}}}', f'{{"messages": {json.dumps(USER)}, "max_tokens": {"9" * 5000}}}',
                 f'{{"messages": {json.dumps(USER)}, "max_tokens": 1000000000000}}',
                 '{"messages": [{"role": [], "content": "x"}]}'):
        reply = raw(port, "POST", "/v1/chat/completions", body, [*JSON, *auth])
        assert reply.status == 400 and reply.error()["type"] == "invalid_request_error", reply.body[:300]
    ok = raw(port, "POST", "/v1/chat/completions", {"messages": USER, "max_tokens": 2}, [*JSON, *auth])
    assert ok.status == 200
    tiny_server.wait_for(lambda line: line.startswith("request ") and "+ 2 tokens" in line, start=start)
    assert len(tiny_server.request_lines()) == seen + 1
    assert not any("Traceback" in line or "Error" in line for line in tiny_server.lines[start:]), tiny_server.lines
