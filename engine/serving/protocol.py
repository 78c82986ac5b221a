"""OpenAI's wire format for chat completions and completions, the way in: request bodies ->
the engine's GenerationRequests, and error bodies (responses.py writes the answers: response
objects, stream chunks, usage).

Plain data only: no HTTP, no threads, no torch. Field names and shapes follow OpenAI's API
reference (what the official clients parse); what SpecChat adds goes where the clients keep
unknown fields (`usage.specchat`).

Parameters: temperature, top_p, max_tokens / max_completion_tokens, stop, seed, n, stream,
stream_options.include_usage, and vLLM's extras top_k, min_p, repetition_penalty. Each is
checked for its JSON type (a bool is not a number, a float is not a whole number) and its range;
`max_tokens` above the model's context (MAX_TOKENS_CEILING when the context is not known) is
refused with a 400 that says the limit, never capped silently. `logprobs` / `top_logprobs`
are checked and shaped by logprobs.py. Fields the engine cannot honour (the old `functions`,
logit_bias, best_of, echo, suffix) are refused with a 400 naming them; presence_penalty and
frequency_penalty are accepted and ignored (clients send them by default), as is everything
else OpenAI defines. `response_format`
json_object / json_schema (chats and completions) becomes a grammar the answer is decoded under
(constraints.py).

Chats also take tools (tools.py checks them): `tools`, `tool_choice` auto / none / required / a
named function (the last two decode under a grammar too), `parallel_tool_calls`,
`reasoning_effort`, assistant messages with `tool_calls` (and `reasoning_content`), and `tool`
messages whose `tool_call_id` names an earlier call. The answers of a model whose chat format
has tool calls or reasoning are split by formats.py:
`message.tool_calls` with finish_reason "tool_calls", `reasoning_content` beside `content`, and
in a stream the same as deltas (a call as two: its id and name, then its arguments).
"""

from __future__ import annotations

import math
import secrets
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from engine.errors import InvalidRequest
from engine.serving.constraints import build_constraint
from engine.serving.formats import OutputSettings, chat_format
from engine.serving.logprobs import LogprobsError, parse_logprobs
from engine.serving.tools import (
    ToolChoice,
    ToolError,
    check_id,
    check_template,
    parse_parallel,
    parse_reasoning_effort,
    parse_tool_calls,
    parse_tool_choice,
    parse_tools,
)
from engine.types import GenerationRequest, Message, OutputConstraint, ToolCall, ToolSpec

