"""Streams that end before the model ends them must not look complete: Ctrl+C on `specchat
serve` mid-stream, a server stopped mid-stream, an engine failing mid-answer. Such a stream ends
with an OpenAI-shaped error event and no [DONE], never with finish_reason "stop" (OpenAI's
client raises on it); an answer not streamed gets an error status. Also: the time a request
waited before its client gave up is measured."""

from __future__ import annotations

import asyncio
import http.client
import json
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from scripted import CHAT, MODEL, ScriptedBackend, raw, start_server, stats
from serve_process import ServeProcess

from engine.cli.serve import job_line
from engine.errors import EngineError
from engine.serving.scheduler import GenerationQueue, Job, ModelState
from engine.types import Completion, GenerationRequest, TokenEvent


class RawStream:
    """A streamed chat completion read line by line over http.client."""

    def __init__(self, port: int, body: dict, headers: dict[str, str] | None = None) -> None:
        self.conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        self.conn.request("POST", "/v1/chat/completions", json.dumps({**body, "stream": True}),
                          {"Content-Type": "application/json", **(headers or {})})
        self.resp = self.conn.getresponse()
        assert self.resp.status == 200, self.resp.read()

    def events(self, count: int) -> list[bytes]:
        """The next `count` data lines."""
        got = []
        while len(got) < count:
            line = self.resp.readline()
            assert line, "the stream ended early"
            if line.startswith(b"data: "):
                got.append(line.strip())
        return got

    def rest(self) -> list[bytes]:
        """Every data line until the stream ends."""
        try:
            body = self.resp.read()
        except http.client.IncompleteRead as exc:
            body = exc.partial
        finally:
            self.conn.close()
        return [line for line in body.split(b"\n") if line.startswith(b"data: ")]


def assert_cut(lines: list[bytes]) -> dict:
    """The stream's end says it was cut: an error event last, no [DONE], no finish "stop"."""
    assert lines and b"[DONE]" not in b"".join(lines), lines[-3:]
    chunks = [json.loads(line[6:]) for line in lines]
    assert not any(c.get("choices") and c["choices"][0].get("finish_reason") for c in chunks), chunks[-3:]
    error = chunks[-1]["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "server_error"
    return error


@pytest.fixture
def held() -> Iterator[tuple[object, ScriptedBackend]]:
    backend = ScriptedBackend(hold=0.05)
    server = start_server(backend)
    yield server, backend
    server.stop()


def test_a_server_stopped_mid_stream_sends_an_error_and_no_done(held) -> None:  # type: ignore[no-untyped-def]
    server, _ = held
    stream = RawStream(server.port, CHAT)
    stream.events(3)  # the role chunk and two words
    threading.Thread(target=server.stop, daemon=True).start()
    error = assert_cut(stream.rest())
    assert error["code"] == "answer_interrupted" and "shutting down" in error["message"]


def test_openais_client_raises_on_a_cut_stream(held) -> None:  # type: ignore[no-untyped-def]
    server, _ = held
    client = openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=60)
    stream = client.chat.completions.create(model=MODEL, messages=CHAT["messages"], stream=True)
    pieces = []
    with pytest.raises(openai.APIError) as exc:
        for chunk in stream:
            pieces.append(chunk.choices[0].delta.content or "")
            if len(pieces) == 3:
                threading.Thread(target=server.stop, daemon=True).start()
    assert "cut off" in str(exc.value) and "".join(pieces).startswith("word")


def test_an_answer_not_streamed_that_is_cut_gets_an_error_status(held) -> None:  # type: ignore[no-untyped-def]
    server, backend = held
    replies: list[object] = []
    thread = threading.Thread(target=lambda: replies.append(raw(server.port, "POST", "/v1/chat/completions", CHAT,
                                                                [("Content-Type", "application/json")])))
    thread.start()
    deadline = time.monotonic() + 10
    while not backend.calls:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    time.sleep(0.2)
    server.stop()
    thread.join(10)
    [reply] = replies
    assert reply.status == 503 and reply.error()["code"] == "answer_interrupted"  # type: ignore[attr-defined]


