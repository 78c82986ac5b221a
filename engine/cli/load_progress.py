"""A model load's progress on stderr as one line, not one line per decoder layer.

On a terminal each message overwrites the last in place (carriage return, erase to the end of
the line, cut to the terminal's width so it never wraps); the line ends when the load is ready
or stops. Anywhere else (a pipe, a log file, CI) a message is printed when a new stage starts
or the load has moved on by another fifth since the last printed one, and the last message is
printed at the end if it was skipped: a 30-layer load says about six lines, not thirty.

What this does not do: the download bar (engine.cli.models.TerminalProgress) or the stats line.
"""

from __future__ import annotations

import os
import shutil
import threading
from typing import TextIO

from engine.types import LoadProgress

STEP = 0.2  # off a terminal: a line per this much of the load (plus each stage's first and the last)


class LoadProgressLine:
    """Callable with each LoadProgress (from any thread); `finish()` ends the line."""

    def __init__(self, out: TextIO, prefix: str = "specchat: ") -> None:
        self.out = out
        self.prefix = prefix
        self.tty = _isatty(out)
        self._lock = threading.Lock()
        self._open = False  # a terminal line written and not yet ended
        self._stage: str | None = None
        self._printed_at = -1.0  # fraction of the last message printed off a terminal
        self._skipped: str | None = None  # the last message not printed off a terminal

    def __call__(self, progress: LoadProgress) -> None:
        with self._lock:
            if progress.stage == "ready":
                self._end()
                return
            if self.tty:
                self._overwrite(progress.message)
                return
            new_stage = progress.stage != self._stage
            self._stage = progress.stage
            if new_stage or progress.fraction >= self._printed_at + STEP:
                self._line(progress.message)
                self._printed_at = progress.fraction
                self._skipped = None
            else:
                self._skipped = progress.message

    def finish(self) -> None:
        """End the line (a terminal) or print the last skipped message (elsewhere)."""
        with self._lock:
            self._end()

    def _end(self) -> None:
        if self._open:
            self._write("\n")
            self._open = False
        elif self._skipped is not None:
            self._line(self._skipped)
        self._skipped = None

    def _overwrite(self, message: str) -> None:
        width = shutil.get_terminal_size(fallback=(80, 24)).columns
        text = f"{self.prefix}{message}"[: max(1, width - 1)]
        dim = not os.environ.get("NO_COLOR")
        self._write(f"\r\x1b[K{_dim(text) if dim else text}")
        self._open = True

    def _line(self, message: str) -> None:
        self._write(f"{self.prefix}{message}\n")

    def _write(self, text: str) -> None:
        try:
            self.out.write(text)
            self.out.flush()
        except (OSError, ValueError):  # stderr gone: progress is not worth failing a load for
            pass


def _dim(text: str) -> str:
    return f"\x1b[2m{text}\x1b[0m"


def _isatty(out: TextIO) -> bool:
    try:
        return out.isatty()
    except (AttributeError, ValueError):
        return False
