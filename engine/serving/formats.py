"""A model's chat format, read from its chat template, and its answers split the way that format
writes them: prose (`content`), reasoning (`reasoning_content`) and tool calls.

Tool-call formats (chat_format() picks one from the template's own markers):
- "hermes" (Qwen 2.5 / 3, Hermes, most fine-tunes): one `<tool_call>{"name": ..., "arguments":
  {...}}</tool_call>` block per call, prose around them.
- "llama3" (Llama 3.1 - 3.3): the whole answer is the call, `{"name": ..., "parameters": {...}}`,
  maybe after <|python_tag|>, several separated by ";".
- "mistral": `[TOOL_CALLS]` then a JSON list of {"name", "arguments"}, or (newer tokenizers)
  `name[ARGS]{...}` per call, each after its own [TOOL_CALLS].
- "harmony" (gpt-oss): messages `<|channel|>NAME<|message|>...<|end|>`; a call is a message
  `to=functions.NAME ... <|message|>{...}<|call|>`.
- "gemma4": one `<|tool_call>call:NAME{key:<|"|>text<|"|>,...}<tool_call|>` block per call, in
  Gemma's own value syntax (format_gemma.py), prose around them.
Reasoning: "think" (`<think>...</think>` before the answer; a template whose generation prompt
opens <think> itself has answers that start inside it), "harmony" (the analysis channel) and
"gemma4" (`<|channel>thought ... <channel|>` before the answer).

OutputParser reads an answer's text in the pieces it streams in and returns deltas: content,
reasoning, and whole calls. A call is handed out once it is complete and its arguments parse as
a JSON object, so a stream never carries a call the whole answer would not; a block that does
not parse is content, as the model wrote it. The answer that is not streamed is the same parser
run over the whole text, so the two agree for every split (the tests check this). Text that
could be the start of a marker is held back until the next piece tells. Content and reasoning
are trimmed of whitespace at both ends (trailing whitespace is held while more may follow it).

What this does not do: constrain decoding (a call's arguments are not checked against the tool's
schema, only to be a JSON object), or check requests (tools.py).
"""

from __future__ import annotations

import json
import re
import secrets
import string
from dataclasses import dataclass, field
from typing import Literal

from engine.decoding.text import template_takes_tools
from engine.serving.format_gemma import gemma_call
from engine.serving.format_text import find_marker, json_value, json_values, marker_prefix
from engine.types import ToolCall

ToolFormat = Literal["hermes", "llama3", "mistral", "harmony", "gemma4"]
ReasoningFormat = Literal["think", "harmony", "gemma4"]
NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for function names
THINK, END_THINK = "<think>", "</think>"
TOOL_CALL, END_TOOL_CALL = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
TOOL_CALLS, ARGS, CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"
MESSAGE = "<|message|>"
HARMONY_ENDS = ("<|end|>", "<|call|>", "<|return|>", "<|start|>")
GEMMA_CALL, GEMMA_END_CALL = "<|tool_call>", "<tool_call|>"
GEMMA_THOUGHT, GEMMA_END_THOUGHT = "<|channel>thought", "<channel|>"
_CHANNEL = re.compile(r"<\|channel\|>\s*([A-Za-z_]+)")
_RECIPIENT = re.compile(r"\bto=([^\s<]+)")
_ID_CHARS = string.ascii_letters + string.digits

# tool formats whose calls the server can force under a grammar (engine.serving.constraints)
GRAMMAR_FORMATS = ("hermes", "llama3", "mistral", "harmony", "gemma4")


@dataclass(frozen=True)
class ChatFormat:
    """What a chat template says about its model's answers. takes_tools: the template shows
    tools at all; tools: how calls are written (None: no format this server reads);
    opens_thinking: the generation prompt opens <think>, so an answer starts as reasoning."""

    tools: ToolFormat | None = None
    takes_tools: bool = False
    reasoning: ReasoningFormat | None = None
    opens_thinking: bool = False
    calls_by_name: bool = False  # Mistral: `[TOOL_CALLS]NAME[ARGS]{...}` rather than a JSON list

    def call_id(self) -> str:
        """A fresh id for a call: OpenAI's shape, but Mistral's templates insist on 9 letters or digits."""
        if self.tools == "mistral":
            return "".join(secrets.choice(_ID_CHARS) for _ in range(9))
        return "call_" + "".join(secrets.choice(_ID_CHARS) for _ in range(24))


