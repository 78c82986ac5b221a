"""The wire format without a model: request bodies -> GenerationRequests, and the server's
states (loading, failed, no route, port taken) over real HTTP on 127.0.0.1."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator

import httpx2
import openai
import pytest

from engine.serving.protocol import ApiError, RequestDefaults, parse_request
from engine.serving.scheduler import GenerationQueue, ModelState, QueueFull, QueueState
from engine.serving.server import PortInUse, Server, ServeSettings
from engine.types import GenerationRequest, Message, SamplingSettings

DEFAULTS = RequestDefaults(GenerationRequest(max_new_tokens=33, stop=("END",), sampling=SamplingSettings(0.5)),
                           system="Be kind.")


def test_chat_body_to_requests() -> None:
    body = {"model": "m", "messages": [{"role": "developer", "content": "Rules."},
                                       {"role": "user", "content": [{"type": "text", "text": "a"},
                                                                    {"type": "text", "text": "b"}]},
                                       {"role": "assistant", "content": None}],
            "max_completion_tokens": 5, "max_tokens": 9, "top_k": 4, "presence_penalty": 0.5, "user": "u1"}
    parsed = parse_request("chat", body, DEFAULTS)
    [request] = parsed.choices
    assert request.messages == (Message("system", "Rules."), Message("user", "ab"), Message("assistant", ""))
    assert request.max_new_tokens == 5 and request.stop == ("END",) and request.sampling.top_k == 4
    assert request.sampling.temperature == 0.5 and request.sampling.seed is not None  # sampled: a fresh seed
    assert not parsed.stream and parsed.model == "m"


def test_defaults_fill_what_a_request_leaves_out() -> None:
    parsed = parse_request("chat", {"messages": [{"role": "user", "content": "hi"}], "stop": None}, DEFAULTS)
    [request] = parsed.choices
    assert request.messages[0] == Message("system", "Be kind.") and request.max_new_tokens == 33
    assert request.stop == ("END",) and parsed.model is None
    greedy = parse_request("completion", {"prompt": ["x"], "n": 3, "temperature": 0, "stop": "y"}, DEFAULTS)
    assert len(greedy.choices) == 3 and len(set(greedy.choices)) == 1  # greedy choices: one request, decoded once
    assert greedy.choices[0].raw_prompt == "x" and greedy.choices[0].stop == ("y",)
    seeded = parse_request("completion", {"prompt": "x", "n": 2, "seed": 10}, DEFAULTS)
    assert [c.sampling.seed for c in seeded.choices] == [10, 11]


@pytest.mark.parametrize("body, param", [
    ([], None),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}, "messages"),
    ({"messages": [{"role": "user", "content": "x"}], "temperature": "hot"}, "temperature"),
    ({"messages": [{"role": "user", "content": "x"}], "max_tokens": True}, "max_tokens"),
    ({"messages": [{"role": "user", "content": "x"}], "stop": [1]}, "stop"),
    ({"messages": [{"role": "user", "content": "x"}], "n": 9}, "n"),
    ({"messages": [{"role": "user", "content": "x"}], "stream_options": {"include_usage": True}}, "stream_options"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}, "tools"),
    ({"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "if": {}}}}}, "response_format"),
])
def test_bad_bodies_are_400_naming_the_field(body: object, param: str | None) -> None:
    with pytest.raises(ApiError) as exc:
        parse_request("chat", body, DEFAULTS)
    assert exc.value.status == 400 and exc.value.param == param and exc.value.body()["error"]["message"]


def test_settings_refuse_values_through_their_own_checks() -> None:
    for field, value in (("max_tokens", 0), ("top_p", 0), ("seed", -1), ("temperature", float("nan"))):
        with pytest.raises(ApiError) as exc:
            parse_request("completion", {"prompt": "x", "temperature": 0.7, field: value}, DEFAULTS)
        assert exc.value.status == 400, field


@pytest.fixture
def idle_server() -> Iterator[Server]:
    """A real server whose model is still loading (no engine behind it)."""
    queue = GenerationQueue(capacity=1)
    queue.set_model(ModelState("big-model", "loading", "layer 3 of 80 -> RAM", context_length=8192))
    server = Server(ServeSettings(port=0), queue, RequestDefaults)
    server.start()
    yield server
    server.stop()


def test_while_loading_requests_get_503_and_health_says_why(idle_server: Server) -> None:
    client = openai.OpenAI(base_url=idle_server.url, api_key="unused", max_retries=0)
    assert [m.id for m in client.models.list().data] == ["big-model"]
    with pytest.raises(openai.InternalServerError) as exc:
        client.chat.completions.create(model="big-model", messages=[{"role": "user", "content": "hi"}])
    error = exc.value.response.json()["error"]
    assert exc.value.status_code == 503 and error["code"] == "model_not_ready" and "layer 3 of 80" in error["message"]
    assert exc.value.response.headers["retry-after"]
    health = httpx2.get(idle_server.url.removesuffix("/v1") + "/health")
    assert health.status_code == 503 and health.json()["status"] == "loading"
    idle_server.queue.set_model(ModelState("big-model", "failed", "The file is corrupt."))
    with pytest.raises(openai.InternalServerError) as exc:
        client.completions.create(model="big-model", prompt="x")
    assert "The file is corrupt." in exc.value.response.json()["error"]["message"]
    assert httpx2.post(f"{idle_server.url}/chat/completions", json={}).status_code == 400  # parsed before the state
    assert httpx2.get(f"{idle_server.url}/models/other").status_code == 404


def test_after_a_failed_load_no_model_is_listed(idle_server: Server) -> None:
    base = idle_server.url
    idle_server.queue.set_model(ModelState("big-model", "failed", "The file is corrupt."))
    listed = httpx2.get(f"{base}/models")
    assert listed.status_code == 200 and listed.json() == {"object": "list", "data": []}
    one = httpx2.get(f"{base}/models/big-model")
    assert one.status_code == 404 and one.json()["error"]["code"] == "model_not_found"
    assert "failed to load" in one.json()["error"]["message"] and "corrupt" in one.json()["error"]["message"]
    health = httpx2.get(base.removesuffix("/v1") + "/health")
    assert health.status_code == 503 and health.json()["status"] == "failed"
    chat = httpx2.post(f"{base}/chat/completions", json={"model": "big-model", "messages": [{"role": "user",
                                                                                             "content": "hi"}]})
    assert chat.status_code == 503 and "corrupt" in chat.json()["error"]["message"]
    idle_server.queue.set_model(ModelState("", "none", "No model is loaded."))
    assert httpx2.get(f"{base}/models").json()["data"] == []
    assert httpx2.get(f"{base}/models/big-model").status_code == 404


def test_a_taken_port_and_a_full_queue_are_refused(idle_server: Server) -> None:
    queue = GenerationQueue(capacity=0)
    with pytest.raises(PortInUse) as exc:
        Server(ServeSettings(port=idle_server.port), queue, RequestDefaults)
    assert str(idle_server.port) in exc.value.user_message
    loop = asyncio.new_event_loop()
    try:
        queue.set_model(ModelState("m", "ready"), backend=_Blocked())
        queue.submit((GenerationRequest(raw_prompt="x"),), loop)  # runs (and blocks): nothing waits
        with pytest.raises(QueueFull):
            queue.submit((GenerationRequest(raw_prompt="y"),), loop)
    finally:
        queue.close(wait=5)
        loop.close()


def test_the_last_state_reported_is_the_queues_state() -> None:
    # the submitting thread is slow to hand its state on (a busy GUI event queue, a descheduled
    # thread) while the consumer starts the job: the owner must still end up told "running"
    reported: list[QueueState] = []
    submitter = threading.get_ident()

    def on_change(state: QueueState) -> None:
        if threading.get_ident() == submitter:
            time.sleep(0.3)  # the consumer has long taken the job by now
        reported.append(state)

    queue = GenerationQueue(on_change=on_change)
    loop = asyncio.new_event_loop()
    try:
        queue.set_model(ModelState("m", "ready"), backend=_Blocked())
        job = queue.submit((GenerationRequest(raw_prompt="x"),), loop)
        deadline = time.monotonic() + 5
        while queue.state() != QueueState(True, 0) and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.1)
        assert queue.state() == QueueState(True, 0) and reported[-1] == QueueState(True, 0), reported
        job.cancel.set()
    finally:
        queue.close(wait=5)
        loop.close()


class _Blocked:
    """A backend that holds its request until cancelled (what a slow engine looks like to the queue)."""

    def generate(self, request: GenerationRequest, cancel: object = None) -> Iterator[object]:
        assert cancel is not None
        cancel.wait(10)  # type: ignore[attr-defined]
        return iter(())
