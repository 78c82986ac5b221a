"""`logprobs` / `top_logprobs` over real HTTP with the official `openai` client: the tiny model's
greedy answers come with the log-softmax of plain transformers forward logits at each position
(the target's distribution), with a draft's trees, draft-free trees and plain decoding; streamed
chunks carry the same entries as the whole answer; the legacy completions shape; hostile values
are 400s in OpenAI's shape."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import openai
import pytest
import torch
from scripted import JSON, MODEL, ScriptedBackend, raw, start_server

from engine.decoding.generation import Engine
from engine.decoding.logprobs import TokenBytes
from engine.loading.load import LoadedModel
from engine.serving.protocol import RequestDefaults
from engine.serving.scheduler import GenerationQueue, ModelState
from engine.serving.server import Server, ServeSettings
from engine.types import GenerationRequest, Message, SpeculationSettings

PROMPTS = ["one two three one two three one two", "Write a poem about the sea."]
MODES = {"draft": SpeculationSettings(budget=16, max_depth=6),
         "draft-free": SpeculationSettings(budget=16, max_depth=6, draft=False),
         "plain": SpeculationSettings(mode="autoregressive")}


def serve(engine: Engine, spec: SpeculationSettings) -> Server:
    queue = GenerationQueue(capacity=4)
    queue.set_model(ModelState(MODEL, "ready", context_length=2048), engine)
    defaults = RequestDefaults(GenerationRequest(max_new_tokens=16, speculation=spec))
    server = Server(ServeSettings(port=0), queue, lambda: defaults)
    server.start()
    return server


@pytest.fixture(scope="module", params=list(MODES))
def served(request: pytest.FixtureRequest, close_engine: Engine) -> Iterator[tuple[str, Server]]:
    server = serve(close_engine, MODES[request.param])
    yield request.param, server
    server.stop()


def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url, api_key="none", max_retries=0)


def reference(model: LoadedModel, prompt: list[int], n: int) -> tuple[list[int], torch.Tensor]:
    """Plain transformers: the greedy answer (up to n tokens, through an end of turn) and the
    (n, V) log-softmax of the forward logits at each of its positions."""
    hf = model.model.hf_model
    with torch.no_grad():
        x = torch.tensor([prompt])
        out = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, do_sample=False,
                          pad_token_id=model.tokenizer.pad_token_id)[0].tolist()
        logits = hf(torch.tensor([out])).logits[0].float()  # (T, V)
    answer = out[len(prompt):]
    return answer, torch.log_softmax(logits[len(prompt) - 1 : len(out) - 1], dim=-1)


def entries(choice_logprobs: Any) -> list[dict[str, Any]]:
    return [c.model_dump() for c in choice_logprobs.content]


def test_chat_logprobs_are_the_target_forward(served: tuple[str, Server], close_engine: Engine,
                                              tiny_target: LoadedModel) -> None:
    mode, server = served
    spell = TokenBytes(tiny_target.tokenizer)
    for text in PROMPTS:
        messages: Any = [{"role": "user", "content": text}]
        answer = client(server).chat.completions.create(model=MODEL, messages=messages,
                                                        temperature=0, logprobs=True, top_logprobs=4)
        got = entries(answer.choices[0].logprobs)
        assert answer.usage is not None and answer.usage.model_extra is not None
        assert answer.usage.model_extra["specchat"]["mode"] == {"draft": "specexec", "draft-free": "context",
                                                                "plain": "autoregressive"}[mode]
        prompt = close_engine.encode(GenerationRequest(messages=(Message("user", text),)))
        ids, ref = reference(tiny_target, prompt, 16)
        assert len(got) == answer.usage.completion_tokens == len(ids[: len(got)]) > 0, mode
        for at, (entry, token) in enumerate(zip(got, ids, strict=False)):
            assert bytes(entry["bytes"]) == spell(token) and entry["token"] == spell(token).decode(errors="replace")
            assert entry["logprob"] == pytest.approx(float(ref[at, token]), abs=1e-4), (mode, text, at)
            top = entry["top_logprobs"]
            values = [t["logprob"] for t in top]
            assert len(top) == 4 and values == sorted(values, reverse=True)
            assert top[0]["bytes"] == entry["bytes"] and top[0]["logprob"] == entry["logprob"], "greedy: the best"
            assert values == pytest.approx(torch.topk(ref[at], 4).values.tolist(), abs=1e-4)


def test_streamed_chunks_carry_the_same_entries(served: tuple[str, Server]) -> None:
    mode, server = served
    messages: Any = [{"role": "user", "content": PROMPTS[1]}]
    whole = client(server).chat.completions.create(model=MODEL, messages=messages,
                                                   temperature=0, logprobs=True, top_logprobs=2)
    streamed: list[dict[str, Any]] = []
    text = ""
    for chunk in client(server).chat.completions.create(model=MODEL, messages=messages,
                                                        temperature=0, logprobs=True, top_logprobs=2, stream=True):
        if chunk.choices and chunk.choices[0].logprobs is not None:
            streamed += entries(chunk.choices[0].logprobs)
        if chunk.choices and chunk.choices[0].delta.content:
            text += chunk.choices[0].delta.content
    assert text == whole.choices[0].message.content
    want = entries(whole.choices[0].logprobs)
    assert [(e["token"], e["bytes"]) for e in streamed] == [(e["token"], e["bytes"]) for e in want], mode
    # the second request reuses the first's cached prompt: the same values, up to float rounding
    assert [e["logprob"] for e in streamed] == pytest.approx([e["logprob"] for e in want], abs=1e-5)


def test_off_by_default_and_top_zero(served: tuple[str, Server]) -> None:
    _, server = served
    messages: Any = [{"role": "user", "content": "hi"}]
    plain = client(server).chat.completions.create(model=MODEL, messages=messages, max_tokens=4)
    assert plain.choices[0].logprobs is None
    bare = client(server).chat.completions.create(model=MODEL, messages=messages, max_tokens=4,
                                                  logprobs=True)
    assert all(e["top_logprobs"] == [] for e in entries(bare.choices[0].logprobs))


def test_legacy_completions_shape_streamed_and_not(close_engine: Engine) -> None:
    server = serve(close_engine, MODES["draft"])
    try:
        check_legacy(server)
    finally:
        server.stop()


def check_legacy(server: Server) -> None:
    whole = raw(server.port, "POST", "/v1/completions", {"prompt": PROMPTS[0], "max_tokens": 12, "temperature": 0,
                                                         "logprobs": 3}, JSON).json()["choices"][0]["logprobs"]
    n = len(whole["tokens"])
    assert n == len(whole["token_logprobs"]) == len(whole["top_logprobs"]) == len(whole["text_offset"]) > 0
    for token, value, top in zip(whole["tokens"], whole["token_logprobs"], whole["top_logprobs"], strict=True):
        # the legacy shape keys alternatives by text: pieces of characters that all read "\ufffd" share one key
        assert 1 <= len(top) <= 3 and max(top.values()) == value and top[token] == value  # greedy: the best
    assert whole["text_offset"] == sorted(whole["text_offset"]) and whole["text_offset"][0] == 0
    reply = raw(server.port, "POST", "/v1/completions", {"prompt": PROMPTS[0], "max_tokens": 12, "temperature": 0,
                                                         "logprobs": 3, "stream": True}, JSON)
    parts: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "text_offset": []}
    for line in reply.body.decode().splitlines():
        if line.startswith("data: {"):
            got = json.loads(line[6:])["choices"][0]["logprobs"]
            for key in parts if got else ():
                parts[key] += got[key]
    assert parts["tokens"] == whole["tokens"] and parts["text_offset"] == whole["text_offset"]
    assert parts["token_logprobs"] == pytest.approx(whole["token_logprobs"], abs=1e-5)


HOSTILE = [("chat", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
           ("chat", {"logprobs": True, "top_logprobs": -1}, "top_logprobs"),
           ("chat", {"logprobs": True, "top_logprobs": 2.0}, "top_logprobs"),
           ("chat", {"logprobs": True, "top_logprobs": "3"}, "top_logprobs"),
           ("chat", {"top_logprobs": 3}, "top_logprobs"),
           ("chat", {"logprobs": 1}, "logprobs"),
           ("chat", {"logprobs": "true"}, "logprobs"),
           ("chat", {"logprobs": [True]}, "logprobs"),
           ("completion", {"logprobs": True}, "logprobs"),
           ("completion", {"logprobs": 21}, "logprobs"),
           ("completion", {"logprobs": -1}, "logprobs"),
           ("completion", {"logprobs": 10**12}, "logprobs")]


@pytest.fixture(scope="module")
def scripted() -> Iterator[tuple[Server, ScriptedBackend]]:
    backend = ScriptedBackend()
    server = start_server(backend)
    yield server, backend
    server.stop()


@pytest.mark.parametrize("kind, fields, param", HOSTILE, ids=[f"{k}-{f}" for k, f, _ in HOSTILE])
def test_hostile_values_are_400_in_openais_shape(scripted: tuple[Server, ScriptedBackend], kind: str,
                                                 fields: dict[str, Any], param: str) -> None:
    server, backend = scripted
    before = backend.calls
    body = {"model": MODEL, "max_tokens": 4, **fields}
    body.update({"messages": [{"role": "user", "content": "hi"}]} if kind == "chat" else {"prompt": "hi"})
    reply = raw(server.port, "POST", "/v1/chat/completions" if kind == "chat" else "/v1/completions", body, JSON)
    assert reply.status == 400, reply.body[:300]
    error = reply.error()
    assert error["param"] == param and error["type"] == "invalid_request_error" and len(error["message"]) < 300
    assert backend.calls == before, "refused before it reached the engine"
