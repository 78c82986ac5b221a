"""Constrained answers through the API, on a real model: the tiny pair with Qwen's tool template,
behind a real server, driven by the official `openai` client. `response_format` json_schema
answers validate against their schema; tool_choice "required" and a named function always
return calls whose arguments validate against the tool's parameters (streamed calls put back
together equal them); the Llama 3 format's calls likewise at the engine's level; requests whose
schemas the grammar library cannot enforce are 400s naming the reason. (Hostile fields are
also in test_tools.py's table, over HTTP.)

A random tiny model writes random values, so the schemas here bound every value (maxLength,
enums, ranges): the answers then always end within the token limit, complete."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import jsonschema
import openai
import pytest
from scripted import JSON, MODEL, raw, start_server
from templates import LLAMA3, QWEN, QWEN_THINKING

from engine.decoding.generation import Engine
from engine.decoding.grammar import GrammarCompiler
from engine.loading.load import LoadedModel, load_model
from engine.serving.formats import OutputSettings, chat_format
from engine.serving.protocol import RequestDefaults, parse_request
from engine.serving.server import Server
from engine.types import GenerationRequest, OutputConstraint, SamplingSettings, SpeculationSettings

PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 10},
    "age": {"type": "integer", "minimum": 0, "maximum": 99},
    "pets": {"type": "array", "items": {"enum": ["cat", "dog", "fish"]}, "maxItems": 2},
    "address": {"$ref": "#/$defs/address"}},
    "required": ["name", "age", "pets", "address"], "additionalProperties": False,
    "$defs": {"address": {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome", "Oslo"]},
                                                           "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                          "required": ["city", "zip"], "additionalProperties": False}}}
WEATHER_PARAMS = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                   "unit": {"$ref": "#/$defs/unit"}},
                  "required": ["city", "unit"], "additionalProperties": False,
                  "$defs": {"unit": {"enum": ["celsius", "fahrenheit"]}}}
TIME_PARAMS = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET", "JST"]},
                                                "hour24": {"type": "boolean"}},
               "required": ["zone", "hour24"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                           "parameters": WEATHER_PARAMS}},
         {"type": "function", "function": {"name": "get_time", "description": "The time in a zone.",
                                           "parameters": TIME_PARAMS}}]
SCHEMAS = {"get_weather": WEATHER_PARAMS, "get_time": TIME_PARAMS}
PROMPTS = ["Weather in Paris?", "What time is it in Tokyo?", "Describe a person.", "Tell me about Rome.",
           "Hello!", "Is it raining in Oslo, in fahrenheit?"]


@pytest.fixture(scope="module")
def qwen_pair(tiny_target_path: Path, tiny_draft_path: Path,
              tmp_path_factory: pytest.TempPathFactory) -> tuple[LoadedModel, LoadedModel]:
    folder = tmp_path_factory.mktemp("qwen-constrained") / "tiny-qwen-tools"
    shutil.copytree(tiny_target_path, folder)
    (folder / "chat_template.jinja").write_text(QWEN)
    return load_model(folder), load_model(tiny_draft_path)


@pytest.fixture(scope="module")
def engine(qwen_pair: tuple[LoadedModel, LoadedModel]) -> Engine:
    target, draft = qwen_pair
    return Engine(target.model, target.tokenizer, draft.model)


@pytest.fixture(scope="module")
def server(engine: Engine) -> Iterator[Server]:
    served = start_server(engine, chat_template=QWEN)  # type: ignore[arg-type]
    yield served
    served.stop()


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=120)


def test_json_schema_answers_validate(client: openai.OpenAI) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    for i, prompt in enumerate(PROMPTS):
        answer = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": prompt}], response_format=fmt,  # type: ignore[arg-type]
            max_tokens=200, temperature=0.0 if i % 2 == 0 else 1.0, seed=i)
        [choice] = answer.choices
        assert choice.finish_reason == "stop", choice
        jsonschema.validate(json.loads(choice.message.content or ""), PERSON)
        assert answer.usage is not None and answer.usage.model_extra is not None
        assert answer.usage.model_extra["specchat"]["mode"] == "specexec"


def test_json_object_answers_are_objects_and_the_engine_stays_exact(client: openai.OpenAI, engine: Engine) -> None:
    """Any JSON object: a random model may write one past the token limit, so only finished
    answers are parsed; greedy answers equal the engine's own without trees."""
    messages = [{"role": "user", "content": "Give me JSON."}]
    answer = client.chat.completions.create(model=MODEL, messages=messages,  # type: ignore[arg-type]
                                            response_format={"type": "json_object"}, max_tokens=60)
    text = answer.choices[0].message.content or ""
    assert text.startswith("{")
    if answer.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)
    [request] = parse_request("chat", {"messages": messages, "response_format": {"type": "json_object"},
                                       "max_tokens": 60}, RequestDefaults(), 2048, QWEN).choices
    plain = list(engine.generate(GenerationRequest(**{**request.__dict__, "speculation": SpeculationSettings(
        mode="autoregressive")})))[-1]
    assert plain.text == text  # type: ignore[union-attr]


