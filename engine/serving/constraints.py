"""What a chat request asks its answer to match, as the engine's OutputConstraint: `response_format`
json_object / json_schema, and `tool_choice` "required" or a named function, written in the
model's own tool-call format (formats.py). The engine then decodes under it without changing the
target's distribution over what the grammar allows (engine.decoding.grammar).

Grammars (llguidance's Lark dialect; `%json {...}` embeds a JSON Schema):
- json_object: any JSON object; json_schema: the schema given (none: any JSON value).
- "hermes" calls (Qwen, Hermes): `<tool_call>\\n{"name": NAME, "arguments": ARGS}\\n</tool_call>`,
  several separated by a newline; "llama3": `{"name": NAME, "parameters": ARGS}`, several
  separated by "; ". ARGS is the tool's parameters schema (its local $refs re-rooted). A named
  function, or parallel_tool_calls false, allows exactly one call; "required" one or more.
- tools offered with tool_choice "auto" beside a response_format: either calls or the answer.
- a template whose generation prompt opens <think> (formats.ChatFormat.opens_thinking): the
  reasoning runs first, free, to its </think>. Other thinking templates answer at once (as with
  thinking turned off).
- gpt-oss's harmony: an optional analysis message, then one call message (`<|channel|>commentary
  to=functions.NAME <|constrain|>json<|message|>ARGS`) or the final message holding the JSON
  answer; the markers are the tokenizer's special tokens (`_harmony`).
- "mistral": `[TOOL_CALLS]` then a JSON list of {"name", "arguments"}, or, for templates that write
  `[ARGS]`, `[TOOL_CALLS]NAME[ARGS]{...}` per call; the markers are special tokens, named in the
  grammar as `<%NAME%>` (engine.decoding.grammar puts in their ids).
- "gemma4": `<|tool_call>call:NAME{...}<tool_call|>` per call, the arguments in Gemma's own value
  syntax written from the tool's schema (gemma_grammar.py, which refuses what it cannot enforce).
JSON is written as json.dumps writes it (engine.decoding.grammar.JSON_STYLE).

Everything is checked before the request queues: schemas are bounded as tools.py bounds tool
parameters, and what llguidance refuses (a keyword it does not implement, a $ref to nothing, an
unknown format) is a 400 naming the field and the reason, never a 500.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from engine.decoding.grammar import JSON_STYLE, check_constraint
from engine.errors import InvalidRequest
from engine.serving.formats import ARGS, GRAMMAR_FORMATS, TOOL_CALLS, ChatFormat
from engine.serving.gemma_grammar import GemmaSchemaError, gemma_call_rules
from engine.serving.tools import MAX_SCHEMA_BYTES, MAX_SCHEMA_DEPTH, ToolChoice, ToolError, check_depth
from engine.types import OutputConstraint, ToolSpec
from engine.untrusted import KIB

CALL_SEPARATOR = {"hermes": "\n", "llama3": "; ", "mistral": ", "}
ARGUMENTS = {"hermes": "arguments", "llama3": "parameters", "mistral": "arguments"}  # the key a format's calls carry arguments in


def build_constraint(body: Mapping[str, Any], fmt: ChatFormat | None, tools: tuple[ToolSpec, ...],
                     choice: ToolChoice, max_calls: int | None) -> OutputConstraint | None:
    """The constraint a request's `response_format` and `tool_choice` ask for (None: free text);
    ToolError (a 400) when they cannot be enforced. `fmt` is None for /v1/completions (no chat
    format: no tools, no reasoning)."""
    schema = _response_schema(body.get("response_format"))
    forced = choice.mode in ("required", "named")
    if schema is not None and forced:
        raise ToolError("'response_format' and a tool_choice that forces a call cannot both hold: the answer is "
                        "either a call or the formatted answer.", "response_format")
    if schema is None and not forced:
        return None
    if fmt is not None and "harmony" in (fmt.tools, fmt.reasoning):
        return _checked(_harmony(schema, tools, choice, forced), "tool_choice" if forced else "response_format")
    rules: list[str] = []
    alternatives: list[str] = []
    if forced or (schema is not None and tools and choice.mode == "auto"):
        assert fmt is not None  # tools come with chat requests only
        offered = [t for t in tools if choice.mode != "named" or t.name == choice.name]
        one = choice.mode == "named" or max_calls == 1
        rules += _call_rules(fmt, offered, one, "tool_choice" if forced else "tools")
        alternatives.append("calls")
    if schema is not None:
        rules.append("answer: %json " + _styled(schema))
        alternatives.append("answer")
    top = " | ".join(alternatives)
    if fmt is not None and fmt.opens_thinking:  # the answer starts inside <think>: it ends that first
        rules = [f"start: reasoning /[ \\t\\r\\n]*/ ({top})", "reasoning[lazy]: /(.|\\n)*<\\/think>/", *rules]
    else:
        rules = [f"start: {top}", *rules]
    return _checked("\n".join(rules), "tool_choice" if forced else "response_format")


def _checked(lark: str, what: str) -> OutputConstraint:
    constraint = OutputConstraint("lark", lark, what)
    try:
        check_constraint(constraint)
    except InvalidRequest as exc:
        raise ToolError(exc.user_message, constraint.what) from None
    return constraint


def _harmony(schema: dict[str, Any] | bool | None, tools: tuple[ToolSpec, ...], choice: ToolChoice,
             forced: bool) -> str:
    """gpt-oss's answer under a constraint: its analysis message first if it writes one (free
    text up to <|end|>), then one call message, `<|channel|>commentary to=functions.NAME
    <|constrain|>json<|message|>ARGS` (gpt-oss calls one function a turn; its <|call|> then ends
    the answer), or the final message holding the JSON answer, `<|channel|>final<|message|>JSON`.
    Text never matches a special token, so the analysis runs until the model writes <|end|>."""
    analysis = ('analysis: <|channel|> "analysis" <|message|> ANALYSIS <|end|> <|start|> "assistant"\n'
                "ANALYSIS: /(.|\\n)*/")
    if forced:
        offered = [t for t in tools if choice.mode != "named" or t.name == choice.name]
        calls = [f'<|channel|> "commentary to=functions.{t.name} " <|constrain|> "json" <|message|> '
                 f"%json {_styled(json.loads(t.parameters))}" for t in offered]
        body = "call: " + " | ".join(calls)
        return f"start: analysis? call\n{body}\n{analysis}"
    answer = f'<|channel|> "final" <|message|> %json {_styled(schema if schema is not None else {})}'
    if tools and choice.mode == "auto":  # a call or the answer
        calls = [f'<|channel|> "commentary to=functions.{t.name} " <|constrain|> "json" <|message|> '
                 f"%json {_styled(json.loads(t.parameters))}" for t in tools]
        return f"start: analysis? (call | answer)\ncall: {' | '.join(calls)}\nanswer: {answer}\n{analysis}"
    return f"start: analysis? answer\nanswer: {answer}\n{analysis}"


def _response_schema(raw: object) -> dict[str, Any] | bool | None:
    """`response_format` -> the JSON Schema the answer must match (None: text)."""
    if raw is None:
        return None
    if not isinstance(raw, dict) or not isinstance(raw.get("type", "text"), str):
        raise ToolError("'response_format' must be {\"type\": \"text\"}, {\"type\": \"json_object\"} or "
                        "{\"type\": \"json_schema\", \"json_schema\": {\"name\": ..., \"schema\": {...}}}.",
                        "response_format")
    kind = raw.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "object"}
    if kind != "json_schema":
        raise ToolError(f"'response_format' type {kind[:40]!r} is not supported (text, json_object, json_schema).",
                        "response_format")
    spec = raw.get("json_schema")
    if not isinstance(spec, dict):
        raise ToolError("'response_format.json_schema' must be an object with a 'name' and a 'schema'.",
                        "response_format")
    schema = spec.get("schema", {})
    if not isinstance(schema, (dict, bool)):
        raise ToolError("'response_format.json_schema.schema' must be a JSON Schema (an object).", "response_format")
    if schema is False:
        raise ToolError("'response_format.json_schema.schema' is false: no answer would match it.", "response_format")
    check_depth(schema, MAX_SCHEMA_DEPTH, "response_format.json_schema.schema", "response_format")
    size = len(json.dumps(schema, ensure_ascii=False).encode())
    if size > MAX_SCHEMA_BYTES:
        raise ToolError(f"'response_format.json_schema.schema' is {size // KIB:,} KiB of JSON; at most "
                        f"{MAX_SCHEMA_BYTES // KIB} KiB are accepted.", "response_format")
    return schema


def _call_rules(fmt: ChatFormat, tools: list[ToolSpec], one: bool, param: str) -> list[str]:
    """Lark rules `calls` (one, or one or more, calls in the model's format) and `call`."""
    if fmt.tools not in GRAMMAR_FORMATS:
        raise ToolError(f"'{param}' needs constrained decoding of this model's tool calls ({fmt.tools} format), which "
                        "is available for Hermes/Qwen <tool_call>, Llama 3 JSON, Mistral [TOOL_CALLS], Gemma 4 and "
                        "gpt-oss harmony calls only; use tool_choice \"auto\".", param)
    if fmt.tools == "gemma4":  # Gemma's own value syntax, not JSON (gemma_grammar.py)
        try:
            return gemma_call_rules([(t.name, json.loads(t.parameters)) for t in tools], one)
        except GemmaSchemaError as exc:
            raise ToolError(f"'{param}' cannot be enforced for Gemma 4's call syntax: the tool's parameters use "
                            f"{exc}, which it does not cover; use tool_choice \"auto\".", param) from None
    if fmt.tools == "mistral" and fmt.calls_by_name:  # [TOOL_CALLS]NAME[ARGS]{...}, one marker a call
        named = [f'<%{TOOL_CALLS}%> {json.dumps(t.name)} <%{ARGS}%> %json {_styled(json.loads(t.parameters))}'
                 for t in tools]
        return ["calls: call" if one else "calls: call+", "call: " + " | ".join(named)]
    key = ARGUMENTS[fmt.tools]
    bodies = []
    for tool in tools:
        parameters = json.loads(tool.parameters)
        schema = {"type": "object", "properties": {"name": {"const": tool.name}, key: _rerooted(parameters, key)},
                  "required": ["name", key], "additionalProperties": False}
        bodies.append("%json " + _styled(schema))
    one_call = " | ".join(bodies)
    if fmt.tools == "hermes":
        call = f'call: "<tool_call>\\n" ({one_call}) "\\n</tool_call>"'
    else:
        call = f"call: {one_call}"
    separator = json.dumps(CALL_SEPARATOR[fmt.tools])
    calls = "call" if one else f"call ({separator} call)*"
    if fmt.tools == "mistral":  # [TOOL_CALLS] then a JSON list of the calls
        return [f'calls: <%{TOOL_CALLS}%> "[" {calls} "]"', call]
    return [f"calls: {calls}", call]


def _styled(schema: dict[str, Any] | bool) -> str:
    """A schema as `%json` takes it, written in JSON_STYLE unless it says otherwise."""
    if isinstance(schema, bool):  # true: any value (false is refused before)
        schema = {}
    if "x-guidance" not in schema:
        schema = {**schema, "x-guidance": JSON_STYLE}
    return json.dumps(schema, ensure_ascii=False)


def _rerooted(schema: Any, key: str) -> Any:
    """A tool's parameters schema placed under properties/KEY of a call's schema: its local $refs
    ("#", "#/$defs/X", "#/properties/...") point there now. Iterative, like check_depth: the
    depth is bounded already, but nothing here recurses on a client's data."""
    prefix = f"#/properties/{key}"
    root: dict[str, Any] = {"v": schema}
    stack: list[tuple[Any, Any, Any]] = [(root, "v", schema)]  # (container, its key, value)
    while stack:
        container, at, value = stack.pop()
        if isinstance(value, dict):
            copy = dict(value)
            container[at] = copy
            for k, v in value.items():
                if k == "$ref" and isinstance(v, str) and (v == "#" or v.startswith("#/")):
                    copy[k] = prefix + v[1:]
                elif isinstance(v, (dict, list)):
                    stack.append((copy, k, v))
        elif isinstance(value, list):
            items = list(value)
            container[at] = items
            stack.extend((items, i, v) for i, v in enumerate(value) if isinstance(v, (dict, list)))
    return root["v"]
