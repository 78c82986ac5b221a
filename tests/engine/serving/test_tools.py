"""Tools in the API without a model: request bodies with tools, tool choices and tool messages ->
GenerationRequests; hostile tool fields answered 400 in OpenAI's shape over real HTTP (schemas
huge or nested 10,000 deep, odd names, ids that match nothing, a template without tools); and a
scripted model's tool calls and reasoning through a real server to the official `openai` client,
whole and streamed, the stream put back together by the client's own helper."""

from __future__ import annotations

import json
from collections.abc import Iterator

import openai
import pytest
from scripted import JSON, MODEL, ScriptedBackend, raw, start_server
from templates import CHATML, QWEN

from engine.serving.formats import chat_format
from engine.serving.protocol import ApiError, RequestDefaults, parse_request
from engine.serving.server import Server
from engine.serving.tools import ToolError, check_depth
from engine.types import Message, ToolCall, ToolSpec

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
USER = {"role": "user", "content": "Weather in Paris?"}
CALLED = {"role": "assistant", "content": None, "reasoning_content": "Use the tool.", "tool_calls": [
    {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]}
ANSWERED = {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"}


def parse(body: dict, template: str = QWEN):  # type: ignore[no-untyped-def]
    return parse_request("chat", {"messages": [USER], **body}, RequestDefaults(), 2048, template)


def test_tools_and_a_tool_history_become_the_request() -> None:
    parsed = parse({"messages": [USER, CALLED, ANSWERED], "tools": [WEATHER], "reasoning_effort": "low"})
    [request] = parsed.choices
    [tool] = request.tools
    assert tool == ToolSpec("get_weather", "The weather in a city.", json.dumps(WEATHER["function"]["parameters"]))
    assert request.messages[1] == Message("assistant", "", (ToolCall("call_1", "get_weather", '{"city": "Paris"}'),),
                                          reasoning="Use the tool.")
    assert request.messages[2] == Message("tool", "18 C, sunny", tool_call_id="call_1", name="get_weather")
    assert request.reasoning_effort == "low"
    assert parsed.output is not None and parsed.output.tools and parsed.output.format == chat_format(QWEN)
    hash(request)  # greedy choices are deduplicated by the request: it stays hashable


def test_tool_choice_none_shows_no_tools_and_reads_no_calls() -> None:
    parsed = parse({"tools": [WEATHER], "tool_choice": "none", "parallel_tool_calls": False})
    assert parsed.choices[0].tools == () and parsed.output is not None and not parsed.output.tools
    assert parse({}, CHATML).output is None  # no tools, no reasoning format: text is content, as before
    assert parse({"tools": []}, CHATML).choices[0].tools == ()


DEEP = 10_000


def nested_schema(depth: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"x": schema}}
    return schema


def tool(name: str = "f", **function: object) -> dict:
    return {"type": "function", "function": {"name": name, **function}}


BAD_TOOLS: list[tuple[str, dict, str, str]] = [  # (case, body, param, a word of the message)
    ("not a list", {"tools": {"a": 1}}, "tools", "list"),
    ("too many", {"tools": [tool(f"f{i}") for i in range(129)]}, "tools", "128"),
    ("not a function", {"tools": [{"type": "code_interpreter"}]}, "tools", "function"),
    ("no function", {"tools": [{"type": "function"}]}, "tools", "name"),
    ("space in name", {"tools": [tool("get weather")]}, "tools", "letters"),
    ("unicode name", {"tools": [tool("wetter_\u00fc")]}, "tools", "letters"),
    ("markup name", {"tools": [tool("</tool_call><|im_end|>")]}, "tools", "letters"),
    ("long name", {"tools": [tool("f" * 65)]}, "tools", "64"),
    ("empty name", {"tools": [tool("")]}, "tools", "letters"),
    ("number name", {"tools": [tool(5)]}, "tools", "letters"),  # type: ignore[arg-type]
    ("twice", {"tools": [tool("f"), tool("f")]}, "tools", "two tools"),
    ("parameters a list", {"tools": [tool(parameters=[1])]}, "tools", "Schema"),
    ("description a number", {"tools": [tool(description=5)]}, "tools", "description"),
    ("strict a string", {"tools": [tool(strict="yes")]}, "tools", "strict"),
    ("schema 40 deep", {"tools": [tool(parameters=nested_schema(20))]}, "tools", "deep"),
    ("huge schema", {"tools": [tool(parameters={"type": "object", "description": "x" * 70_000})]}, "tools", "KiB"),
    ("huge tools", {"tools": [tool(f"f{i}", parameters={"description": "x" * 60_000}) for i in range(10)]}, "tools",
     "KiB"),
    ("named unknown", {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_time"}}},
     "tool_choice", "not among"),
    ("named oddly", {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "a b"}}},
     "tool_choice", "letters"),
    ("named nothing", {"tools": [WEATHER], "tool_choice": {"type": "function"}}, "tool_choice", "letters"),
    ("allowed_tools", {"tools": [WEATHER], "tool_choice": {"type": "allowed_tools", "tools": []}}, "tool_choice",
     "not supported"),
    ("required and a format", {"tools": [WEATHER], "tool_choice": "required",
                               "response_format": {"type": "json_object"}}, "response_format", "either"),
    ("required, a keyword unsupported", {"tools": [tool(parameters={"type": "object", "properties": {
        "x": {"type": "array", "uniqueItems": True}}})], "tool_choice": "required"}, "tool_choice", "uniqueItems"),
    ("choice without tools", {"tool_choice": "auto"}, "tool_choice", "only allowed"),
    ("odd choice", {"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice", "auto"),
    ("parallel a string", {"tools": [WEATHER], "parallel_tool_calls": "yes"}, "parallel_tool_calls", "true"),
    ("effort", {"reasoning_effort": "extreme"}, "reasoning_effort", "low"),
    ("format a string", {"response_format": "json"}, "response_format", "json_object"),
    ("format unknown", {"response_format": {"type": "xml"}}, "response_format", "not supported"),
    ("format without schema", {"response_format": {"type": "json_schema"}}, "response_format", "schema"),
    ("schema a list", {"response_format": {"type": "json_schema", "json_schema": {"schema": [1]}}},
     "response_format", "schema"),
    ("schema false", {"response_format": {"type": "json_schema", "json_schema": {"schema": False}}},
     "response_format", "no answer"),
    ("schema 40 deep as format", {"response_format": {"type": "json_schema", "json_schema": {
        "schema": nested_schema(20)}}}, "response_format", "deep"),
    ("huge schema as format", {"response_format": {"type": "json_schema", "json_schema": {
        "schema": {"type": "object", "description": "x" * 70_000}}}}, "response_format", "KiB"),
    ("keyword unsupported", {"response_format": {"type": "json_schema", "json_schema": {
        "schema": {"type": "object", "if": {"required": ["a"]}, "then": {"required": ["b"]}}}}},
     "response_format", "if"),
    ("ref to nothing", {"response_format": {"type": "json_schema", "json_schema": {"schema": {"$ref": "#/$defs/x"}}}},
     "response_format", "$defs"),
    ("external ref", {"response_format": {"type": "json_schema", "json_schema": {
        "schema": {"$ref": "http://127.0.0.1:1/schema.json"}}}}, "response_format", "schema"),
    ("format unknown to the library", {"response_format": {"type": "json_schema", "json_schema": {
        "schema": {"type": "string", "format": "colour"}}}}, "response_format", "colour"),
    ("functions", {"functions": [{"name": "f"}]}, "functions", "tools"),
    ("unknown call id", {"messages": [USER, ANSWERED]}, "messages", "matches no call"),
    ("call id of a later call", {"messages": [USER, ANSWERED, CALLED]}, "messages", "matches no call"),
    ("tool message without id", {"messages": [USER, CALLED, {"role": "tool", "content": "x"}]}, "messages", "id"),
    ("call id a number", {"messages": [USER, {**CALLED, "tool_calls": [{**CALLED["tool_calls"][0], "id": 7}]}]},
     "messages", "id"),
    ("arguments not JSON", {"messages": [USER, {**CALLED, "tool_calls": [
        {"id": "c", "function": {"name": "f", "arguments": "{city: Paris"}}]}]}, "messages", "JSON"),
    ("arguments a list", {"messages": [USER, {**CALLED, "tool_calls": [
        {"id": "c", "function": {"name": "f", "arguments": "[1]"}}]}]}, "messages", "object"),
    ("arguments 10,000 deep", {"messages": [USER, {**CALLED, "tool_calls": [
        {"id": "c", "function": {"name": "f", "arguments": "[" * DEEP + "]" * DEEP}}]}]}, "messages", "deep"),
    ("call name odd", {"messages": [USER, {**CALLED, "tool_calls": [
        {"id": "c", "function": {"name": "f()", "arguments": "{}"}}]}]}, "messages", "letters"),
    ("tool_calls on a user", {"messages": [{**USER, "tool_calls": CALLED["tool_calls"]}]}, "messages", "assistant"),
    ("reasoning a number", {"messages": [USER, {"role": "assistant", "content": "x", "reasoning_content": 5}]},
     "messages", "reasoning"),
]


@pytest.mark.parametrize("case, body, param, word", BAD_TOOLS, ids=[c[0] for c in BAD_TOOLS])
def test_bad_tool_fields_are_400_naming_the_field(case: str, body: dict, param: str, word: str) -> None:
    with pytest.raises(ApiError) as exc:
        parse(body)
    assert exc.value.status == 400 and exc.value.param == param
    assert word.lower() in exc.value.message.lower() and len(exc.value.message) < 1000, exc.value.message


def test_a_template_without_tools_says_so() -> None:
    for body in ({"tools": [WEATHER]}, {"messages": [USER, CALLED, ANSWERED]}):
        with pytest.raises(ApiError) as exc:
            parse(body, CHATML)
        assert exc.value.status == 400 and "no tool support" in exc.value.message
    with pytest.raises(ApiError) as exc:
        parse({"tools": [WEATHER]}, "")
    assert "chat template" in exc.value.message
    with pytest.raises(ApiError) as exc:
        parse({"tools": [WEATHER]}, "{{ tools | tojson }}")
    assert "format" in exc.value.message and "harmony" in exc.value.message
    with pytest.raises(ApiError) as exc:
        parse_request("completion", {"prompt": "x", "tools": [WEATHER]}, RequestDefaults())
    assert exc.value.param == "tools" and "chat" in exc.value.message


def test_depth_is_measured_without_recursion() -> None:
    """A schema built 10,000 deep in memory (no JSON parser bounded it), or one that holds itself."""
    with pytest.raises(ToolError):
        check_depth(nested_schema(DEEP), 32, "x", "tools")
    loop: dict = {"type": "object"}
    loop["properties"] = {"self": loop}
    with pytest.raises(ToolError):
        check_depth(loop, 32, "x", "tools")
    with pytest.raises(ApiError):
        parse({"tools": [tool(parameters=nested_schema(DEEP))]})


# ---- over HTTP ---------------------------------------------------------------------------------
CALL_TEXT = ('<think>\nThe user wants the weather.\n</think>\n\nLet me look.\n<tool_call>\n{"name": "get_weather", '
             '"arguments": {"city": "Paris"}}\n</tool_call>\n<tool_call>\n{"name": "get_weather", "arguments": '
             '{"city": "Rome"}}\n</tool_call>')


def pieces_of(text: str, size: int = 3) -> tuple[str, ...]:
    return tuple(text[i:i + size] for i in range(0, len(text), size))


@pytest.fixture(scope="module")
def backend() -> ScriptedBackend:
    return ScriptedBackend(pieces=pieces_of(CALL_TEXT), finish="eos")


@pytest.fixture(scope="module")
def server(backend: ScriptedBackend) -> Iterator[Server]:
    served = start_server(backend, chat_template=QWEN)
    yield served
    served.stop()


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=30)