class SlowStep(ScriptedBackend):
    """One word, then a decoding step of seconds that does not look at cancel meanwhile (an
    offloaded 70B model streaming its layers from disk)."""

    def _events(self, cancel: threading.Event) -> Iterator[TokenEvent | Completion]:
        yield TokenEvent((1,), "slow ")
        time.sleep(5)
        yield Completion("slow ", (1,), "cancelled" if cancel.is_set() else "length", stats(1))


def test_a_stream_stopped_during_a_long_step_is_told_at_once() -> None:
    server = start_server(SlowStep())
    stream = RawStream(server.port, CHAT)
    stream.events(2)
    started = time.monotonic()
    threading.Thread(target=server.stop, daemon=True).start()
    error = assert_cut(stream.rest())
    assert time.monotonic() - started < 2.0  # not after the step, nor cut by the shutdown's timeout
    assert error["code"] == "answer_interrupted"


class FailsMidway(ScriptedBackend):
    def _events(self, cancel: threading.Event) -> Iterator[TokenEvent | Completion]:
        yield TokenEvent((1,), "half ")
        raise EngineError("The GPU fell off the bus.")


def test_an_engine_failing_mid_answer_ends_the_stream_with_its_error() -> None:
    server = start_server(FailsMidway())
    try:
        lines = RawStream(server.port, CHAT).rest()
        error = assert_cut(lines)
        assert "GPU fell off" in error["message"]
        assert b"half " in b"".join(lines)
        ok = start_server(ScriptedBackend())  # (and a whole answer still ends with stop-or-length and [DONE])
        try:
            whole = RawStream(ok.port, CHAT).rest()
            assert whole[-1] == b"data: [DONE]" and b'"finish_reason":"length"' in b"".join(whole)
        finally:
            ok.stop()
    finally:
        server.stop()


def test_ctrl_c_on_specchat_serve_mid_stream_does_not_say_stop(tiny_target_path: Path) -> None:
    server = ServeProcess(["--target", tiny_target_path, "--device", "cpu", "--max-new-tokens", 1900,
                           "--mode", "autoregressive"])
    try:
        server.wait_for(lambda line: line.startswith("ready:"))
        port = int(server.url.rsplit(":", 1)[1].split("/")[0])
        stream = RawStream(port, {"messages": [{"role": "user", "content": "go on"}], "max_tokens": 1900})
        stream.events(3)
        server.proc.send_signal(signal.SIGINT)
        error = assert_cut(stream.rest())
        assert error["code"] == "answer_interrupted" and "shutting down" in error["message"]
        assert server.proc.wait(30) == 0
    finally:
        server.stop()


def test_the_wait_of_a_request_whose_client_left_is_measured() -> None:
    done: list[str] = []
    queue = GenerationQueue(on_done=lambda job, error: done.append(job_line(job, error)))
    loop = asyncio.new_event_loop()
    try:
        queue.set_model(ModelState("m", "ready"), ScriptedBackend(hold=0.02))
        running = queue.submit((GenerationRequest(raw_prompt="x"),), loop)
        waiting = queue.submit((GenerationRequest(raw_prompt="y"),), loop)
        time.sleep(0.6)
        waiting.stop()  # its client leaves (the server's disconnect watcher does this)
        time.sleep(0.3)
        running.stop()
        deadline = time.monotonic() + 10
        while len(done) < 2:
            assert time.monotonic() < deadline
            time.sleep(0.02)
    finally:
        queue.close(wait=5)
        loop.close()
    waited = next(line for line in done if "while waiting" in line)
    seconds = float(waited.split("(")[1].split(" s)")[0])
    assert 0.5 <= seconds < 0.85, waited


def test_job_line_says_how_long_a_job_waited() -> None:
    job = Job(7, (), asyncio.new_event_loop(), asyncio.Queue())
    job.submitted -= 2.5
    job.stop()
    assert job_line(job, None) == "request 7: cancelled while waiting (2.5 s)"
    job.loop.close()
