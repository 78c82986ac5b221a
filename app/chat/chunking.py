"""Markdown text cut into pieces that render on their own, built incrementally as an answer streams.

The chat shows a message as a column of pieces (one text browser each). While an answer streams
only the last, open piece is re-rendered, so the work per update is bounded by the size of a
piece, never by the length of the answer. `Chunker.feed(delta)` looks at the new text only.

Where a piece ends:
- at a blank line outside a code fence once the open piece holds `soft` characters: a cut
  between Markdown blocks, so the pieces render exactly as the whole text would;
- at a line end once it holds `hard` characters, even inside a code block, a list or a paragraph
  without blank lines (a long code block, or a small model repeating itself). Inside a fence the
  piece is closed with the fence and the next piece re-opens it (`Piece.reopen` / `Piece.close`);
  the renderer draws the two halves as one block (no header and no margin at the seam);
- inside a line longer than `line` characters, at its last space (a model that writes no newline).

`"".join(p.text for p in pieces) == text` always holds; `Piece.markdown()` is what to render.
Nothing here imports Qt.
"""

from __future__ import annotations

from dataclasses import dataclass

SOFT_LIMIT = 1200
HARD_LIMIT = 3000
LINE_LIMIT = 4000


@dataclass(frozen=True)
class Piece:
    """A piece of a message. `reopen`: the fence line this piece continues inside ("" if it
    starts outside a fence); `close`: the fence that ends the block this piece was cut inside."""

    text: str
    reopen: str = ""
    close: str = ""

    def markdown(self) -> str:
        """The source to render on its own: the text with its fence re-opened and closed."""
        body = self.reopen + self.text
        if self.close:
            body += ("" if body.endswith("\n") else "\n") + self.close + "\n"
        return body


def _fence_marker(line: str) -> str:
    """"```" or "~~~~" when `line` is a fence line (at most 3 spaces of indent), else ""."""
    stripped = line.lstrip(" ")
    if len(line) - len(stripped) > 3 or not stripped.startswith(("```", "~~~")):
        return ""
    return stripped[: len(stripped) - len(stripped.lstrip(stripped[0]))]


class Chunker:
    """Cuts a growing text into `Piece`s (see the module docstring)."""

    def __init__(self, soft: int = SOFT_LIMIT, hard: int = HARD_LIMIT, line: int = LINE_LIMIT) -> None:
        self.soft, self.hard, self.line = soft, hard, line
        self.closed: list[Piece] = []
        self._lines: list[str] = []  # complete lines of the open piece
        self._size = 0  # characters in _lines
        self._partial = ""  # the incomplete last line
        self._reopen = ""  # the fence line the open piece continues inside
        self._fence = ""  # marker of the fence open at the end of _lines ("" outside)
        self._fence_line = ""

    @property
    def tail(self) -> Piece:
        """The open piece (its text may be empty)."""
        return Piece("".join(self._lines) + self._partial, self._reopen)

    def pieces(self) -> list[Piece]:
        """Every piece: the closed ones, then the open one if it holds any text."""
        tail = self.tail
        return self.closed + ([tail] if tail.text or not self.closed else [])

    def feed(self, text: str) -> int:
        """Add `text`; returns how many pieces it closed."""
        before = len(self.closed)
        self._partial += text
        while True:
            end = self._partial.find("\n", 0, self.line + 1)
            if end >= 0:
                line, self._partial = self._partial[: end + 1], self._partial[end + 1 :]
                self._add_line(line)
            elif len(self._partial) > self.line:  # a line too long to wait for: cut at a space
                cut = self._partial.rfind(" ", self.line // 2, self.line) + 1 or self.line
                line, self._partial = self._partial[:cut], self._partial[cut:]
                self._lines.append(line)
                self._size += len(line)
                self._cut()
            else:
                break
        return len(self.closed) - before

    def _add_line(self, line: str) -> None:
        marker = _fence_marker(line)
        opened = False
        if marker and not self._fence:
            self._fence, self._fence_line, opened = marker, line if line.endswith("\n") else line + "\n", True
        elif marker and marker[0] == self._fence[0] and len(marker) >= len(self._fence) and not line.strip(" \n\t" + marker[0]):
            self._fence = self._fence_line = ""
        self._lines.append(line)
        self._size += len(line)
        if not self._fence and not line.strip() and self._size >= self.soft:
            self._cut()
        elif self._size >= self.hard and not opened:  # never right after an opening fence line
            self._cut()

    def _cut(self) -> None:
        """Close the open piece here; inside a fence the next piece re-opens it."""
        close = self._fence[0] * len(self._fence) if self._fence else ""
        self.closed.append(Piece("".join(self._lines), self._reopen, close))
        self._lines, self._size = [], 0
        self._reopen = self._fence_line if self._fence else ""


def split_chunks(text: str, soft: int = SOFT_LIMIT, hard: int = HARD_LIMIT, line: int = LINE_LIMIT) -> list[Piece]:
    """`text` cut at once, the same pieces as feeding it in any number of parts."""
    chunker = Chunker(soft, hard, line)
    chunker.feed(text)
    return chunker.pieces()
