"""`logprobs` in OpenAI's wire format: the request fields, and the engine's TokenLogprobs as the
response objects and stream chunks carry them.

Requests. Chats: `logprobs` true / false and `top_logprobs` 0..20 (which needs `logprobs`
true, as OpenAI's API says). Completions (the legacy endpoint): `logprobs` a whole number
0..20, the alternatives per token (OpenAI allows up to 5; vLLM, like this server, 20).
Anything else is a LogprobsError naming the field, which the protocol answers with a 400.

Responses. Chats: `choices[i].logprobs = {"content": [{token, logprob, bytes, top_logprobs:
[{token, logprob, bytes}]}], "refusal": null}`, one entry per answer token (its reasoning and
tool-call tokens included, as the tokens are what the model wrote); completions: `{tokens,
token_logprobs, top_logprobs: [{token: logprob}], text_offset}`. A stream carries each token's
entry in the chunk that carries its text (or, when the text was held back, in the next chunk
sent), so the entries of all chunks, in order, are the whole answer's. The values are the
target's (engine.decoding.logprobs says which distribution). A log-probability too small for
a float is sent as -9999.0, as OpenAI does (JSON has no -Infinity).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from engine.types import MAX_TOP_LOGPROBS, TokenAlternative, TokenLogprob

FLOOR = -9999.0  # OpenAI's stand-in for a log-probability of -infinity


class LogprobsError(Exception):
    """A logprobs field is not what the API allows: `message` for the 400, `param` the field."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


def parse_logprobs(kind: Literal["chat", "completion"], body: Mapping[str, Any]) -> int | None:
    """The alternatives a token asks for (GenerationRequest.logprobs), None when off."""
    raw = body.get("logprobs")
    if kind == "completion":
        if raw is None:
            return None
        if not _whole(raw) or not 0 <= raw <= MAX_TOP_LOGPROBS:
            raise LogprobsError(f"'logprobs' must be a whole number from 0 to {MAX_TOP_LOGPROBS} (the alternatives "
                                f"per token) or null (got {_shown(raw)}).", "logprobs")
        return int(raw)
    if raw is not None and not isinstance(raw, bool):
        raise LogprobsError(f"'logprobs' must be true or false (got {_shown(raw)}); 'top_logprobs' sets how many "
                            "alternatives each token comes with.", "logprobs")
    top = body.get("top_logprobs")
    if top is not None and (not _whole(top) or not 0 <= top <= MAX_TOP_LOGPROBS):
        raise LogprobsError(f"'top_logprobs' must be a whole number from 0 to {MAX_TOP_LOGPROBS} (got {_shown(top)}).",
                            "top_logprobs")
    if not raw:
        if top:
            raise LogprobsError("'top_logprobs' needs 'logprobs': true.", "top_logprobs")
        return None
    return int(top or 0)


def _whole(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _shown(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:40] + "…"


def _logprob(value: float) -> float:
    return value if math.isfinite(value) else FLOOR


def _alternative(alt: TokenAlternative) -> dict[str, Any]:
    return {"token": alt.text, "logprob": _logprob(alt.logprob), "bytes": list(alt.data)}


def chat_logprobs(entries: Sequence[TokenLogprob]) -> dict[str, Any]:
    """A chat choice's (or chunk's) `logprobs` object."""
    return {"content": [{**_alternative(e.token), "top_logprobs": [_alternative(a) for a in e.top]}
                        for e in entries], "refusal": None}


def completion_logprobs(entries: Sequence[TokenLogprob], offset: int = 0) -> dict[str, Any]:
    """A completion choice's (or chunk's) `logprobs` object; `offset`: the text before its first token."""
    offsets = []
    for e in entries:
        offsets.append(offset)
        offset += len(e.token.text)
    return {"tokens": [e.token.text for e in entries], "token_logprobs": [_logprob(e.token.logprob) for e in entries],
            "top_logprobs": [{a.text: _logprob(a.logprob) for a in e.top} for e in entries],
            "text_offset": offsets}


def shaped(kind: Literal["chat", "completion"], entries: Sequence[TokenLogprob]) -> dict[str, Any]:
    return chat_logprobs(entries) if kind == "chat" else completion_logprobs(entries)


@dataclass
class LogprobStream:
    """One streamed choice's entries on their way into chunks: `add` an event's (or the
    completion's last) entries, `attach` hands all not yet sent to the first of some chunks."""

    kind: Literal["chat", "completion"]
    pending: list[TokenLogprob] = field(default_factory=list)
    sent: int = 0  # entries attached so far
    offset: int = 0  # characters of token text before the next entry (completions' text_offset)

    def add(self, entries: Sequence[TokenLogprob]) -> None:
        self.pending.extend(entries)

    def rest(self, answer: Sequence[TokenLogprob]) -> None:
        """The completion's entries that no event carried (a step whose text never came)."""
        self.pending.extend(answer[self.sent + len(self.pending):])

    def attach(self, chunks: Sequence[dict[str, Any]]) -> None:
        if not chunks or not self.pending:
            return
        entries, self.pending = self.pending, []
        if self.kind == "chat":
            value = chat_logprobs(entries)
        else:
            value = completion_logprobs(entries, self.offset)
            self.offset += sum(len(e.token.text) for e in entries)
        chunks[0]["choices"][0]["logprobs"] = value
        self.sent += len(entries)
