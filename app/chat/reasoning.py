"""An answer's text split the way its model writes it: the reasoning (the chat's "Thinking"
block) apart from the answer, a tool call as a readable "Tool call: name(args)" line, and none
of the format's markers (`<think>`, harmony's `<|channel|>`, `[TOOL_CALLS]`, ...) in either.

The split is engine.serving.formats' own parser, the one the API server uses, run for the chat
format of the model that answers: the local model's chat template (`answer_format`), or for a
remote server `REMOTE`: a `<think>` block at the answer's start, which is what a server without
a reasoning parser sends (an answer that does not start with one passes through as it came). The engine's detokeniser keeps a format's marker tokens in the text
so the parser can read them; whatever marker is left after the split is taken out here, held
back while a chunk's end could be the start of one. A model whose template has neither a
reasoning nor a tool format passes through untouched, and so does an answer's continuation
(Continue writes on from stored answer text, after any reasoning).

What this does not do: show anything, time the reasoning (the turn controller does) or decide
what the next turn's prompt holds (the template does, from Message.reasoning).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from engine.decoding.text import FORMAT_MARKERS
from engine.serving.formats import (
    END_THINK,
    THINK,
    ChatFormat,
    OutputDelta,
    OutputParser,
    chat_format,
)
from engine.serving.format_text import marker_prefix
from engine.types import ToolCall


@dataclass(frozen=True)
class AnswerFormat:
    """How one model's answers are split: its chat format, and the marker texts its template
    uses (the ones the detokeniser keeps in an answer). only_opened: split only an answer that
    starts with <think> (a remote model's format is not known); any other passes through."""

    chat: ChatFormat = ChatFormat()
    markers: frozenset[str] = frozenset()
    only_opened: bool = False

    @property
    def plain(self) -> bool:
        """Nothing to split: no reasoning and no tool format."""
        return self.chat.reasoning is None and self.chat.tools is None


PLAIN = AnswerFormat()
REMOTE = AnswerFormat(ChatFormat(reasoning="think"), frozenset({THINK, END_THINK}), only_opened=True)


def answer_format(template: str) -> AnswerFormat:
    """The format of a model whose chat template is `template` ("" when unknown: plain)."""
    if not template:
        return PLAIN
    return AnswerFormat(chat_format(template), frozenset(m for m in FORMAT_MARKERS if m in template))


@dataclass(frozen=True)
class SplitDelta:
    """What a piece of an answer adds to each part."""

    content: str = ""
    reasoning: str = ""


class AnswerSplitter:
    """One answer's raw text, fed in the pieces it streams in (`feed`, then `finish` once), as
    deltas of answer and reasoning. `resume`: the text continues a stored answer (no reasoning,
    no trimming: it joins the text before it as written)."""

    def __init__(self, fmt: AnswerFormat, resume: bool = False) -> None:
        # Llama 3's calls are a whole answer of JSON: reading them would hold back every answer
        # that starts with "{" until its end, so its calls stay text (the chat offers no tools)
        self._parser = None if fmt.plain or resume else OutputParser(fmt.chat, tools=fmt.chat.tools != "llama3")
        self._content = _MarkerFilter(fmt.markers)
        self._reasoning = _MarkerFilter(fmt.markers)
        self._shown = False  # some answer text has been handed out
        self._start: str | None = "" if fmt.only_opened and self._parser is not None else None  # held till it tells

    def feed(self, text: str) -> SplitDelta:
        return self._read(text, final=False)

    def finish(self) -> SplitDelta:
        """The answer ended: what was held back, decided."""
        return self._read("", final=True)

    def _read(self, text: str, final: bool) -> SplitDelta:
        if self._start is not None:  # only_opened: held until the answer's start shows whether it opens <think>
            text = self._start + text
            lead = text.lstrip()
            if not final and THINK.startswith(lead):
                self._start = text
                return SplitDelta()
            self._start = None
            if not lead.startswith(THINK):
                self._parser = None
        if self._parser is None:
            return self._out(text, "", (), final)
        delta = self._parser.feed(text)
        if final:
            tail = self._parser.finish()
            delta = OutputDelta(delta.content + tail.content, delta.reasoning + tail.reasoning, delta.calls + tail.calls)
        return self._out(delta.content, delta.reasoning, delta.calls, final)

    def _out(self, content: str, reasoning: str, calls: tuple[ToolCall, ...], final: bool) -> SplitDelta:
        for call in calls:  # where the call was written: the parser hands it out after the prose before it
            content += ("\n\n" if self._shown or content else "") + call_line(call) + "\n\n"
        content = self._content.push(content, final)
        self._shown = self._shown or bool(content)
        return SplitDelta(content, self._reasoning.push(reasoning, final))


def call_line(call: ToolCall) -> str:
    """A tool call as the chat shows it: **Tool call:** `name({"arg": 1})`."""
    try:
        args = json.dumps(json.loads(call.arguments), ensure_ascii=False)
    except ValueError:
        args = call.arguments
    return f"**Tool call:** {_code_span(f'{call.name}({args})')}"


def _code_span(text: str) -> str:
    """`text` as a Markdown code span, whatever backticks it holds."""
    longest = run = 0
    for c in text:
        run = run + 1 if c == "`" else 0
        longest = max(longest, run)
    fence = "`" * (longest + 1)
    pad = " " if text.startswith("`") or text.endswith("`") else ""
    return f"{fence}{pad}{text}{pad}{fence}"


class _MarkerFilter:
    """Text with the given markers taken out, in pieces: a piece's end that could begin a marker
    is held until the next piece (or the end) tells."""

    def __init__(self, markers: frozenset[str]) -> None:
        self._markers = sorted(markers, key=len, reverse=True)  # the longest first: no marker hides inside another
        self._held = ""

    def push(self, text: str, final: bool) -> str:
        if not self._markers:
            return text
        text = self._held + text
        for marker in self._markers:
            text = text.replace(marker, "")
        hold = 0 if final else marker_prefix(text, self._markers)
        self._held = text[len(text) - hold:]
        return text[:len(text) - hold]

