"""Gemma 4's native tool-call syntax, read into a call (formats.py finds the blocks).

Gemma 4 writes a call as `<|tool_call>call:NAME{key:value,...}<tool_call|>`: keys bare, every
string between two `<|"|>` tokens (so a string may hold quotes, braces and commas as they are),
numbers, true / false / null, objects in braces and lists in brackets, as its chat template
renders tool declarations and results. `gemma_call(body)` reads the text between the two
markers into (name, arguments as a dict), or None when it is not one well-formed call.

The model's output is untrusted: the reader is iterative (no recursion to exhaust), refuses
nesting deeper than MAX_DEPTH, numbers longer than MAX_NUMBER characters or beyond a double's
range, and any text after the call's closing brace.
"""

from __future__ import annotations

import json
import math
import re

QUOTE = '<|"|>'  # Gemma 4's string delimiter (one token)
MAX_DEPTH = 64
MAX_NUMBER = 100  # characters of one number
_KEY = re.compile(r"\s*([A-Za-z_][A-Za-z0-9_.-]*)\s*:")
_NUMBER = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?")
_CALL = re.compile(r"\s*call:([A-Za-z0-9_-]{1,64})\s*(?=\{)")


class _Bad(Exception):
    """Not Gemma's syntax."""


def gemma_call(body: str) -> tuple[str, dict[str, object]] | None:
    """`call:NAME{...}` -> (NAME, arguments), or None."""
    head = _CALL.match(body)
    if head is None:
        return None
    try:
        value, end = _read(body, head.end())
    except _Bad:
        return None
    if body[end:].strip() or not isinstance(value, dict):
        return None
    return head.group(1), value


def _read(text: str, at: int) -> tuple[object, int]:
    """The value starting at `at` (whitespace first), and where it ends. Containers are built
    on an explicit stack: (container, key waiting for its value)."""
    stack: list[tuple[dict[str, object] | list[object], str | None]] = []
    while True:
        at = _skip(text, at)
        if stack and isinstance(stack[-1][0], dict) and stack[-1][1] is None:
            # an object waits for a key or its end
            if text.startswith("}", at):
                value: object = stack.pop()[0]
                at += 1
            else:
                key, at = _key(text, at)
                stack[-1] = (stack[-1][0], key)
                continue
        elif stack and isinstance(stack[-1][0], list) and text.startswith("]", at):
            value = stack.pop()[0]
            at += 1
        elif text.startswith("{", at) or text.startswith("[", at):
            if len(stack) >= MAX_DEPTH:
                raise _Bad
            stack.append(({} if text[at] == "{" else [], None))
            at += 1
            continue
        else:
            value, at = _scalar(text, at)
        # a value is done: it goes into its container, or it is the whole
        while True:
            if not stack:
                return value, at
            container, waiting = stack[-1]
            if isinstance(container, dict):
                assert waiting is not None
                container[waiting] = value
                stack[-1] = (container, None)
            else:
                container.append(value)
            at = _skip(text, at)
            if text.startswith(",", at):
                at += 1
                break  # the next key or item
            close = "}" if isinstance(container, dict) else "]"
            if not text.startswith(close, at):
                raise _Bad
            value = stack.pop()[0]
            at += 1


def _skip(text: str, at: int) -> int:
    while at < len(text) and text[at].isspace():
        at += 1
    return at


def _key(text: str, at: int) -> tuple[str, int]:
    if text.startswith(QUOTE, at):  # a quoted key
        end = text.find(QUOTE, at + len(QUOTE))
        if end < 0 or not text.startswith(":", _skip(text, end + len(QUOTE))):
            raise _Bad
        return text[at + len(QUOTE):end], _skip(text, end + len(QUOTE)) + 1
    found = _KEY.match(text, at)
    if found is None:
        raise _Bad
    return found.group(1), found.end()


def _scalar(text: str, at: int) -> tuple[object, int]:
    if text.startswith(QUOTE, at):
        end = text.find(QUOTE, at + len(QUOTE))
        if end < 0:
            raise _Bad
        return text[at + len(QUOTE):end], end + len(QUOTE)
    for word, value in (("true", True), ("false", False), ("null", None)):
        if text.startswith(word, at):
            return value, at + len(word)
    found = _NUMBER.match(text, at)
    if found is None:
        raise _Bad
    number = json.loads(found.group(0)) if len(found.group(0)) <= MAX_NUMBER else None
    if number is None or not math.isfinite(number):  # no JSON number (a 10,000-digit one, 1e999)
        raise _Bad
    return number, found.end()
