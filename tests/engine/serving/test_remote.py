"""RemoteEngine, the client of other OpenAI-compatible servers, against a stand-in that answers
like vLLM and against `specchat serve`; and `specchat chat --remote` in the terminal."""

from __future__ import annotations

import io
import json
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import openai
import pytest
from serve_process import API_KEY, REPO, ServeProcess
from vllm_standin import MODEL, VllmStandIn

from engine.cli.main import main
from engine.errors import (
    RemoteDisconnected,
    RemoteModelGone,
    RemoteUnauthorized,
    RemoteUnreachable,
)
from engine.serving.remote import RemoteEngine, list_models, normalise_url
from engine.types import (
    Completion,
    GenerationRequest,
    Message,
    RemoteModel,
    SamplingSettings,
    TokenEvent,
)

KEY = "token-abc123"


@pytest.fixture
def vllm() -> Iterator[VllmStandIn]:
    server = VllmStandIn(models=(MODEL, "Qwen/Qwen2.5-7B-Instruct"), api_key=KEY).start()
    yield server
    server.stop()


def ask(text: str, **fields: object) -> GenerationRequest:
    return GenerationRequest(messages=(Message("system", "Be brief."), Message("user", text)), **fields)  # type: ignore[arg-type]


def run(engine: RemoteEngine, request: GenerationRequest,
        cancel: threading.Event | None = None) -> tuple[list[str], Completion]:
    pieces, completion = [], None
    for event in engine.generate(request, cancel):
        if isinstance(event, TokenEvent):
            pieces.append(event.text)
        else:
            completion = event
    assert isinstance(completion, Completion)
    return pieces, completion


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_urls_as_users_type_them() -> None:
    assert normalise_url("gpu-box:8000") == "http://gpu-box:8000/v1"
    assert normalise_url("http://gpu-box:8000/") == "http://gpu-box:8000/v1"
    assert normalise_url("https://api.example.com/v1/ ") == "https://api.example.com/v1"
    assert normalise_url("http://host/openai/v1") == "http://host/openai/v1"


def test_streams_a_vllm_answer_with_the_request_it_expects(vllm: VllmStandIn) -> None:
    assert list_models(vllm.url, KEY) == tuple(sorted((MODEL, "Qwen/Qwen2.5-7B-Instruct")))
    engine = RemoteEngine(RemoteModel(vllm.url, MODEL, KEY))
    request = ask("hello there friend", max_new_tokens=50, stop=("###",),
                  sampling=SamplingSettings(temperature=0.7, top_p=0.9, top_k=40, seed=5))
    pieces, done = run(engine, request)
    assert pieces == ["You ", "said: ", "hello ", "there ", "friend "] and done.text == "".join(pieces)
    assert done.finish_reason == "stop" and done.stats.new_tokens == 5 and done.stats.prompt_tokens == 7
    sent = vllm.requests[-1]
    assert sent["model"] == MODEL and sent["stream"] is True and sent["stream_options"] == {"include_usage": True}
    assert sent["messages"] == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hello there friend"}]
    assert (sent["max_tokens"], sent["temperature"], sent["top_p"], sent["top_k"], sent["seed"], sent["stop"]) == (
        50, 0.7, 0.9, 40, 5, ["###"])
    assert "min_p" not in sent and "repetition_penalty" not in sent  # defaults stay out: OpenAI itself refuses them
    _, cut = run(engine, ask("one two three four", max_new_tokens=3))
    assert cut.text == "You said: one " and cut.finish_reason == "length"
    _, raw = run(engine, GenerationRequest(raw_prompt="def fib(n):", max_new_tokens=8))
    assert raw.text == "You said: def fib(n): " and vllm.requests[-1]["prompt"] == "def fib(n):"


def test_each_failure_is_its_own_error(vllm: VllmStandIn) -> None:
    with pytest.raises(RemoteUnauthorized) as exc:
        list_models(vllm.url, "wrong")
    assert "Unauthorized" in exc.value.user_message and "API key" in exc.value.user_message
    with pytest.raises(RemoteUnauthorized):
        RemoteEngine(RemoteModel(vllm.url, MODEL)).generate(ask("hi"))
    with pytest.raises(RemoteModelGone) as gone:
        RemoteEngine(RemoteModel(vllm.url, "meta-llama/Llama-2-7b", KEY)).generate(ask("hi"))
    assert "Llama-2-7b" in gone.value.user_message and "does not exist" in gone.value.user_message
    nowhere = f"http://127.0.0.1:{free_port()}/v1"
    with pytest.raises(RemoteUnreachable) as exc:
        RemoteEngine(RemoteModel(nowhere, MODEL)).generate(ask("hi"))
    assert nowhere in exc.value.user_message
    with pytest.raises(RemoteUnreachable):
        list_models(nowhere)


def test_the_server_going_away_mid_answer_keeps_what_came(vllm: VllmStandIn) -> None:
    vllm.die_after = 3
    engine = RemoteEngine(RemoteModel(vllm.url, MODEL, KEY))
    pieces: list[str] = []
    with pytest.raises(RemoteDisconnected) as exc:
        for event in engine.generate(ask("a b c d e f g h")):
            assert isinstance(event, TokenEvent)
            pieces.append(event.text)
    assert pieces == ["You ", "said: ", "a "] and "kept" in exc.value.user_message
    with pytest.raises(RemoteUnreachable):  # it is gone, and says so
        engine.generate(ask("again"))