def chat_format(template: str) -> ChatFormat:
    """The format a chat template speaks, from the markers it writes."""
    takes = template_takes_tools(template)
    tools: ToolFormat | None = None
    reasoning: ReasoningFormat | None = None
    if "<|channel|>" in template and MESSAGE in template:
        tools, reasoning = "harmony", "harmony"
    elif TOOL_CALLS in template:
        tools = "mistral"
    elif GEMMA_CALL in template:
        tools = "gemma4"
    elif TOOL_CALL in template:
        tools = "hermes"
    elif PYTHON_TAG in template or ("<|start_header_id|>" in template and '"parameters"' in template):
        tools = "llama3"
    opens = False
    if reasoning is None and GEMMA_END_THOUGHT in template and "<|channel>" in template:
        reasoning = "gemma4"
    elif reasoning is None and END_THINK in template:
        reasoning = "think"
        prompt = template[template.rfind("add_generation_prompt"):]  # the generation prompt's part
        opens = prompt.count(THINK) > prompt.count(END_THINK)
    by_name = tools == "mistral" and ARGS in template
    return ChatFormat(tools if takes else None, takes, reasoning, opens, by_name)


@dataclass(frozen=True)
class OutputDelta:
    """What one piece of an answer adds: text of each kind, and the calls completed, the first
    being the answer's call number `call_index`."""

    content: str = ""
    reasoning: str = ""
    calls: tuple[ToolCall, ...] = ()
    call_index: int = 0


@dataclass(frozen=True)
class ParsedOutput:
    """A whole answer, split: content None when there is none (only calls, or only reasoning)."""

    content: str | None
    reasoning: str | None
    calls: tuple[ToolCall, ...]


@dataclass(frozen=True)
class OutputSettings:
    """How a request's answers are split: the model's format, whether tool calls are read
    (tool_choice "none": only reasoning is), and at most how many calls are kept
    (parallel_tool_calls false: one)."""

    format: ChatFormat
    tools: bool
    max_calls: int | None = None

    def parser(self) -> OutputParser:
        return OutputParser(self.format, self.tools, self.max_calls)

    def parse(self, text: str) -> ParsedOutput:
        parser = self.parser()
        parser.feed(text)
        parser.finish()
        return parser.result()


class _Trimmed:
    """Text handed out in pieces with the whitespace at both of its ends left out: leading
    whitespace is dropped, trailing whitespace held until more text follows it."""

    def __init__(self) -> None:
        self.text = ""
        self._held = ""

    def push(self, piece: str) -> str:
        piece = self._held + piece
        if not self.text:
            piece = piece.lstrip()
        kept = piece.rstrip()
        self._held = piece[len(kept):]
        self.text += kept
        return kept


@dataclass
class _Out:
    content: list[str] = field(default_factory=list)
    reasoning: list[str] = field(default_factory=list)
    calls: list[ToolCall] = field(default_factory=list)


State = Literal["start", "content", "reasoning", "call", "rest", "header", "body"]