def test_tool_calls_and_reasoning_come_back_in_their_fields(client: openai.OpenAI, backend: ScriptedBackend) -> None:
    whole = client.chat.completions.create(model=MODEL, messages=[USER], tools=[WEATHER])  # type: ignore[list-item]
    [choice] = whole.choices
    assert choice.finish_reason == "tool_calls"
    message = choice.message
    assert message.content == "Let me look." and message.model_extra["reasoning_content"] == "The user wants the weather."
    calls = message.tool_calls or []
    assert [(c.type, c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        ("function", "get_weather", {"city": "Paris"}), ("function", "get_weather", {"city": "Rome"})]
    assert all(c.id.startswith("call_") for c in calls) and len({c.id for c in calls}) == 2
    assert backend.requests[-1].tools[0].name == "get_weather"

    # The round trip: the calls and their results go back as history, and are accepted.
    history = [USER, message.model_dump(exclude_none=True)]
    history += [{"role": "tool", "tool_call_id": c.id, "content": "sunny"} for c in calls]
    again = client.chat.completions.create(model=MODEL, messages=history, tools=[WEATHER])  # type: ignore[arg-type]
    assert again.choices[0].finish_reason == "tool_calls"
    sent = backend.requests[-1].messages
    assert [m.role for m in sent] == ["user", "assistant", "tool", "tool"]
    assert sent[1].tool_calls == tuple(ToolCall(c.id, c.function.name, c.function.arguments) for c in calls)
    assert sent[1].reasoning == "The user wants the weather." and sent[3].tool_call_id == calls[1].id


def test_streamed_calls_put_back_together_equal_the_whole_answer(client: openai.OpenAI) -> None:
    whole = client.chat.completions.create(model=MODEL, messages=[USER], tools=[WEATHER])  # type: ignore[list-item]
    with client.chat.completions.stream(model=MODEL, messages=[USER], tools=[WEATHER]) as stream:  # type: ignore[list-item]
        chunks = [event.chunk for event in stream if event.type == "chunk"]
        final = stream.get_final_completion()
    streamed, expected = final.choices[0], whole.choices[0]
    assert streamed.finish_reason == expected.finish_reason == "tool_calls"
    assert streamed.message.content == expected.message.content
    assert [(c.function.name, c.function.arguments) for c in streamed.message.tool_calls or []] == [
        (c.function.name, c.function.arguments) for c in expected.message.tool_calls or []]
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    reasoning = "".join(d.model_extra.get("reasoning_content") or "" for d in deltas if d.model_extra)
    assert reasoning == expected.message.model_extra["reasoning_content"]
    firsts = [t for d in deltas for t in d.tool_calls or [] if t.id]
    assert [(t.index, t.type, t.function.name) for t in firsts] == [(0, "function", "get_weather"),
                                                                    (1, "function", "get_weather")]
    # content arrived before the first call, in more than one piece (it streams, it is not held)
    texts = [d.content for d in deltas if d.content]
    assert len(texts) > 1 and deltas.index(next(d for d in deltas if d.tool_calls)) > deltas.index(
        next(d for d in deltas if d.content))


@pytest.mark.parametrize("case, body, param, word", BAD_TOOLS, ids=[c[0] for c in BAD_TOOLS])
def test_hostile_tool_fields_over_http_are_400_in_openais_shape(server: Server, backend: ScriptedBackend,
                                                                 capfd: pytest.CaptureFixture[str], case: str,
                                                                 body: dict, param: str, word: str) -> None:
    before = backend.calls
    reply = raw(server.port, "POST", "/v1/chat/completions", {"model": MODEL, "messages": [USER], **body}, JSON)
    assert reply.status == 400, (case, reply.body[:300])
    error = reply.error()
    assert error["type"] == "invalid_request_error" and error["param"] in (param, None)
    assert backend.calls == before
    assert "Traceback" not in capfd.readouterr().err


def test_a_schema_sent_10000_deep_is_400(server: Server, backend: ScriptedBackend) -> None:
    before = backend.calls
    schema = '{"type": "object", "properties": {"x": ' * DEEP + '{"type": "string"}' + "}}" * DEEP
    body = ('{"model": "%s", "messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function", '
            '"function": {"name": "f", "parameters": %s}}]}') % (MODEL, schema)
    reply = raw(server.port, "POST", "/v1/chat/completions", body, JSON)
    assert reply.status == 400 and "deep" in reply.error()["message"] and backend.calls == before