def test_cancel_ends_the_answer_at_once_and_closes_the_connection(vllm: VllmStandIn) -> None:
    vllm.pause = 0.3
    engine = RemoteEngine(RemoteModel(vllm.url, MODEL, KEY))
    cancel = threading.Event()
    events = engine.generate(ask(" ".join(["word"] * 40)), cancel)
    first = next(events)
    assert isinstance(first, TokenEvent)
    cancel.set()
    rest = list(events)
    assert [type(e) for e in rest] == [Completion] and rest[0].finish_reason == "cancelled"  # type: ignore[union-attr]
    deadline = time.monotonic() + 10
    while not vllm.disconnects:  # the server sees the client leave at its next write
        assert time.monotonic() < deadline
        time.sleep(0.05)
    # cancelled before the server said anything at all
    vllm.pause, cancel = 5.0, threading.Event()
    cancel.set()
    [only] = list(engine.generate(ask("hi"), cancel))
    assert isinstance(only, Completion) and only.finish_reason == "cancelled" and only.text == ""


def test_specchat_serve_as_a_remote_engine(tiny_server: ServeProcess) -> None:
    """SpecChat to SpecChat: the same text as the official client, and the served engine's figures."""
    [model] = list_models(tiny_server.url, API_KEY)
    engine = RemoteEngine(RemoteModel(tiny_server.url, model, API_KEY))
    pieces, done = run(engine, ask("hello", max_new_tokens=12))
    client = openai.OpenAI(base_url=tiny_server.url, api_key=API_KEY, max_retries=0)
    reference = client.chat.completions.create(model=model, max_tokens=12, temperature=0, messages=[
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "hello"}])
    assert done.text == "".join(pieces) == reference.choices[0].message.content
    assert done.finish_reason == "length" and done.stats.new_tokens == 12
    assert done.stats.budget == 8 and done.stats.target_passes > 0 and done.stats.tokens_per_pass > 1
    with pytest.raises(RemoteModelGone):
        RemoteEngine(RemoteModel(tiny_server.url, "other", API_KEY)).generate(ask("hi"))


def chat_remote(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], lines: str,
                *args: str) -> tuple[int, str, str]:
    monkeypatch.setattr("sys.stdin", io.StringIO(lines))
    rc = main(["chat", *args])
    out, err = capsys.readouterr()
    return rc, out, err


def test_chat_remote_in_the_terminal(vllm: VllmStandIn, monkeypatch: pytest.MonkeyPatch,
                                     capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, err = chat_remote(monkeypatch, capsys, "first\n/reset\nsecond\n/exit\n", "--remote", vllm.url,
                               "--model", MODEL, "--api-key", KEY, "--system", "Be brief.")
    assert rc == 0, err
    assert out.splitlines() == ["You said: first ", "You said: second "]
    assert "conversation cleared" in err and "tokens" in err
    assert [m["content"] for m in vllm.requests[-1]["messages"]] == ["Be brief.", "second"]  # /reset dropped "first"
    rc, out, err = chat_remote(monkeypatch, capsys, "one\ntwo\n", "--remote", vllm.url, "--model", MODEL,
                               "--api-key", KEY)
    assert [m["content"] for m in vllm.requests[-1]["messages"]] == ["one", "You said: one ", "two"]  # history

    rc, out, err = chat_remote(monkeypatch, capsys, "hi\n", "--remote", vllm.url, "--model", "gone", "--api-key", KEY)
    assert rc == 1 and err.startswith("error: ") and MODEL in err and "gone" in err  # a runtime failure
    rc, out, err = chat_remote(monkeypatch, capsys, "hi\n", "--remote", vllm.url, "--api-key", KEY)
    assert rc == 2 and "--model" in err and MODEL in err  # a usage error: two models there: it must be told which


def test_chat_remote_survives_the_server_going_away(vllm: VllmStandIn, monkeypatch: pytest.MonkeyPatch,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    vllm.die_after = 2
    rc, out, err = chat_remote(monkeypatch, capsys, "a b c d e f\nstill there?\n", "--remote", vllm.url,
                               "--model", MODEL, "--api-key", KEY)
    assert rc == 0, err
    assert out.startswith("You said: ")
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 2 and "kept" in errors[0] and "Cannot reach" in errors[1]


def test_chat_remote_imports_no_torch(vllm: VllmStandIn) -> None:
    code = ("import io, json, sys\n"
            "sys.stdin = io.StringIO('hi\\n')\n"
            "from engine.cli import main\n"
            f"rc = main(['chat', '--remote', {vllm.url!r}, '--model', {MODEL!r}, '--api-key', {KEY!r}])\n"
            "print(json.dumps([rc, sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers'))]))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, check=True)
    assert json.loads(out.stdout.splitlines()[-1]) == [0, []]
    assert out.stdout.startswith("You said: hi")
