"""Text helpers of the output parser (formats.py): finding markers in streamed text, how much of
a stream's end could still become one (held back), and JSON read from untrusted model output."""

from __future__ import annotations

import json


def find_marker(text: str, markers: tuple[str, ...] | list[str], start: int = 0) -> tuple[int, str] | None:
    """The first marker in `text` (from `start`), as (position, marker); the longest at a tie."""
    best: tuple[int, str] | None = None
    for marker in markers:
        at = text.find(marker, start)
        if at >= 0 and (best is None or at < best[0] or (at == best[0] and len(marker) > len(best[1]))):
            best = (at, marker)
    return best


def marker_prefix(text: str, markers: tuple[str, ...] | list[str]) -> int:
    """How many of `text`'s last characters could be the start of a marker (held back)."""
    hold = 0
    for marker in markers:
        for k in range(min(len(marker) - 1, len(text)), hold, -1):
            if text.endswith(marker[:k]):
                hold = k
                break
    return hold


def json_value(text: str) -> object:
    """The JSON value `text` holds, or None. The model's output is untrusted too: a value nested
    past Python's recursion limit or a number too long to convert is no value."""
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return None


def json_values(text: str, separator: str) -> list[object] | None:
    """Several JSON values one after another, separated by whitespace and `separator`, or None."""
    decoder = json.JSONDecoder()
    values: list[object] = []
    at, text = 0, text.strip()
    try:
        while at < len(text):
            value, at = decoder.raw_decode(text, at)
            values.append(value)
            while at < len(text) and (text[at].isspace() or text[at] == separator):
                at += 1
    except (ValueError, RecursionError):
        return None
    return values
