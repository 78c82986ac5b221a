"""The answer the chat page is writing, and what a stored answer says about how it ended (the
chat page's bookkeeping, apart from its widgets)."""

from __future__ import annotations

import json
from dataclasses import dataclass

from .conversations import StoredMessage


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