class OutputParser:
    """One answer's text, fed in pieces (feed, then finish once), split into deltas; result()
    is the whole of it. See the module docstring for the formats and the rules."""

    def __init__(self, fmt: ChatFormat, tools: bool = True, max_calls: int | None = None) -> None:
        self.format = fmt
        self.tools = fmt.tools if tools else None
        self.max_calls = max_calls
        self.calls: list[ToolCall] = []
        self._harmony = fmt.reasoning == "harmony" or fmt.tools == "harmony"
        self._state: State = "header" if self._harmony else "start"
        self._buffer = ""  # text not yet handed out
        self._scanned = 0  # how much of the buffer a held block has searched for its end already
        self._opened = ""  # the marker that opened the block being read (its text, if it is no call)
        self._thought = False  # a <think> block has ended: another <think> is prose
        self._to = "content"  # harmony: where the message being read goes ("content", "reasoning", "call")
        self._name = ""  # harmony: the function a call message is for
        self._content = _Trimmed()
        self._reasoning = _Trimmed()
        self._finished = False

    def feed(self, text: str) -> OutputDelta:
        assert not self._finished, "an answer's pieces come before its end"
        self._buffer += text
        return self._run(final=False)

    def finish(self) -> OutputDelta:
        """The answer has ended: what was held back is decided now."""
        delta = self._run(final=True)
        self._finished = True
        return delta

    def result(self) -> ParsedOutput:
        return ParsedOutput(self._content.text or None, self._reasoning.text or None, tuple(self.calls))

    # ---- the machine --------------------------------------------------------------------------
    def _run(self, final: bool) -> OutputDelta:
        out = _Out()
        first = len(self.calls)
        while self._step(out, final):
            pass
        return OutputDelta("".join(out.content), "".join(out.reasoning), tuple(out.calls), first)

    def _step(self, out: _Out, final: bool) -> bool:
        """Read as much of the buffer as the state can; True when the state changed (read on)."""
        state = self._state
        if state == "start":
            return self._start(final)
        if state == "content":
            return self._prose(out, final)
        if state == "reasoning":
            return self._thinking(out, final)
        if state == "call":
            return self._tool_call(out, final)
        if state == "rest":
            return self._rest(out, final)
        if state == "header":
            return self._header(out, final)
        return self._body(out, final)

    def _go(self, state: State, opened: str = "") -> bool:
        self._state, self._opened, self._scanned = state, opened, 0
        return True

    def _start(self, final: bool) -> bool:
        if self.format.reasoning == "think" and self.format.opens_thinking:
            return self._go("reasoning")
        if self.tools == "llama3":  # a call is the whole answer: it shows in the first characters
            lead = self._buffer.lstrip()
            if lead.startswith(("{", PYTHON_TAG)):
                return self._go("rest")
            if not final and (not lead or PYTHON_TAG.startswith(lead)):
                return False
        return self._go("content")

    def _prose(self, out: _Out, final: bool) -> bool:
        markers = []
        if self.tools == "hermes":
            markers.append(TOOL_CALL)
        elif self.tools == "gemma4":
            markers.append(GEMMA_CALL)
        elif self.tools == "mistral":
            markers.append(TOOL_CALLS)
        elif self.tools == "llama3":
            markers.append(PYTHON_TAG)
        lead = self._buffer.lstrip()
        opener = {"think": THINK, "gemma4": GEMMA_THOUGHT}.get(self.format.reasoning or "")
        if (opener is not None and not self._thought and not self._content.text
                and (lead.startswith(opener) or opener.startswith(lead))):  # only the answer's start opens reasoning
            markers.append(opener)
        found = find_marker(self._buffer, markers)
        if found is None:
            keep = 0 if final else marker_prefix(self._buffer, markers)
            out.content.append(self._content.push(self._buffer[:len(self._buffer) - keep]))
            self._buffer = self._buffer[len(self._buffer) - keep:]
            return False
        at, marker = found
        out.content.append(self._content.push(self._buffer[:at]))
        self._buffer = self._buffer[at + len(marker):]
        if marker in (THINK, GEMMA_THOUGHT):
            return self._go("reasoning")
        return self._go("call" if marker in (TOOL_CALL, GEMMA_CALL) else "rest", marker)

    def _thinking(self, out: _Out, final: bool) -> bool:
        end = [GEMMA_END_THOUGHT if self.format.reasoning == "gemma4" else END_THINK]
        found = find_marker(self._buffer, end)
        if found is None:
            keep = 0 if final else marker_prefix(self._buffer, end)
            out.reasoning.append(self._reasoning.push(self._buffer[:len(self._buffer) - keep]))
            self._buffer = self._buffer[len(self._buffer) - keep:]
            return False
        at, marker = found
        out.reasoning.append(self._reasoning.push(self._buffer[:at]))
        self._buffer = self._buffer[at + len(marker):]
        self._thought = True
        return self._go("content")

    def _tool_call(self, out: _Out, final: bool) -> bool:
        """Inside <tool_call> (Gemma's <|tool_call>): held until its end marker (or the answer's
        end) closes it."""
        gemma = self.tools == "gemma4"
        found = self._find_end([GEMMA_END_CALL if gemma else END_TOOL_CALL])
        if found is None and not final:
            return False
        at, marker = found if found is not None else (len(self._buffer), "")
        body = self._buffer[:at]
        self._buffer = self._buffer[at + len(marker):]
        if gemma:
            named = gemma_call(body)
            call = self._call({"name": named[0], "arguments": named[1]}) if named is not None else None
        else:
            call = self._call(json_value(body))
        if call is not None:
            self._add(call, out)
        else:
            out.content.append(self._content.push(self._opened + body + marker))
        return self._go("content")

    def _rest(self, out: _Out, final: bool) -> bool:
        """Llama 3 and Mistral: the calls run to the answer's end, read once it has come."""
        if not final:
            return False
        text, self._buffer = self._buffer, ""
        calls = self._llama3(text) if self.tools == "llama3" else self._mistral(text)
        if calls is None:
            out.content.append(self._content.push(self._opened + text))
        else:
            for call in calls:
                self._add(call, out)
        self._go("content")
        return False

    def _header(self, out: _Out, final: bool) -> bool:
        """Harmony: a message's header (channel, recipient) runs to <|message|>."""
        found = self._find_end([MESSAGE])
        if found is None:
            if final:
                if "<|" not in self._buffer:  # no harmony at all: the model wrote plain prose
                    out.content.append(self._content.push(self._buffer))
                self._buffer = ""
            return False
        at, marker = found
        header, self._buffer = self._buffer[:at], self._buffer[at + len(marker):]
        channel, recipient = _CHANNEL.search(header), _RECIPIENT.search(header)
        if recipient is not None:
            self._to, self._name = "call", recipient.group(1).removeprefix("functions.")
        else:
            self._to = "reasoning" if channel is not None and channel.group(1) == "analysis" else "content"
        if self._to != "call":  # messages of one kind are paragraphs of one text
            (self._reasoning if self._to == "reasoning" else self._content).push("\n\n")
        return self._go("body")

    def _body(self, out: _Out, final: bool) -> bool:
        """Harmony: a message's text, to <|end|>, <|call|> or the answer's end."""
        if self._to == "call":
            found = self._find_end(HARMONY_ENDS)
            if found is None and not final:
                return False
            at, marker = found if found is not None else (len(self._buffer), "")
            body, self._buffer = self._buffer[:at], self._buffer[at + len(marker):]
            call = self._call({"name": self._name, "arguments": json_value(body)}) if self.tools else None
            if call is not None:
                self._add(call, out)
            else:
                out.content.append(self._content.push(body))
            return self._go("header")
        target, pieces = ((self._reasoning, out.reasoning) if self._to == "reasoning"
                          else (self._content, out.content))
        found = find_marker(self._buffer, HARMONY_ENDS)
        if found is None:
            keep = 0 if final else marker_prefix(self._buffer, HARMONY_ENDS)
            pieces.append(target.push(self._buffer[:len(self._buffer) - keep]))
            self._buffer = self._buffer[len(self._buffer) - keep:]
            return False
        at, marker = found
        pieces.append(target.push(self._buffer[:at]))
        self._buffer = self._buffer[at + len(marker):]
        return self._go("header")

    # ---- calls --------------------------------------------------------------------------------
    def _find_end(self, markers: tuple[str, ...] | list[str]) -> tuple[int, str] | None:
        """The end of a held block: searched from where the last piece's search stopped."""
        found = find_marker(self._buffer, markers, max(0, self._scanned - max(map(len, markers))))
        self._scanned = len(self._buffer)
        return found

    def _add(self, call: ToolCall, out: _Out) -> None:
        if self.max_calls is None or len(self.calls) < self.max_calls:
            self.calls.append(call)
            out.calls.append(call)

    def _call(self, value: object) -> ToolCall | None:
        """{"name": ..., "arguments" (or Llama's "parameters"): {...}} as a call, or None."""
        if not isinstance(value, dict) or not isinstance(value.get("name"), str):
            return None
        name = value["name"]
        args = value.get("arguments", value.get("parameters", {}))
        if isinstance(args, str):  # some models write the arguments as a JSON string
            args = json_value(args)
        if not NAME.fullmatch(name) or not isinstance(args, dict):
            return None
        return ToolCall(self.format.call_id(), name, json.dumps(args, ensure_ascii=False))

    def _llama3(self, text: str) -> list[ToolCall] | None:
        text = text.strip().removeprefix(PYTHON_TAG)
        return self._calls(json_values(text, ";"))

    def _mistral(self, text: str) -> list[ToolCall] | None:
        calls: list[ToolCall] = []
        for piece in text.split(TOOL_CALLS):
            if not piece.strip():
                continue
            if ARGS in piece:  # name[ARGS]{...} (or name[CALL_ID]id[ARGS]{...})
                name, args = piece.split(ARGS, 1)
                call = self._call({"name": name.split(CALL_ID)[0].strip(), "arguments": json_value(args)})
                if call is None:
                    return None
                calls.append(call)
            else:
                found = self._calls(json_values(piece, ","))
                if found is None:
                    return None
                calls += found
        return calls or None

    def _calls(self, values: list[object] | None) -> list[ToolCall] | None:
        """Every value a call (a JSON list of calls counts as its items), or None."""
        if not values:
            return None
        items = [item for value in values for item in (value if isinstance(value, list) else [value])]
        calls = [self._call(item) for item in items]
        if None in calls:
            return None
        return [c for c in calls if c is not None]