def check_calls(calls: list, names: set[str] | None = None) -> None:  # type: ignore[type-arg]
    assert calls
    for call in calls:
        assert call.type == "function" and call.function.name in (names or SCHEMAS)
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_tool_choice_required_always_calls_with_valid_arguments(client: openai.OpenAI) -> None:
    """One call (parallel_tool_calls false): the answer is exactly that call. Parallel calls: a
    random model rarely chooses to stop calling, so its answer may run to the token limit, but
    every call it completed is there and valid."""
    seen = set()
    for i, prompt in enumerate(PROMPTS):
        parallel = i % 3 == 2
        answer = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": prompt}], tools=TOOLS,  # type: ignore[arg-type]
            tool_choice="required", max_tokens=200, temperature=0.0 if i % 2 == 0 else 1.0, seed=i,
            parallel_tool_calls=parallel)
        [choice] = answer.choices
        calls = choice.message.tool_calls or []
        check_calls(calls)
        seen.update(c.function.name for c in calls)  # type: ignore[union-attr]
        if parallel:
            assert choice.finish_reason in ("tool_calls", "length")
            continue
        assert choice.finish_reason == "tool_calls" and len(calls) == 1, choice
        assert not (choice.message.content or "").strip()  # the whole answer is the call
    assert seen == set(SCHEMAS), "the answers call both tools"


def test_a_named_function_is_called_once(client: openai.OpenAI) -> None:
    for prompt in PROMPTS[:3]:
        answer = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": prompt}], tools=TOOLS,  # type: ignore[arg-type]
            tool_choice={"type": "function", "function": {"name": "get_time"}}, max_tokens=200)
        [choice] = answer.choices
        assert choice.finish_reason == "tool_calls"
        calls = choice.message.tool_calls or []
        assert len(calls) == 1
        check_calls(calls, {"get_time"})


def test_streamed_forced_calls_put_back_together_equal_the_whole_answer(client: openai.OpenAI) -> None:
    kwargs = dict(model=MODEL, messages=[{"role": "user", "content": PROMPTS[0]}], tools=TOOLS,
                  tool_choice="required", parallel_tool_calls=False, max_tokens=200)
    whole = client.chat.completions.create(**kwargs)  # type: ignore[call-overload]
    with client.chat.completions.stream(**kwargs) as stream:  # type: ignore[arg-type]
        final = stream.get_final_completion()
    assert final.choices[0].finish_reason == whole.choices[0].finish_reason == "tool_calls"
    assert [(c.function.name, c.function.arguments) for c in final.choices[0].message.tool_calls or []] == [
        (c.function.name, c.function.arguments) for c in whole.choices[0].message.tool_calls or []]


