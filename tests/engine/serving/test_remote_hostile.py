"""RemoteEngine and `specchat chat --remote` against a hostile server on 127.0.0.1 (the vLLM
stand-in sending raw bytes): a model list or stream event nested 100,000 deep, `choices` or
`delta` of the wrong shape, numbers of thousands of digits, a line without end. Each is a
RemoteError saying the server's answer cannot be read (one `error:` line in the CLI), never
the "This is a bug" fallback; a server that sends one whole JSON answer is read as one."""

from __future__ import annotations

import io
from collections.abc import Iterator

import pytest
from vllm_standin import MODEL, VllmStandIn

from engine.cli.main import main
from engine.errors import RemoteError
from engine.serving.remote import RemoteEngine, list_models
from engine.types import Completion, GenerationRequest, Message, RemoteModel, TokenEvent

DEEP = 100_000
CHUNK = b'{"id": "c", "object": "chat.completion.chunk", "choices": %s}'


@pytest.fixture(scope="module")
def stand_in() -> Iterator[VllmStandIn]:
    server = VllmStandIn().start()
    yield server
    server.stop()


@pytest.fixture
def hostile(stand_in: VllmStandIn) -> VllmStandIn:
    stand_in.models_body = stand_in.events = stand_in.answer = None
    return stand_in


MODEL_LISTS: list[tuple[str, bytes]] = [
    ("nested", b'{"object": "list", "data": ' + b"[" * DEEP + b"]" * DEEP + b"}"),
    ("nested objects", b'{"data": [' + b'{"a":' * DEEP + b"1" + b"}" * DEEP + b"]}"),
    ("5000 digits", b'{"data": [{"id": "m", "created": ' + b"9" * 5000 + b"}]}"),
    ("data a string", b'{"data": "model"}'),
    ("data items not objects", b'{"data": ["m"]}'),
    ("id not a string", b'{"data": [{"id": {"x": 1}}]}'),
    ("a list", b"[]"),
    ("not JSON", b"<html>hello</html>"),
    ("huge", b'{"data": [], "pad": "' + b"a" * (9 * 1024 * 1024) + b'"}'),
]

EVENTS: list[tuple[str, list[bytes]]] = [
    ("nested event", [b"[" * DEEP + b"]" * DEEP]),
    ("nested choices", [CHUNK % (b"[" * DEEP + b"]" * DEEP)]),
    ("nested delta", [CHUNK % (b'[{"index": 0, "delta": ' + b'{"a":' * DEEP + b"1" + b"}" * DEEP + b"}]")]),
    ("choices a string", [CHUNK % b'"abc"']),
    ("choices an object", [CHUNK % b'{"index": 0}']),
    ("choice a string", [CHUNK % b'["abc"]']),
    ("delta a string", [CHUNK % b'[{"index": 0, "delta": "abc"}]']),
    ("delta a list", [CHUNK % b'[{"index": 0, "delta": ["abc"]}]']),
    ("content a number", [CHUNK % b'[{"index": 0, "delta": {"content": 5}}]']),
    ("content an object", [CHUNK % b'[{"index": 0, "delta": {"content": {"text": "x"}}}]']),
    ("text a list", [CHUNK % b'[{"index": 0, "text": ["x"]}]']),
    ("index a string", [CHUNK % b'[{"index": "0", "delta": {"content": "x"}}]']),
    ("finish_reason a number", [CHUNK % b'[{"index": 0, "delta": {}, "finish_reason": 5}]']),
    ("event a list", [b"[1, 2]"]),
    ("event a string", [b'"hello"']),
    ("5000-digit number", [CHUNK % (b'[{"index": 0, "delta": {"content": "x"}, "n": ' + b"9" * 5000 + b"}]")]),
    ("NaN", [CHUNK % b'[{"index": NaN}]']),
    ("not JSON", [b"{oops"]),
    ("an error", [b'{"error": {"message": "the GPU is on fire", "type": "server_error"}}']),
    ("a line without end", [b'"' + b"a" * (2 * 1024 * 1024)]),
]


def ask(text: str = "hi") -> GenerationRequest:
    return GenerationRequest(messages=(Message("user", text),), max_new_tokens=8)


def run(server: VllmStandIn) -> list[TokenEvent | Completion]:
    return list(RemoteEngine(RemoteModel(server.url, MODEL)).generate(ask()))


