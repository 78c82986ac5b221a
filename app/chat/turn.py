"""The answer the chat page is writing, and what a stored answer says about how it ended (the
chat page's bookkeeping, apart from its widgets)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass

from app.state.conversations import StoredMessage
from app.state.preferences import Preferences
from engine.types import GenerationRequest, Message


@dataclass
class Answer:
    """The answer being written: whose it is and what it holds so far."""

    request_id: int
    conversation_id: int
    message_id: int
    text: str = ""
    tokens: int = 0
    started: float = 0.0
    first_token: bool = False


def answer_request(prefs: Preferences, plan: object | None, system: str, messages: Sequence[StoredMessage],
                   conversation_id: int, continue_final: bool = False) -> GenerationRequest:
    """The request for the next answer of a conversation: its system prompt and `messages`, with
    the settings (and the planner's `plan` for budget "auto"). `continue_final`: write on from
    the last answer."""
    history = [Message("system", system.strip())] if system.strip() else []
    history += [Message(m.role, m.content) for m in messages]  # type: ignore[arg-type]
    return GenerationRequest(
        messages=tuple(history),
        max_new_tokens=prefs.max_new_tokens,
        sampling=prefs.sampling(),
        speculation=prefs.speculation_for(plan),
        continue_final=continue_final,
        conversation=f"conversation-{conversation_id}",  # its KV cache continues turn to turn
    )


def length_note(tokens: int) -> str:
    """The note on an answer the token limit cut (`tokens`: what its last run wrote)."""
    return f"cut at the token limit ({tokens:,} new tokens) · Continue writes on"


def message_meta(m: StoredMessage) -> dict:
    """A stored message's stats (finish reason, new tokens, …); {} when absent or damaged (the
    database is read as data only)."""
    try:
        meta = json.loads(m.stats) if m.stats else {}
    except ValueError:
        return {}
    return meta if isinstance(meta, dict) else {}
