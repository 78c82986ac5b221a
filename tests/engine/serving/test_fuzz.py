"""A seeded fuzz of the server's request parsing: bodies mutated from valid chat and completion
requests (byte flips, deletions, insertions of brackets, quotes, huge numbers and deep nesting,
wrong types in every field) sent to the real ASGI app over a queue with a scripted backend, in
bursts; then a burst of the refused ones against `specchat serve` as a process. Never a 500, never
a traceback, every refusal in OpenAI's shape, and a valid request is answered after each burst."""

from __future__ import annotations

import asyncio
import json
import logging
import random
from collections.abc import Iterator
from typing import Any

import httpx2
import pytest
from scripted import CHAT, JSON, MODEL, ScriptedBackend, raw
from serve_process import API_KEY, ServeProcess

from engine.serving.app import build_app
from engine.serving.guard import AccessPolicy
from engine.serving.protocol import RequestDefaults
from engine.serving.scheduler import GenerationQueue, ModelState

SEED = 20260126
BURSTS, PER_BURST = 10, 150
HOST = "http://127.0.0.1:8765"
VALID: list[tuple[str, dict[str, Any]]] = [
    ("/v1/chat/completions", CHAT),
    ("/v1/chat/completions", {"model": MODEL, "stream": True, "stream_options": {"include_usage": True},
                              "messages": [{"role": "system", "content": "Be brief."},
                                           {"role": "user", "content": [{"type": "text", "text": "hi"}]},
                                           {"role": "assistant", "content": "Hello."},
                                           {"role": "user", "content": "more"}],
                              "max_completion_tokens": 16, "temperature": 0.7, "top_p": 0.9, "top_k": 40,
                              "min_p": 0.05, "repetition_penalty": 1.1, "seed": 7, "n": 2, "stop": ["###", "END"],
                              "presence_penalty": 0.0, "user": "u1", "response_format": {"type": "text"}}),
    ("/v1/completions", {"model": MODEL, "prompt": "The quick brown", "max_tokens": 8, "temperature": 0,
                         "stop": "\n", "echo": False, "logprobs": None}),
    ("/v1/completions", {"prompt": ["def fib(n):"], "stream": True, "n": 1, "seed": 3, "temperature": 1.0}),
]
WRONG: list[Any] = [None, True, False, 0, -1, 1.5, -0.0, 2**63, 2**64, 10**39, 1e300, "", "x", "\ud800", "a" * 5000,
                    [], {}, [[[]]], [None], {"": None}, json.loads("[" * 60 + "]" * 60)]
TOKENS: list[bytes] = [b"[", b"]", b"{", b"}", b'"', b"\\", b",", b":", b"9" * 5000, b"-" + b"1" * 41, b"1e400",
                       b"-1e400", b"NaN", b"-Infinity", b'"\\ud800"', b"\\ud800", b"[" * 100_000,
                       b'{"a":' * 5_000, b"\x00", b"\xff\xfe", b"true", b"null", b"0.0000001", b"1" * 40, b"\t\n "]


