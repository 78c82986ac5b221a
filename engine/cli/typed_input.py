"""What the user types at `specchat chat`'s prompt, shared by the local and the remote chat
(torch-free: `chat --remote` never loads the engine)."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from typing import TextIO


def read_line(stdin: TextIO, prompt: str) -> str | None:
    """One line of input, None at end of input (EOF / Ctrl+D)."""
    if prompt:
        try:
            return input(prompt)
        except EOFError:
            return None
    line = stdin.readline()
    return line if line else None


def typed_lines(interactive: bool) -> Iterator[str]:
    """The non-empty lines typed at the prompt, stripped, until end of input or /exit, /quit.
    Ctrl+C at the prompt gives a fresh prompt, as in Python's REPL."""
    while True:
        try:
            line = read_line(sys.stdin, "> " if interactive else "")
        except KeyboardInterrupt:
            print(file=sys.stderr)
            continue
        if line is None:
            return
        text = line.strip()
        if text in ("/exit", "/quit"):
            return
        if text:
            yield text