@pytest.mark.parametrize("case, body", MODEL_LISTS, ids=[c for c, _ in MODEL_LISTS])
def test_a_hostile_model_list_is_a_remote_error(hostile: VllmStandIn, case: str, body: bytes) -> None:
    hostile.models_body = body
    with pytest.raises(RemoteError) as exc:
        list_models(hostile.url)
    message = exc.value.user_message
    assert hostile.url in message and "model list" in message and len(message) < 1000


@pytest.mark.parametrize("case, events", EVENTS, ids=[c for c, _ in EVENTS])
def test_a_hostile_stream_is_a_remote_error(hostile: VllmStandIn, case: str, events: list[bytes]) -> None:
    hostile.events = events
    with pytest.raises(RemoteError) as exc:
        run(hostile)
    message = exc.value.user_message
    assert hostile.url in message and len(message) < 1000
    if case == "an error":
        assert "the GPU is on fire" in message
    else:
        assert "cannot read" in message or "longer than" in message


def test_odd_but_harmless_answers_are_read(hostile: VllmStandIn) -> None:
    hostile.events = [CHUNK % b'[{"index": 0, "delta": {"role": "assistant", "content": null}}]',
                      CHUNK % b'[{"index": 0, "delta": null}]',
                      CHUNK % b'[{"index": 1, "delta": {"content": "other choice"}}]',
                      CHUNK % b'[{"index": 0, "delta": {"content": "Hi"}, "finish_reason": null}]',
                      CHUNK % b'[{"index": 0, "delta": {}, "finish_reason": "stop"}]',
                      b'{"choices": [], "usage": {"prompt_tokens": 1e400, "completion_tokens": -3, '
                      b'"specchat": {"tokens_per_pass": 1e400, "target_passes": "x"}}}']
    *tokens, done = run(hostile)
    assert [t.text for t in tokens] == ["Hi"] and isinstance(done, Completion) and done.text == "Hi"  # type: ignore[union-attr]
    assert done.stats.prompt_tokens == 0 and done.stats.new_tokens == 0 and done.stats.tokens_per_pass == 0.0
    # a server that ignores "stream": true and answers with one object
    hostile.events = None
    hostile.answer = ("application/json", b'{"choices": [{"index": 0, "message": {"role": "assistant", '
                                          b'"content": "whole"}, "finish_reason": "length"}], '
                                          b'"usage": {"completion_tokens": 1}}')
    *tokens, done = run(hostile)
    assert [t.text for t in tokens] == ["whole"] and done.finish_reason == "length"  # type: ignore[union-attr]
    hostile.answer = ("application/json", b"[" * DEEP)
    with pytest.raises(RemoteError):
        run(hostile)


@pytest.mark.parametrize("url", ["http://[::1", "http://host:99999/v1", "http://host:port/v1", "ftp://host/v1",
                                 "http://:8000/v1"])
def test_a_url_that_is_not_one_is_a_remote_error(url: str) -> None:
    with pytest.raises(RemoteError) as exc:
        list_models(url)
    assert "not an http(s) URL" in exc.value.user_message


def chat(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], server: VllmStandIn,
         lines: str) -> tuple[int, str, str]:
    monkeypatch.setattr("sys.stdin", io.StringIO(lines))
    rc = main(["chat", "--remote", server.url, "--model", MODEL])
    out, err = capsys.readouterr()
    return rc, out, err


def test_chat_remote_says_one_error_line(hostile: VllmStandIn, monkeypatch: pytest.MonkeyPatch,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    hostile.models_body = b'{"data": ' + b"[" * DEEP + b"]" * DEEP + b"}"
    rc, _, err = chat(monkeypatch, capsys, hostile, "hi\n")
    assert rc == 1 and err.startswith("error: ") and len(err.strip().splitlines()) == 1, err
    assert "bug" not in err and "RecursionError" not in err

    hostile.models_body = None
    hostile.events = [CHUNK % b'[{"index": 0, "delta": {"content": "par"}}]', CHUNK % b'"abc"']
    rc, out, err = chat(monkeypatch, capsys, hostile, "hi\nagain\n")
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert rc == 0 and len(errors) == 2 and "'choices' is a string" in errors[0], err
    assert "bug" not in err and out.startswith("par")
    for events in ([b"[" * DEEP + b"]" * DEEP], [CHUNK % b'[{"index": 0, "delta": "abc"}]']):
        hostile.events = events
        rc, out, err = chat(monkeypatch, capsys, hostile, "hi\n")
        assert rc == 0 and len([line for line in err.splitlines() if line.startswith("error:")]) == 1, err
        assert "bug" not in err