def test_schemas_the_library_cannot_enforce_are_400_and_the_server_goes_on(server: Server,
                                                                           client: openai.OpenAI) -> None:
    deep = '{"type": "object", "properties": {"x": ' * 10_000 + '{"type": "string"}' + "}}" * 10_000
    body = ('{"model": "%s", "messages": [{"role": "user", "content": "hi"}], "response_format": {"type": '
            '"json_schema", "json_schema": {"name": "x", "schema": %s}}}') % (MODEL, deep)
    reply = raw(server.port, "POST", "/v1/chat/completions", body, JSON)
    assert reply.status == 400 and reply.error()["type"] == "invalid_request_error"
    for schema, word in (({"type": "object", "dependentSchemas": {"a": {}}}, "dependentSchemas"),
                         ({"$ref": "#/definitions/none"}, "definitions"),
                         ({"type": "string", "format": "postcode"}, "postcode")):
        with pytest.raises(openai.BadRequestError) as exc:
            client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                           response_format={"type": "json_schema",  # type: ignore[arg-type]
                                                            "json_schema": {"name": "x", "schema": schema}})
        error = exc.value.response.json()["error"]
        assert error["param"] == "response_format" and word in error["message"], error
    recursive = {"type": "object", "properties": {"n": {"type": "integer", "maximum": 9},
                                                  "next": {"anyOf": [{"type": "null"}, {"$ref": "#"}]}},
                 "required": ["n", "next"], "additionalProperties": False}
    answer = client.chat.completions.create(  # a recursive schema is fine: it is a grammar
        model=MODEL, messages=[{"role": "user", "content": "A list."}], max_tokens=120,
        response_format={"type": "json_schema",  # type: ignore[arg-type]
                         "json_schema": {"name": "list", "schema": recursive}})
    if answer.choices[0].finish_reason == "stop":
        jsonschema.validate(json.loads(answer.choices[0].message.content or ""), recursive)


# ---- the grammars of other formats, at the engine's level ----------------------------------------
def constraint_for(template: str, body: dict) -> OutputConstraint:
    [request] = parse_request("chat", {"messages": [{"role": "user", "content": "hi"}], **body}, RequestDefaults(),
                              2048, template).choices
    assert request.constraint is not None
    return request.constraint


def test_llama3_calls_are_forced_and_read_back(engine: Engine) -> None:
    """Llama 3's calls are the whole answer, {"name": ..., "parameters": {...}}: decoded under the
    grammar (a raw prompt, the tiny model has no Llama template) and read by the same parser."""
    output = OutputSettings(chat_format(LLAMA3), True)
    named = {"type": "function", "function": {"name": "get_weather"}}
    for i, body in enumerate(({"tools": TOOLS, "tool_choice": "required"},
                              {"tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False},
                              {"tools": TOOLS, "tool_choice": named})):
        constraint = constraint_for(LLAMA3, body)
        for seed in range(3):
            final = list(engine.generate(GenerationRequest(
                raw_prompt="Call a tool:", max_new_tokens=200, constraint=constraint,
                sampling=SamplingSettings(temperature=1.0, seed=seed))))[-1]
            if i == 0 and final.finish_reason == "length":  # type: ignore[union-attr]
                continue  # parallel calls: a random model may call on to the limit (then nothing is read)
            parsed = output.parse(final.text)  # type: ignore[union-attr]
            assert final.finish_reason == "eos", final  # type: ignore[union-attr]
            assert parsed.calls and not parsed.content
            for call in parsed.calls:
                jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
            if i > 0:
                assert len(parsed.calls) == 1
            if i == 2:
                assert parsed.calls[0].name == "get_weather"


def test_a_template_that_opens_thinking_reasons_first(engine: Engine) -> None:
    """Qwen 3 Thinking's answers start inside <think>: the grammar lets the reasoning run to its
    </think>, then forces the call (checked on written answers: a random model's reasoning would
    run to the token limit)."""
    constraint = constraint_for(QWEN_THINKING, {"tools": TOOLS, "tool_choice": "required"})
    grammar = GrammarCompiler(engine.tokenizer, engine.target.shape.vocab_size, engine.eos_ids).compile(constraint)
    call = '<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC", "hour24": true}}\n</tool_call>'
    for text, ok in ((f"The user wants the time.\n</think>\n\n{call}", True), (call, False),
                     (f"Hmm.</think>{call}", True), ("Hmm.</think>\n\nIt is noon.", False)):
        state = grammar.start()
        tokens = list(engine.tokenizer(text, add_special_tokens=False)["input_ids"])
        allowed = state.allows(tokens) and state.allows([*tokens, min(engine.eos_ids)])
        assert allowed == ok, text