def paths(value: Any, prefix: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    yield prefix
    if isinstance(value, dict):
        for key, item in value.items():
            yield from paths(item, (*prefix, key))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            yield from paths(item, (*prefix, index))


def with_value(value: Any, path: tuple[Any, ...], new: Any, delete: bool = False) -> Any:
    if not path:
        return new
    copy = dict(value) if isinstance(value, dict) else list(value)
    head, rest = path[0], path[1:]
    if delete and not rest:
        del copy[head]
    else:
        copy[head] = with_value(copy[head], rest, new, delete)
    return copy


def mutate(rng: random.Random, body: dict[str, Any]) -> bytes:
    """One hostile body from a valid one."""
    op = rng.random()
    if op < 0.45:  # a wrong type or value somewhere, a field removed, or an unknown one added
        path = rng.choice(list(paths(body)))
        if path and rng.random() < 0.2:
            return json.dumps(with_value(body, path, None, delete=True)).encode()
        if rng.random() < 0.1:
            return json.dumps({**body, rng.choice(["x", "metadata", "tools", "n", "logit_bias"]): rng.choice(WRONG)}).encode()
        return json.dumps(with_value(body, path, rng.choice(WRONG))).encode()
    data = bytearray(json.dumps(body).encode())
    for _ in range(rng.randint(1, 3)):
        where = rng.randrange(len(data) + 1)
        kind = rng.random()
        if kind < 0.3 and data:  # flip a byte
            data[min(where, len(data) - 1)] = rng.randrange(256)
        elif kind < 0.5:  # delete a span
            del data[where:where + rng.randint(1, 12)]
        else:  # insert brackets, quotes, huge numbers, deep nesting
            data[where:where] = rng.choice(TOKENS)
    return bytes(data)


def check(status: int, body: bytes, stream_asked: bool) -> None:
    assert status in (200, 400, 404, 413), (status, body[:300])
    if status != 200:
        error = json.loads(body)["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["message"]
    elif body.startswith(b"data: "):
        assert body.endswith(b"data: [DONE]\n\n")
    else:
        assert json.loads(body)["choices"]


@pytest.fixture(scope="module")
def cases() -> list[tuple[str, bytes]]:
    rng = random.Random(SEED)
    out = []
    for _ in range(BURSTS * PER_BURST):
        path, body = rng.choice(VALID)
        out.append((path, mutate(rng, body)))
    return out


def test_fuzzed_bodies_never_fail_the_server(cases: list[tuple[str, bytes]], caplog: pytest.LogCaptureFixture,
                                             capfd: pytest.CaptureFixture[str]) -> None:
    backend = ScriptedBackend()
    queue = GenerationQueue(capacity=4)
    queue.set_model(ModelState(MODEL, "ready", context_length=2048), backend)
    app = build_app(queue, RequestDefaults, access=AccessPolicy(port=8765))
    statuses: dict[int, int] = {}

    async def run() -> None:
        async with httpx2.AsyncClient(transport=httpx2.ASGITransport(app=app), base_url=HOST, timeout=30) as client:
            for burst in range(BURSTS):
                for path, body in cases[burst * PER_BURST:(burst + 1) * PER_BURST]:
                    reply = await client.post(path, content=body, headers=dict(JSON))
                    statuses[reply.status_code] = statuses.get(reply.status_code, 0) + 1
                    check(reply.status_code, reply.content, b'"stream": true' in body)
                after = await client.post("/v1/chat/completions", json=CHAT)
                assert after.status_code == 200 and after.json()["choices"][0]["message"]["content"] == "hello world"

    caplog.set_level(logging.WARNING)
    try:
        asyncio.run(run())
    finally:
        queue.close(wait=5)
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text[:2000]
    assert "Traceback" not in capfd.readouterr().err
    assert statuses.get(400, 0) > 500 and statuses.get(200, 0) > 100, statuses  # both sides were exercised


def test_a_burst_of_refused_bodies_against_specchat_serve(cases: list[tuple[str, bytes]],
                                                         tiny_server: ServeProcess) -> None:
    """The refused ones (no generation: fast) over real HTTP to the CLI's server process."""
    port = int(tiny_server.url.rsplit(":", 1)[1].split("/")[0])
    start, seen = len(tiny_server.lines), len(tiny_server.request_lines())
    headers = [*JSON, ("Authorization", f"Bearer {API_KEY}")]
    refused = [(path, body) for path, body in cases if not _valid(body)][:200]
    for path, body in refused:
        reply = raw(port, "POST", path, body, headers)
        assert reply.status in (400, 404, 413), (reply.status, body[:200], reply.body[:300])
        check(reply.status, reply.body, False)
    ok = raw(port, "POST", "/v1/completions", {"prompt": "The", "max_tokens": 2}, headers)
    assert ok.status == 200 and ok.json()["usage"]["completion_tokens"] == 2
    tiny_server.wait_for(lambda line: line.startswith("request ") and "+ 2 tokens" in line, start=start)
    assert len(tiny_server.request_lines()) == seen + 1  # nothing refused ran
    assert not any("Traceback" in line for line in tiny_server.lines[start:])


def _valid(body: bytes) -> bool:
    """Whether a body might pass parsing (then it would run the tiny model: left out here)."""
    try:
        value = json.loads(body)
    except (ValueError, RecursionError):
        return False
    return isinstance(value, dict) and (isinstance(value.get("messages"), list) or isinstance(value.get("prompt"),
                                                                                              (str, list)))
