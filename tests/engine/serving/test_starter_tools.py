"""Issue 30's must-show demos, small enough for CI, on a real model: the starter pair behind the
API server, driven by the official `openai` client (scripts/tool_demo.py runs the 20-prompt
versions against `specchat serve` and prints the tables). What the tiny random models of
test_constrained.py cannot show: a real model's calls and answers under `tool_choice:
"required"` and `response_format` json_schema validate against schemas that leave the values
to the model (free strings, numbers), and the whole round trip, call -> tool result -> final
answer, ends in text, streamed and not, with the streamed call's deltas put back together
equal to the call.

The starter's own template has no tools: it is served with Qwen 2.5's tool template (the Hermes
`<tool_call>` format), on its own copy of the tokenizer."""

from __future__ import annotations

import copy
import json
from collections.abc import Iterator
from typing import Any

import jsonschema
import openai
import pytest
from templates import QWEN

from engine.decoding.generation import Engine
from engine.loading.load import LoadedModel
from engine.serving.protocol import RequestDefaults
from engine.serving.scheduler import GenerationQueue, ModelState
from engine.serving.server import Server, ServeSettings
from engine.types import GenerationRequest, SamplingSettings, SpeculationSettings

pytestmark = pytest.mark.slow

NAME = "SmolLM2-135M-Instruct-tools"
FORECAST = {"type": "object", "additionalProperties": False, "required": ["city", "unit", "days"], "properties": {
    "city": {"type": "string", "minLength": 1, "maxLength": 40},
    "unit": {"enum": ["celsius", "fahrenheit"]},
    "days": {"type": "integer", "minimum": 1, "maximum": 7}}}
TOOLS: Any = [{"type": "function", "function": {"name": "get_forecast", "parameters": FORECAST,
                                                "description": "The weather forecast for a city, for 1 to 7 days."}}]
CITY = {"type": "object", "additionalProperties": False, "required": ["name", "country", "population_millions"],
        "properties": {"name": {"type": "string", "minLength": 1, "maxLength": 40},
                       "country": {"type": "string", "minLength": 1, "maxLength": 40},
                       "population_millions": {"type": "number", "minimum": 0, "maximum": 1000}}}
PROMPTS = ["Will it rain in Tokyo this week? Use fahrenheit.", "Tell me a joke."]  # and the round trip's


@pytest.fixture(scope="module")
def client(starter_pair: tuple[LoadedModel, LoadedModel]) -> Iterator[openai.OpenAI]:
    target, draft = starter_pair
    tokenizer = copy.deepcopy(target.tokenizer)  # the session's pair keeps its own template
    tokenizer.chat_template = QWEN  # type: ignore[attr-defined]
    engine = Engine(target.model, tokenizer, draft.model)
    queue = GenerationQueue()
    queue.set_model(ModelState(NAME, "ready", context_length=engine.context_length, chat_template=QWEN), engine)
    defaults = RequestDefaults(GenerationRequest(max_new_tokens=128, sampling=SamplingSettings(temperature=0.0),
                                                 speculation=SpeculationSettings(budget=16, max_depth=6)))
    server = Server(ServeSettings(port=0), queue, lambda: defaults)
    server.start()
    yield openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=300)
    server.stop()


def test_required_calls_validate(client: openai.OpenAI) -> None:
    """Three prompts with the round trip's (the 20-prompt table: scripts/tool_demo.py)."""
    for prompt in PROMPTS:
        answer = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": prompt}],
                                                tools=TOOLS, tool_choice="required", parallel_tool_calls=False)
        choice = answer.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.tool_calls is not None
        [call] = choice.message.tool_calls
        assert call.type == "function" and call.function.name == "get_forecast"
        jsonschema.validate(json.loads(call.function.arguments), FORECAST)


def test_round_trip_streamed_and_not(client: openai.OpenAI) -> None:
    messages: list[Any] = [{"role": "user", "content": "What's the weather in Paris tomorrow?"}]
    ask: dict[str, Any] = {"model": NAME, "tools": TOOLS, "parallel_tool_calls": False}
    whole = client.chat.completions.create(messages=messages, tool_choice="required", **ask)
    assert whole.choices[0].message.tool_calls is not None
    [call] = whole.choices[0].message.tool_calls
    jsonschema.validate(json.loads(call.function.arguments), FORECAST)
    parts: dict[int, dict[str, str]] = {}
    ids = set()
    for chunk in client.chat.completions.create(messages=messages, tool_choice="required", stream=True, **ask):
        for delta in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
            part = parts.setdefault(delta.index, {"name": "", "arguments": ""})
            if delta.id:
                ids.add(delta.id)
            if delta.function is not None:
                part["name"] += delta.function.name or ""
                part["arguments"] += delta.function.arguments or ""
    assert list(parts.values()) == [{"name": call.function.name, "arguments": call.function.arguments}]
    assert len(ids) == 1
    result = json.dumps({"city": "Paris", "forecast": "sunny", "high_c": 24, "low_c": 15})
    messages += [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                 {"role": "tool", "tool_call_id": call.id, "content": result}]
    final = client.chat.completions.create(messages=messages, **ask)
    text = final.choices[0].message.content
    assert final.choices[0].message.tool_calls is None and text and text.strip()
    streamed = "".join(c.choices[0].delta.content or "" for c in
                       client.chat.completions.create(messages=messages, stream=True, **ask) if c.choices)
    assert streamed == text


def test_json_schema_answers_validate(client: openai.OpenAI) -> None:
    fmt: Any = {"type": "json_schema", "json_schema": {"name": "city", "schema": CITY, "strict": True}}
    for city in ("Lima",):  # the 20-prompt table: scripts/tool_demo.py
        answer = client.chat.completions.create(
            model=NAME, messages=[{"role": "user", "content": f"Describe the city of {city} as a JSON object."}],
            response_format=fmt)
        assert answer.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(answer.choices[0].message.content or ""), CITY)
