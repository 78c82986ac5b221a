"""Text in and out of the token world: prompts through the model's chat template (with the
request's tools, the assistant's tool calls and reasoning, and tool results, all as the
template itself words them), streaming detokenisation with stop strings, and the model's
end-of-sequence ids.

The answer's text keeps the special tokens that mark tool calls and reasoning in the model's
own format (FORMAT_MARKERS, when its chat template uses them: gpt-oss's <|channel|>, Mistral's
[TOOL_CALLS], Llama 3's <|python_tag|>, Gemma 4's <|tool_call>), so engine.serving.formats can tell a call from prose;
every other special token (end of turn, padding) is left out as before.

What this module does not do: decide tokens (sampling, verification), load tokenizers, or parse
tool calls out of an answer (engine.serving.formats).
"""

from __future__ import annotations

import json
from typing import Any

from engine.errors import InvalidRequest
from engine.types import GenerationRequest, Message, Tokenizer
from engine.untrusted import MIB, Overran, run_within

TEMPLATE_SECONDS = 30.0  # real templates take milliseconds, even for a conversation of thousands of messages
RENDERED_PER_CHARACTER = 8  # a template repeats a system prompt, wraps each message: never 8 times the text
# special tokens that carry a chat format's structure in an answer (kept in its text when the
# model's template uses them): Llama 3's tool-call tag, Mistral's tool calls, gpt-oss's harmony
# messages, and the reasoning and tool-call tags of models whose tags are special tokens
FORMAT_MARKERS = frozenset({
    "<|python_tag|>", "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]", "[THINK]", "[/THINK]",
    "<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|call|>", "<|constrain|>",
    "<tool_call>", "</tool_call>", "<think>", "</think>",
    "<|tool_call>", "<tool_call|>", "<|channel>", "<channel|>", '<|"|>',  # Gemma 4
})


def encode_prompt(tokenizer: Tokenizer, request: GenerationRequest) -> list[int]:
    """Token ids of the request's prompt: a raw prompt as it is (with the tokenizer's own
    special tokens, e.g. BOS), chat messages through the model's chat template with the
    assistant's turn opened."""
    if request.raw_prompt is not None:
        ids = list(tokenizer(request.raw_prompt, add_special_tokens=True)["input_ids"])
    else:
        if not request.messages:
            raise InvalidRequest("The prompt is empty: type a message first.")
        if not tokenizer.chat_template:
            raise InvalidRequest("This model has no chat template; use --raw-prompt to feed plain text.")
        text = render_chat(tokenizer, request)
        ids = [int(i) for i in tokenizer(text, add_special_tokens=False)["input_ids"]]
    if not ids:
        raise InvalidRequest("The prompt is empty: type a message first.")
    return ids


def render_chat(tokenizer: Tokenizer, request: GenerationRequest, seconds: float | None = None) -> str:
    """The request's messages (and tools) through the model's chat template, as text (what
    apply_chat_template(tokenize=True) then tokenizes without special tokens). The template is
    the model's code: sandboxed, but free to loop for hours or render gigabytes, so it gets
    `seconds` (default TEMPLATE_SECONDS) and at most RENDERED_PER_CHARACTER times the
    conversation's text (plus 1 MiB)."""
    seconds = TEMPLATE_SECONDS if seconds is None else seconds
    if request.tools and not template_takes_tools(template_text(tokenizer)):
        raise InvalidRequest("This model's chat template has no tool support (it never mentions tools), so it "
                             "cannot be given tools: leave 'tools' out, or use a model made for tool calling.")
    msgs = [template_message(m) for m in request.messages]
    options: dict[str, Any] = ({"continue_final_message": True} if request.continue_final
                               else {"add_generation_prompt": True})
    if request.tools:
        options["tools"] = [{"type": "function", "function": {"name": t.name, "description": t.description,
                                                              "parameters": json.loads(t.parameters)}}
                            for t in request.tools]
    if request.reasoning_effort is not None:
        options["reasoning_effort"] = request.reasoning_effort
    try:  # continue_final: the answer's own end-of-turn is left out, so it goes on
        text = run_within(seconds, lambda: tokenizer.apply_chat_template(msgs, tokenize=False, **options))
    except Overran:
        raise InvalidRequest(f"The model's chat template did not finish this conversation in {seconds:g} s (it may "
                             "loop without end): the model's files are faulty. A raw prompt (--raw-prompt) skips the "
                             "template.") from None
    except Exception as exc:  # noqa: BLE001 - the template is the model's own (sandboxed) code: any error is its refusal
        raise InvalidRequest(template_refusal(exc, request)) from exc
    given = sum(len(m.content) + len(m.reasoning or "") + sum(len(c.name) + len(c.arguments) for c in m.tool_calls)
                for m in request.messages)
    given += sum(len(t.name) + len(t.description) + len(t.parameters) for t in request.tools)
    if not isinstance(text, str) or len(text) > RENDERED_PER_CHARACTER * given + MIB:
        raise InvalidRequest(f"The model's chat template turned {given:,} characters of conversation into "
                             f"{len(text) if isinstance(text, str) else 0:,}: the model's files are faulty. A raw "
                             "prompt (--raw-prompt) skips the template.")
    return text


