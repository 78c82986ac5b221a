"""The server's answers in OpenAI's shapes: whole responses (chat and legacy completions),
streamed chunks (`ChunkWriter`), usage, finish reasons and model cards. protocol.py reads the
requests; this writes what goes back."""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass, field
from typing import Any

from engine.serving.formats import OutputDelta, OutputSettings, ParsedOutput
from engine.serving.logprobs import shaped
from engine.serving.protocol import Kind
from engine.types import Completion, FinishReason, ToolCall


def new_id(kind: Kind) -> str:
    return ("chatcmpl-" if kind == "chat" else "cmpl-") + secrets.token_hex(12)


def finish_reason(reason: FinishReason, calls: bool = False) -> str:
    """The engine's reasons in OpenAI's words: an EOS token and a stop string are both "stop",
    or "tool_calls" when the answer made calls (an answer cut by the limit stays "length")."""
    if reason == "length":
        return "length"
    return "tool_calls" if calls else "stop"


def usage(completions: list[Completion]) -> dict[str, Any]:
    """OpenAI's usage object for the choices of one request (the prompt counted once), with
    SpecChat's own figures in `specchat`: target passes, tokens per pass, the tree budget
    (0 = plain decoding), time to first token and speed."""
    stats = [c.stats for c in completions]
    prompt = stats[0].prompt_tokens if stats else 0
    new = sum(s.new_tokens for s in stats)
    passes = sum(s.target_passes for s in stats)
    seconds = sum(s.seconds for s in stats)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": new,
        "total_tokens": prompt + new,
        "prompt_tokens_details": {"cached_tokens": stats[0].cached_tokens if stats else 0},
        "specchat": {
            "target_passes": passes,
            "tokens_per_pass": round(new / passes, 3) if passes else 0.0,
            "budget": stats[-1].budget if stats else 0,
            "mode": stats[-1].mode if stats else "autoregressive",
            "ttft_seconds": round(stats[0].ttft_seconds, 4) if stats else 0.0,
            "seconds": round(seconds, 4),
            "tokens_per_second": round(new / seconds, 2) if seconds > 0 else 0.0,
        },
    }


def response(kind: Kind, rid: str, model: str, created: int, completions: list[Completion],
             output: OutputSettings | None = None, logprobs: bool = False) -> dict[str, Any]:
    """The whole answer of a request that did not stream; `output` splits each chat answer
    into content, reasoning and tool calls; `logprobs`: the request asked for them."""
    if kind == "chat":
        choices = []
        for i, c in enumerate(completions):
            parsed = output.parse(c.text) if output is not None else ParsedOutput(c.text, None, ())
            choices.append({"index": i, "message": message(parsed), "logprobs": shaped(kind, c.logprobs) if logprobs
                            else None, "finish_reason": finish_reason(c.finish_reason, bool(parsed.calls))})
        obj = "chat.completion"
    else:
        choices = [{"index": i, "text": c.text, "logprobs": shaped(kind, c.logprobs) if logprobs else None,
                    "finish_reason": finish_reason(c.finish_reason)} for i, c in enumerate(completions)]
        obj = "text_completion"
    return {"id": rid, "object": obj, "created": created, "model": model, "system_fingerprint": None,
            "choices": choices, "usage": usage(completions)}


def message(parsed: ParsedOutput) -> dict[str, Any]:
    """A chat answer's message: content null only beside calls; reasoning and calls when there are any."""
    content = parsed.content if parsed.content is not None or parsed.calls else ""
    out: dict[str, Any] = {"role": "assistant", "content": content, "refusal": None}
    if parsed.reasoning is not None:
        out["reasoning_content"] = parsed.reasoning
    if parsed.calls:
        out["tool_calls"] = [tool_call(c) for c in parsed.calls]
    return out


def tool_call(call: ToolCall) -> dict[str, Any]:
    return {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}


@dataclass
class ChunkWriter:
    """The stream chunks of one request, in order: a chat choice opens with the assistant role,
    every text delta is one chunk, a choice closes with its finish reason; with include_usage,
    every chunk carries "usage": null and a last chunk with no choices carries the usage."""

    kind: Kind
    rid: str
    model: str
    include_usage: bool = False
    created: int = field(default_factory=lambda: int(time.time()))

    def _chunk(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        chunk: dict[str, Any] = {"id": self.rid, "object": "chat.completion.chunk" if self.kind == "chat"
                                 else "text_completion", "created": self.created, "model": self.model,
                                 "system_fingerprint": None, "choices": choices}
        if self.include_usage:
            chunk["usage"] = None
        return chunk

    def _choice(self, index: int, text: str | None, role: bool = False, finish: str | None = None) -> dict[str, Any]:
        if self.kind == "chat":
            delta: dict[str, Any] = {}
            if role:
                delta["role"] = "assistant"
            if text is not None:
                delta["content"] = text
            return {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish}
        return {"index": index, "text": text or "", "logprobs": None, "finish_reason": finish}

    def opened(self, index: int) -> dict[str, Any] | None:
        """A chat choice's first chunk (role, empty content); completions have none."""
        return self._chunk([self._choice(index, "", role=True)]) if self.kind == "chat" else None

    def text(self, index: int, text: str) -> dict[str, Any]:
        return self._chunk([self._choice(index, text)])

    def parsed(self, index: int, delta: OutputDelta) -> list[dict[str, Any]]:
        """A chat answer's split delta as chunks: reasoning, content, then each call as two
        (its index, id, type and name with empty arguments; then the arguments), the shape
        OpenAI's clients put back together."""
        deltas: list[dict[str, Any]] = []
        if delta.reasoning:
            deltas.append({"reasoning_content": delta.reasoning})
        if delta.content:
            deltas.append({"content": delta.content})
        for at, call in enumerate(delta.calls, delta.call_index):
            deltas.append({"tool_calls": [{"index": at, "id": call.id, "type": "function",
                                           "function": {"name": call.name, "arguments": ""}}]})
            deltas.append({"tool_calls": [{"index": at, "function": {"arguments": call.arguments}}]})
        return [self._chunk([{"index": index, "delta": d, "logprobs": None, "finish_reason": None}]) for d in deltas]

    def finished(self, index: int, completion: Completion, calls: bool = False) -> dict[str, Any]:
        return self._chunk([self._choice(index, None if self.kind == "chat" else "",
                                         finish=finish_reason(completion.finish_reason, calls))])

    def usage(self, completions: list[Completion]) -> dict[str, Any]:
        chunk = self._chunk([])
        chunk["usage"] = usage(completions)
        return chunk


def model_card(model_id: str, created: int, context_length: int = 0) -> dict[str, Any]:
    """One entry of GET /v1/models (max_model_len as vLLM names it, when known)."""
    card: dict[str, Any] = {"id": model_id, "object": "model", "created": created, "owned_by": "specchat"}
    if context_length:
        card["max_model_len"] = context_length
    return card

