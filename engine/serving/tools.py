"""The tool side of a chat request, checked before anything runs: `tools`, `tool_choice`,
`parallel_tool_calls`, `reasoning_effort`, and the `tool_calls` an assistant message carries.

Everything is bounded and refused with a 400 naming the field, never a 500: at most MAX_TOOLS
tools, names as OpenAI allows them (^[a-zA-Z0-9_-]{1,64}$, no two alike), a schema at most
MAX_SCHEMA_BYTES as JSON and MAX_SCHEMA_DEPTH deep (measured without recursion, so a schema
built 10,000 deep in memory is refused like one sent that deep), ids of at most MAX_ID
characters, a call's arguments a JSON object read with engine.untrusted.parse_json. A schema's
`$ref`s are not followed here (nothing here resolves them, so a recursive schema costs nothing);
its `strict` flag is accepted: with tool_choice "auto" the model's calls are read as written, and
with "required" or a named function (constraints.py) every call follows its schema anyway.

What this does not do: read the model's answers (formats.py) or the messages' other fields
(protocol.py).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

from engine.errors import MalformedInput
from engine.serving.formats import NAME, ChatFormat
from engine.types import ToolCall, ToolSpec
from engine.untrusted import KIB, parse_json

MAX_TOOLS = 128  # OpenAI's limit
MAX_SCHEMA_BYTES = 64 * KIB  # one tool's parameters as JSON; real ones are a few KiB
MAX_TOOLS_BYTES = 512 * KIB  # all of them: every byte is prompt, read again on every turn
MAX_SCHEMA_DEPTH = 32  # real schemas nest < 10 deep
MAX_DESCRIPTION = 32 * KIB
MAX_ID = 256
MAX_CALLS = 128  # calls in one assistant message
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")


@dataclass(frozen=True)
class ToolChoice:
    """`tool_choice`: "auto" (the model decides), "none" (no tools shown), "required" (one call or
    more) or "named" (one call of the function `name`)."""

    mode: Literal["auto", "none", "required", "named"]
    name: str = ""


class ToolError(Exception):
    """A 400 about the tool fields (protocol.py answers it in OpenAI's shape)."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


def parse_tools(raw: object, fmt: ChatFormat, template_known: bool) -> tuple[ToolSpec, ...]:
    """`tools` -> ToolSpecs (none for null or []); ToolError when they are malformed or the
    model's chat template cannot show them."""
    if raw is None or raw == []:
        return ()
    if not isinstance(raw, list) or len(raw) > MAX_TOOLS:
        raise ToolError(f"'tools' must be a list of at most {MAX_TOOLS} function tools.", "tools")
    specs: list[ToolSpec] = []
    total = 0
    for i, item in enumerate(raw):
        where = f"tools[{i}]"
        if not isinstance(item, dict) or item.get("type", "function") != "function":
            raise ToolError(f"{where} must be {{\"type\": \"function\", \"function\": {{...}}}} (only function tools "
                            "are supported).", "tools")
        function = item.get("function")
        if not isinstance(function, dict):
            raise ToolError(f"{where}.function must be an object with a 'name'.", "tools")
        name = check_name(function.get("name"), f"{where}.function.name", "tools")
        if any(s.name == name for s in specs):
            raise ToolError(f"{where}: two tools are named '{name}'.", "tools")
        description = function.get("description")
        if description is not None and (not isinstance(description, str) or len(description) > MAX_DESCRIPTION):
            raise ToolError(f"{where}.function.description must be a string of at most {MAX_DESCRIPTION:,} "
                            "characters.", "tools")
        strict = function.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise ToolError(f"{where}.function.strict must be true or false.", "tools")
        parameters = function.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(parameters, dict):
            raise ToolError(f"{where}.function.parameters must be a JSON Schema object.", "tools")
        check_depth(parameters, MAX_SCHEMA_DEPTH, f"{where}.function.parameters", "tools")
        text = json.dumps(parameters, ensure_ascii=False)
        if len(text.encode()) > MAX_SCHEMA_BYTES:
            raise ToolError(f"{where}.function.parameters is {len(text.encode()) // KIB:,} KiB of JSON; at most "
                            f"{MAX_SCHEMA_BYTES // KIB} KiB are accepted per tool.", "tools")
        total += len(text.encode()) + len(description or "")
        if total > MAX_TOOLS_BYTES:
            raise ToolError(f"The tools take more than {MAX_TOOLS_BYTES // KIB} KiB: every byte of them is prompt on "
                            "every turn. Give fewer or smaller tools.", "tools")
        specs.append(ToolSpec(name, description or "", text))
    check_template(fmt, template_known, "tools")
    return tuple(specs)


def check_template(fmt: ChatFormat, template_known: bool, param: str) -> None:
    """ToolError unless the model's chat template shows tools and its calls are in a format read here."""
    if not template_known:
        raise ToolError("Tool calls are not available for this model here: the server does not know its chat "
                        "template.", param)
    if not fmt.takes_tools:
        raise ToolError("This model's chat template has no tool support (it never mentions tools), so it cannot be "
                        "given tools or tool calls: use a model made for tool calling.", param)
    if fmt.tools is None:
        raise ToolError("This model's chat template takes tools, but writes calls in a format this server does not "
                        "read yet (it reads Hermes/Qwen <tool_call>, Llama 3 JSON, Mistral [TOOL_CALLS] and gpt-oss "
                        "harmony).", param)


def parse_tool_choice(raw: object, tools: tuple[ToolSpec, ...]) -> ToolChoice:
    """`tool_choice` (the default: "auto" with tools, "none" without); a named function must be
    one of the tools."""
    if raw is None:
        return ToolChoice("auto" if tools else "none")
    if raw == "none":
        return ToolChoice("none")
    if not tools:
        raise ToolError("'tool_choice' is only allowed when 'tools' are given.", "tool_choice")
    if raw == "auto":
        return ToolChoice("auto")
    if raw == "required":
        return ToolChoice("required")
    if isinstance(raw, dict) and raw.get("type") == "function":
        function = raw.get("function")
        name = check_name(function.get("name") if isinstance(function, dict) else None, "tool_choice.function.name",
                          "tool_choice")
        if not any(t.name == name for t in tools):
            raise ToolError(f"tool_choice names the function '{name}', which is not among the tools.", "tool_choice")
        return ToolChoice("named", name)
    if isinstance(raw, dict) and raw.get("type") in ("allowed_tools", "custom"):
        raise ToolError(f"tool_choice of type '{raw['type']}' is not supported: use \"auto\", \"required\" or a "
                        "named function.", "tool_choice")
    raise ToolError("'tool_choice' must be \"auto\", \"none\", \"required\" or {\"type\": \"function\", \"function\": "
                    "{\"name\": ...}}.", "tool_choice")


def parse_parallel(raw: object) -> int | None:
    """`parallel_tool_calls` -> the most calls kept (None: no limit)."""
    if raw is None or raw is True:
        return None
    if raw is False:
        return 1
    raise ToolError("'parallel_tool_calls' must be true or false.", "parallel_tool_calls")


def parse_reasoning_effort(raw: object) -> str | None:
    if raw is None:
        return None
    if raw not in REASONING_EFFORTS:
        raise ToolError(f"'reasoning_effort' must be one of {', '.join(REASONING_EFFORTS)}.", "reasoning_effort")
    assert isinstance(raw, str)
    return raw


def parse_tool_calls(raw: object, where: str) -> tuple[ToolCall, ...]:
    """An assistant message's `tool_calls` -> ToolCalls (arguments kept as the JSON text sent,
    or written as JSON when a client sent an object)."""
    if raw is None or raw == []:
        return ()
    if not isinstance(raw, list) or len(raw) > MAX_CALLS:
        raise ToolError(f"{where}.tool_calls must be a list of at most {MAX_CALLS} calls.", "messages")
    calls = []
    for j, item in enumerate(raw):
        at = f"{where}.tool_calls[{j}]"
        if not isinstance(item, dict) or item.get("type", "function") != "function":
            raise ToolError(f"{at} must be {{\"id\", \"type\": \"function\", \"function\": {{\"name\", "
                            "\"arguments\"}}}}.", "messages")
        call_id = check_id(item.get("id"), f"{at}.id")
        function = item.get("function")
        if not isinstance(function, dict):
            raise ToolError(f"{at}.function must be an object with 'name' and 'arguments'.", "messages")
        name = check_name(function.get("name"), f"{at}.function.name", "messages")
        calls.append(ToolCall(call_id, name, _arguments(function.get("arguments"), f"{at}.function.arguments")))
    return tuple(calls)


def _arguments(raw: object, where: str) -> str:
    if isinstance(raw, dict):  # OpenAI sends text; some clients an object
        check_depth(raw, MAX_SCHEMA_DEPTH, where, "messages")
        return json.dumps(raw, ensure_ascii=False)
    if not isinstance(raw, str):
        raise ToolError(f"{where} must be a JSON object as a string.", "messages")
    try:
        value = parse_json(raw, what=where, max_bytes=MAX_TOOLS_BYTES, max_depth=MAX_SCHEMA_DEPTH)
    except MalformedInput as exc:
        raise ToolError(exc.user_message, "messages") from None
    if not isinstance(value, dict):
        raise ToolError(f"{where} must hold a JSON object.", "messages")
    return raw


def check_name(raw: object, where: str, param: str) -> str:
    if not isinstance(raw, str) or not NAME.fullmatch(raw):
        shown = repr(raw)[:60] if isinstance(raw, str) else type(raw).__name__
        raise ToolError(f"{where} must be 1 to 64 letters, digits, underscores or dashes (got {shown}).", param)
    return raw


def check_id(raw: object, where: str) -> str:
    if not isinstance(raw, str) or not raw or len(raw) > MAX_ID:
        raise ToolError(f"{where} must be a non-empty string of at most {MAX_ID} characters.", "messages")
    return raw


def check_depth(value: Any, limit: int, where: str, param: str) -> None:
    """ToolError when `value` nests lists or objects more than `limit` deep: a loop over a
    stack, so no depth (and no cycle a caller built in memory) reaches Python's recursion limit."""
    stack: list[tuple[Any, int]] = [(value, 1)]
    seen = 0
    while stack:
        item, depth = stack.pop()
        seen += 1
        if depth > limit or seen > 1_000_000:
            raise ToolError(f"{where} nests objects or lists more than {limit} levels deep (or holds too much).",
                            param)
        if isinstance(item, dict):
            stack.extend((v, depth + 1) for v in item.values() if isinstance(v, (dict, list)))
        elif isinstance(item, list):
            stack.extend((v, depth + 1) for v in item if isinstance(v, (dict, list)))