def template_message(message: Message) -> dict[str, Any]:
    """One message as chat templates read it (the shape transformers documents): an assistant's
    calls with their arguments parsed (templates write them with `tojson`), its reasoning under
    both names templates use (Qwen's reasoning_content, gpt-oss's thinking), a tool result with
    its call's id and function name. Keys a message lacks are left out (templates test them
    with `is defined`)."""
    out: dict[str, Any] = {"role": message.role, "content": message.content}
    if message.tool_calls:
        out["tool_calls"] = [{"id": c.id, "type": "function",
                              "function": {"name": c.name, "arguments": _arguments(c.arguments)}}
                             for c in message.tool_calls]
    if message.tool_call_id is not None:
        out["tool_call_id"] = message.tool_call_id
    if message.name is not None:
        out["name"] = message.name
    if message.reasoning is not None:
        out["reasoning_content"] = out["thinking"] = message.reasoning
    return out


def _arguments(text: str) -> object:
    """A call's arguments for the template: the object its JSON text holds (the server checked
    it), or the text as it is when it holds none."""
    try:
        return json.loads(text)
    except ValueError:
        return text


def template_text(tokenizer: Tokenizer) -> str:
    """All of the model's chat template source ("" without one; a set of named templates joined)."""
    template: object = tokenizer.chat_template
    if isinstance(template, dict):
        return "\n".join(t for t in template.values() if isinstance(t, str))
    return template if isinstance(template, str) else ""


def template_takes_tools(template: str) -> bool:
    """Whether a chat template shows tools to the model at all: one that never names the
    `tools` variable drops them without a word."""
    return "tools" in template


def template_refusal(exc: Exception, request: GenerationRequest) -> str:
    """What to tell a user whose conversation the model's chat template refused (templates
    raise e.g. "Conversation roles must alternate user/assistant/user/assistant/...")."""
    reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200].rstrip(".")
    hint = ("Many templates take no system message: try without one. " if any(m.role == "system" for m in
            request.messages) else "")
    return (f"The model's chat template refused this conversation ({reason}). {hint}A raw prompt "
            "(--raw-prompt) skips the template.")


def eos_ids(tokenizer: Tokenizer, *configs: Any) -> frozenset[int]:
    """Every id that ends an answer: `eos_token_id` of each config (int or list; generation
    configs often list several, e.g. Llama 3's <|eot_id|>) and the tokenizer's own."""
    ids: set[int] = set()
    for source in configs:
        eos = getattr(source, "eos_token_id", None)
        if isinstance(eos, int):
            ids.add(eos)
        elif isinstance(eos, (list, tuple)):
            ids.update(int(e) for e in eos)
    if isinstance(tokenizer.eos_token_id, int):
        ids.add(tokenizer.eos_token_id)
    return frozenset(ids)


def format_markers(tokenizer: Tokenizer) -> dict[int, str]:
    """The special tokens an answer's text keeps: those of FORMAT_MARKERS that the model's chat
    template uses (a token can be special and still carry a call: skipping every special token
    would leave gpt-oss's calls without their channel, Mistral's without [TOOL_CALLS])."""
    template = template_text(tokenizer)
    added = getattr(tokenizer, "added_tokens_decoder", None)
    if not template or not isinstance(added, dict):
        return {}
    markers = {}
    for i, token in added.items():
        text = str(getattr(token, "content", token))
        if getattr(token, "special", False) and text in FORMAT_MARKERS and text in template:
            markers[int(i)] = text
    return markers


class Detokenizer:
    """Incremental text for streaming: holds back an incomplete UTF-8 character and any tail
    that could be the start of a stop string; cuts the text at the first stop string. Special
    tokens are left out, but for the model's format markers (format_markers)."""

    def __init__(self, tokenizer: Tokenizer, stops: tuple[str, ...]) -> None:
        self.tokenizer = tokenizer
        self.stops = tuple(s for s in stops if s)
        self.markers = format_markers(tokenizer)
        self.text = ""  # what has been emitted so far

    def decode(self, ids: list[int]) -> str:
        """The text of `ids` without special tokens, but for the format markers kept in place."""
        if not self.markers or not any(i in self.markers for i in ids):
            full = self.tokenizer.decode(ids, skip_special_tokens=True)
            assert isinstance(full, str), "one sequence of ids decodes to one string"
            return full
        parts, start = [], 0
        for at, token in enumerate(ids):  # each run between markers decoded whole (its bytes join up)
            if token in self.markers:
                parts += [self.decode(ids[start:at]) if at > start else "", self.markers[token]]
                start = at + 1
        parts.append(self.decode(ids[start:]) if start < len(ids) else "")
        return "".join(parts)

    def push(self, ids: list[int], final: bool) -> tuple[str, bool]:
        """The new text of the answer `ids` (all of it so far) and whether a stop string ended it."""
        full = self.decode(ids)
        stopped = False
        for s in self.stops:
            at = full.find(s)
            if at >= 0:
                full, stopped, final = full[:at], True, True
        if not final:
            if full.endswith("\ufffd"):
                full = full.rstrip("\ufffd")
            hold = 0
            for s in self.stops:
                for k in range(min(len(s) - 1, len(full)), 0, -1):
                    if full.endswith(s[:k]):
                        hold = max(hold, k)
                        break
            full = full[: len(full) - hold]
        if not full.startswith(self.text):  # tokenizer re-segmented earlier text; keep what was shown
            full = self.text + full[len(self.text):]
        delta = full[len(self.text) :]
        self.text = full
        return delta, stopped