Kind = Literal["chat", "completion"]
MAX_STOP_STRINGS = 16
IGNORED_PENALTIES = ("presence_penalty", "frequency_penalty")
MAX_TOKENS_CEILING = 1 << 20  # when the model's context is not known: no local model reads more
_SHOWN = 60  # most characters of a refused value quoted back
# an API role -> the engine's (OpenAI's "developer" is a system message)
ROLES: dict[str, Literal["system", "user", "assistant", "tool"]] = {
    "system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}
REFUSED = {  # field -> why; refused only when set to something other than "off"
    "functions": "the old function-call fields are not supported (use 'tools')",
    "function_call": "the old function-call fields are not supported (use 'tool_choice')",
    "logit_bias": "logit_bias is not supported",
    "best_of": "best_of is not supported (use n)",
    "echo": "echo is not supported",
    "suffix": "suffix (fill-in-the-middle) is not supported",
}


class ApiError(Exception):
    """An error answered in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", code: str | None = None,
                 param: str | None = None, headers: Mapping[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.code = code
        self.param = param
        self.headers = dict(headers or {})

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.code, self.param)


def error_body(message: str, type_: str, code: str | None = None, param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def bad_request(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, "invalid_request_error", None, param)


@dataclass(frozen=True)
class RequestDefaults:
    """What a request leaves out: the server's command line (or the app's settings) decides.
    `request` carries max_new_tokens, stop, sampling (its seed is ignored: every request draws
    its own) and speculation; `system` is added to chats that bring no system message."""

    request: GenerationRequest = field(default_factory=GenerationRequest)
    system: str | None = None
    max_choices: int = 8


@dataclass(frozen=True)
class ApiRequest:
    """One parsed API call: `choices` holds one GenerationRequest per choice (n of them; with a
    seed S, choice i samples with seed S + i, like `specchat generate --samples`)."""

    kind: Kind
    model: str | None
    choices: tuple[GenerationRequest, ...]
    stream: bool = False
    include_usage: bool = False
    output: OutputSettings | None = None  # how answers are split (None: all text is content)


# ---- requests ------------------------------------------------------------------------------------
def parse_request(kind: Kind, body: object, defaults: RequestDefaults, context_length: int = 0,
                  chat_template: str = "") -> ApiRequest:
    """An API request body -> ApiRequest; raises ApiError (400) naming the bad field.
    context_length: the model's (0 = unknown), the most `max_tokens` may ask for;
    chat_template: the model's ("" = unknown), which says whether it takes tools and how its
    answers are split."""
    if not isinstance(body, dict):
        raise bad_request("The request body must be a JSON object.")
    for name, why in REFUSED.items():
        if body.get(name) not in (None, False, 0, [], {}):
            raise bad_request(f"'{name}' is not supported by this server: {why}.", name)
    try:
        tools, output, effort, constraint = _tool_fields(kind, body, chat_template)
        logprobs = parse_logprobs(kind, body)
    except (ToolError, LogprobsError) as exc:
        raise bad_request(exc.message, exc.param) from None
    model = _optional(body, "model", str)
    stream = bool(_optional(body, "stream", bool) or False)
    options = _optional(body, "stream_options", dict)
    if options is not None and not stream:
        raise bad_request("'stream_options' is only allowed when 'stream' is true.", "stream_options")
    include_usage = bool(options and _optional(options, "include_usage", bool, "stream_options.include_usage"))
    n = _optional(body, "n", int)
    n = 1 if n is None else n
    if not 1 <= n <= defaults.max_choices:
        raise bad_request(f"'n' must be from 1 to {defaults.max_choices} (got {n}).", "n")

    base = defaults.request
    if kind == "chat":
        messages, raw = _messages(body.get("messages"), defaults.system), None
        if not tools and any(m.tool_calls or m.role == "tool" for m in messages):
            try:  # a history with calls needs a template that shows them (tools were checked already)
                check_template(chat_format(chat_template), bool(chat_template), "messages")
            except ToolError as exc:
                raise bad_request(exc.message, exc.param) from None
    else:
        messages, raw = (), _prompt(body.get("prompt"))
    max_tokens = _max_tokens(body, kind, context_length)
    stop = _stop(body.get("stop"), base.stop)
    seed = _optional(body, "seed", int)
    sampling = base.sampling
    values: dict[str, Any] = {}
    for name, kind_ in (("temperature", float), ("top_p", float), ("top_k", int), ("min_p", float),
                        ("repetition_penalty", float)):
        value = _optional(body, name, kind_)
        if value is not None:
            values[name] = value
    for name in IGNORED_PENALTIES:  # accepted and ignored, but only as OpenAI defines them
        value = _optional(body, name, float)
        if value is not None and not -2.0 <= value <= 2.0:
            raise bad_request(f"'{name}' must be from -2 to 2 (got {_shown(value)}).", name)
    try:
        sampling = replace(sampling, seed=None, **values)
        first = replace(base, messages=messages, raw_prompt=raw, stop=stop, sampling=sampling,
                        max_new_tokens=base.max_new_tokens if max_tokens is None else max_tokens, tools=tools,
                        reasoning_effort=effort, constraint=constraint, logprobs=logprobs)
    except InvalidRequest as exc:  # the settings validate themselves (engine.types)
        raise bad_request(exc.user_message) from exc
    if n > 1 and sampling.greedy:
        choices = (first,) * n  # greedy decoding gives every choice the same text
    else:
        start = seed if seed is not None else secrets.randbelow(2**31)
        try:
            choices = tuple(replace(first, sampling=replace(sampling, seed=start + i)) for i in range(n))
        except InvalidRequest as exc:
            raise bad_request(exc.user_message, "seed") from exc
    return ApiRequest(kind, model, choices, stream, include_usage, output)


def _tool_fields(kind: Kind, body: Mapping[str, Any], chat_template: str) -> tuple[
        tuple[ToolSpec, ...], OutputSettings | None, str | None, OutputConstraint | None]:
    """The tools shown to the model (none with tool_choice "none"), how its answers are split,
    the reasoning effort for its template, and the grammar its answer must match
    (constraints.py: response_format, tool_choice "required" or named)."""
    if kind == "completion":
        for name in ("tools", "tool_choice", "reasoning_effort"):
            if body.get(name) not in (None, []):
                raise ToolError(f"'{name}' needs a chat: use /v1/chat/completions.", name)
        return (), None, None, build_constraint(body, None, (), ToolChoice("none"), None)
    fmt = chat_format(chat_template)
    tools = parse_tools(body.get("tools"), fmt, bool(chat_template))
    choice = parse_tool_choice(body.get("tool_choice"), tools)
    max_calls = parse_parallel(body.get("parallel_tool_calls"))
    effort = parse_reasoning_effort(body.get("reasoning_effort"))
    if choice.mode == "none":
        tools = ()
    constraint = build_constraint(body, fmt, tools, choice, max_calls)
    output = OutputSettings(fmt, bool(tools), max_calls) if tools or fmt.reasoning else None
    return tools, output, effort, constraint


def _max_tokens(body: Mapping[str, Any], kind: Kind, context_length: int) -> int | None:
    """max_completion_tokens (chat) or max_tokens: at least 1, at most the model's context."""
    name = "max_completion_tokens" if kind == "chat" and body.get("max_completion_tokens") is not None \
        else "max_tokens"
    value = _optional(body, name, int)
    limit = context_length if context_length > 0 else MAX_TOKENS_CEILING
    if value is not None and value > limit:
        what = (f"this model's context, {limit:,} tokens (the prompt included)" if context_length > 0
                else f"{limit:,} tokens, the most this server accepts")
        raise bad_request(f"'{name}' is {_shown(value)}, more than {what}: ask for at most {limit} (the answer "
                          "also ends where the context is full).", name)
    return value


