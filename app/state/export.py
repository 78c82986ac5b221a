"""A conversation written out for the user: Markdown to read, JSON to process. A thinking
model's reasoning is left out unless asked for (`reasoning=True`); asked, it comes as a quote
headed "Thinking (12 s)" above its answer in Markdown, and as `reasoning` and
`reasoning_seconds` on its message in JSON. Qt-free, like the store it reads."""

from __future__ import annotations

import json
from typing import Any

from app.state.conversations import ConversationStore


def export_json(store: ConversationStore, conversation_id: int, reasoning: bool = False) -> dict[str, Any]:
    """The conversation as JSON-able data (KeyError when there is none)."""
    conv = store.get(conversation_id)
    if conv is None:
        raise KeyError(conversation_id)
    return {
        "title": conv.title,
        "system_prompt": conv.system_prompt,
        "created": conv.created,
        "messages": [
            {"role": m.role, "content": m.content, "created": m.created, "complete": m.complete,
             **({"stats": json.loads(m.stats)} if m.stats else {}),
             **({"reasoning": m.reasoning, "reasoning_seconds": m.reasoning_seconds} if reasoning and m.reasoning
                else {})}
            for m in store.messages(conversation_id)
        ],
    }


def export_markdown(store: ConversationStore, conversation_id: int, reasoning: bool = False) -> str:
    """The conversation as Markdown (KeyError when there is none)."""
    conv = store.get(conversation_id)
    if conv is None:
        raise KeyError(conversation_id)
    parts = [f"# {conv.title}\n"]
    if conv.system_prompt:
        parts.append(f"*System prompt:* {conv.system_prompt}\n")
    for m in store.messages(conversation_id):
        who = "You" if m.role == "user" else "Assistant"
        note = "" if m.complete else " *(stopped)*"
        thought = ""
        if reasoning and m.reasoning.strip():
            quoted = "\n".join(f"> {line}".rstrip() for line in m.reasoning.strip().splitlines())
            thought = f"> **{thinking_title(m.reasoning_seconds)}**\n>\n{quoted}\n\n"
        parts.append(f"## {who}{note}\n\n{thought}{m.content.rstrip()}\n")
    return "\n".join(parts)


def thinking_title(seconds: float | None) -> str:
    """The heading of a model's reasoning: "Thinking (12 s)", "Thinking (2 min 5 s)";
    "Thinking…" while it goes on (None)."""
    if seconds is None:
        return "Thinking…"
    if seconds < 1:
        return "Thinking (<1 s)"
    whole = round(seconds)
    if whole < 60:
        return f"Thinking ({whole} s)"
    return f"Thinking ({whole // 60} min {whole % 60} s)"
