"""Reasoning a remote server already split off (vLLM with a reasoning parser streams it as
`reasoning_content`, newer versions as `reasoning`) reaches the caller the way a local thinking
model's does: in a <think> block before the answer, which the answer parser (the app's splitter
for remote answers is this parser with the "think" format) takes apart again. Against a real
HTTP server on 127.0.0.1 (vllm_standin.py) that streams the deltas."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
from vllm_standin import MODEL, VllmStandIn

from engine.errors import RemoteError
from engine.serving.formats import ChatFormat, OutputSettings
from engine.serving.remote import RemoteEngine
from engine.types import Completion, GenerationRequest, Message, RemoteModel, TokenEvent

REASONING = ["The user greets me. ", "I should greet back,", " briefly."]
ANSWER = ["Hello", " there", "!"]
THINK = OutputSettings(ChatFormat(reasoning="think"), False, None)  # how a remote answer is split


def chunk(delta: dict[str, Any], finish: str | None = None) -> bytes:
    return json.dumps({"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": MODEL,
                       "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]}).encode()


def vllm_stream(field: str, content_beside: bool = False) -> list[bytes]:
    """Deltas as vLLM's reasoning parser streams them: the role, reasoning pieces (the first answer
    piece in the same delta as the last reasoning one, with `content_beside`), answer pieces, the end."""
    events = [chunk({"role": "assistant", "content": ""})]
    events += [chunk({field: piece, "content": None}) for piece in REASONING[:-1]]
    last = {field: REASONING[-1]}
    events.append(chunk({**last, "content": ANSWER[0]} if content_beside else last))
    events += [chunk({"content": piece}) for piece in ANSWER[0 if not content_beside else 1:]]
    return [*events, chunk({}, "stop")]


@pytest.fixture
def vllm() -> Iterator[VllmStandIn]:
    server = VllmStandIn().start()
    yield server
    server.stop()


def run(server: VllmStandIn) -> tuple[list[str], Completion]:
    engine = RemoteEngine(RemoteModel(server.url, MODEL))
    events = list(engine.generate(GenerationRequest(messages=(Message("user", "hi"),), max_new_tokens=32)))
    done = events[-1]
    assert isinstance(done, Completion) and all(isinstance(e, TokenEvent) for e in events[:-1])
    return [e.text for e in events[:-1] if isinstance(e, TokenEvent)], done


@pytest.mark.parametrize("field", ["reasoning_content", "reasoning"])
@pytest.mark.parametrize("content_beside", [False, True])
def test_streamed_reasoning_is_kept_apart_from_the_answer(vllm: VllmStandIn, field: str,
                                                          content_beside: bool) -> None:
    vllm.events = vllm_stream(field, content_beside)
    pieces, done = run(vllm)
    assert "".join(pieces) == done.text and done.finish_reason == "eos"
    whole = THINK.parse(done.text)
    assert whole.reasoning == "".join(REASONING).strip() and whole.content == "".join(ANSWER) and not whole.calls
    parser = THINK.parser()  # as the app splits it while it streams
    deltas = [parser.feed(p) for p in pieces] + [parser.finish()]
    assert "".join(d.reasoning for d in deltas).strip() == "".join(REASONING).strip()
    assert "".join(d.content for d in deltas) == "".join(ANSWER)


def test_reasoning_of_an_answer_sent_whole(vllm: VllmStandIn) -> None:
    message = {"role": "assistant", "reasoning_content": "Think first.", "content": "Done."}
    vllm.answer = ("application/json", json.dumps({
        "id": "chatcmpl-2", "object": "chat.completion", "created": 1, "model": MODEL,
        "choices": [{"index": 0, "message": message, "logprobs": None, "finish_reason": "stop"}]}).encode())
    _, done = run(vllm)
    parsed = THINK.parse(done.text)
    assert (parsed.reasoning, parsed.content) == ("Think first.", "Done.")


def test_an_answer_without_reasoning_is_unchanged(vllm: VllmStandIn) -> None:
    pieces, done = run(vllm)
    assert done.text == "You said: hi " and "<think>" not in "".join(pieces)


def test_reasoning_cut_by_the_limit_stays_reasoning(vllm: VllmStandIn) -> None:
    vllm.events = [chunk({"reasoning_content": piece}) for piece in REASONING] + [chunk({}, "length")]
    _, done = run(vllm)
    parsed = THINK.parse(done.text)
    assert parsed.reasoning == "".join(REASONING).strip() and not parsed.content
    assert done.finish_reason == "length"


@pytest.mark.parametrize("bad", [5, ["x"], {"text": "x"}, True])
def test_reasoning_that_is_not_text_is_a_remote_error(vllm: VllmStandIn, bad: object) -> None:
    vllm.events = [chunk({"reasoning_content": bad}), chunk({}, "stop")]
    with pytest.raises(RemoteError, match="reasoning of a choice"):
        run(vllm)