def _optional(body: Mapping[str, Any], name: str, kind: type, label: str | None = None) -> Any:
    """body[name] if present and not null, checked to be a `kind`: a whole number is a fine
    float, but a float (even 5.0) is no whole number and a bool is never a number; floats are
    finite."""
    value = body.get(name)
    if value is None:
        return None
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if kind is float:
        ok = number and math.isfinite(value)
        value = float(value) if ok else value
    elif kind is int:
        ok = number and isinstance(value, int)
    else:
        ok = isinstance(value, kind)
    if not ok:
        what = {bool: "true or false", int: "a whole number", float: "a finite number", str: "a string",
                dict: "an object"}[kind]
        raise bad_request(f"'{label or name}' must be {what} (got {_shown(value)}).", label or name)
    return value


def _shown(value: object) -> str:
    """A value quoted back in a message, cut short (a refused field may be megabytes)."""
    if isinstance(value, int) and not isinstance(value, bool) and len(str(abs(value))) > 15:
        return f"a {len(str(abs(value)))}-digit number"
    text = repr(value)
    return text if len(text) <= _SHOWN else text[:_SHOWN] + "…"


def _text(content: object, where: str) -> str:
    """A message's content: a string, or a list of text parts (images are refused)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise bad_request(f"{where}: only text content parts are supported.", "messages")
            parts.append(part["text"])
        return "".join(parts)
    if content is None:
        return ""
    raise bad_request(f"{where}: 'content' must be a string or a list of text parts.", "messages")


def _messages(raw: object, system: str | None) -> tuple[Message, ...]:
    if not isinstance(raw, list) or not raw:
        raise bad_request("'messages' must be a non-empty list of {role, content} objects.", "messages")
    messages = []
    calls: dict[str, ToolCall] = {}  # the calls made so far, by id: what a tool message answers
    for i, item in enumerate(raw):
        where = f"messages[{i}]"
        if not isinstance(item, dict):
            raise bad_request(f"{where} must be an object with 'role' and 'content'.", "messages")
        role = item.get("role")
        if not isinstance(role, str) or role not in ROLES:
            raise bad_request(f"{where}: role {_shown(role)} is not supported (system, developer, user, "
                              "assistant, tool).", "messages")
        try:
            message = _message(ROLES[role], item, where, calls)
        except ToolError as exc:
            raise bad_request(exc.message, exc.param) from None
        calls.update((c.id, c) for c in message.tool_calls)
        messages.append(message)
    if system and not any(m.role == "system" for m in messages):
        messages.insert(0, Message("system", system))
    return tuple(messages)


def _message(role: Literal["system", "user", "assistant", "tool"], item: Mapping[str, Any], where: str,
             calls: Mapping[str, ToolCall]) -> Message:
    content = _text(item.get("content"), where)
    if role == "assistant":
        reasoning = item.get("reasoning_content", item.get("reasoning"))
        if reasoning is not None and not isinstance(reasoning, str):
            raise bad_request(f"{where}: 'reasoning_content' must be a string.", "messages")
        return Message(role, content, tool_calls=parse_tool_calls(item.get("tool_calls"), where), reasoning=reasoning)
    if role == "tool":
        call_id = check_id(item.get("tool_call_id"), f"{where}.tool_call_id")
        if call_id not in calls:
            raise bad_request(f"{where}: tool_call_id {_shown(call_id)} matches no call of an earlier assistant "
                              "message.", "messages")
        name = item.get("name")
        if name is not None and not isinstance(name, str):
            raise bad_request(f"{where}: 'name' must be a string.", "messages")
        return Message(role, content, tool_call_id=call_id, name=name or calls[call_id].name)
    for key in ("tool_calls", "tool_call_id"):
        if item.get(key) is not None:
            raise bad_request(f"{where}: only {'assistant' if key == 'tool_calls' else 'tool'} messages carry "
                              f"'{key}'.", "messages")
    return Message(role, content)


def _prompt(raw: object) -> str:
    if isinstance(raw, list) and len(raw) == 1 and isinstance(raw[0], str):
        raw = raw[0]
    if not isinstance(raw, str):
        raise bad_request("'prompt' must be a string (one prompt per request; token ids are not supported).",
                          "prompt")
    if not raw:
        raise bad_request("'prompt' is empty.", "prompt")
    return raw


def _stop(raw: object, default: tuple[str, ...]) -> tuple[str, ...]:
    if raw is None:
        return default
    stops = [raw] if isinstance(raw, str) else raw
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops) or len(stops) > MAX_STOP_STRINGS:
        raise bad_request(f"'stop' must be a string or a list of at most {MAX_STOP_STRINGS} strings.", "stop")
    return tuple(s for s in stops if s)
