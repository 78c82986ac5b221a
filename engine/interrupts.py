"""Ctrl+C noted as well as raised.

Python turns SIGINT into a KeyboardInterrupt wherever the main thread is. During start-up that
is usually inside an import, and a library whose import catches everything (a bare `except:`
around an optional probe) swallows it: the command would then run on and exit 0 as if nobody
had pressed Ctrl+C. `watch()`, called first thing by the entry points, raises it just the same
and also notes it, so `seen()` tells the command line after its imports that it must stop.
"""

from __future__ import annotations

import signal
from types import FrameType

_seen = False


def _on_sigint(signum: int, frame: FrameType | None) -> None:
    global _seen
    _seen = True
    raise KeyboardInterrupt


def watch() -> None:
    try:
        signal.signal(signal.SIGINT, _on_sigint)
    except ValueError:  # not the main thread (an embedding): keep Python's handler
        pass


def seen() -> bool:
    return _seen


def caused_by_ctrl_c(exc: BaseException) -> bool:
    """Whether `exc` is Ctrl+C's KeyboardInterrupt or an error raised from one: Python wraps an
    exception raised inside some hooks (a class body's `__set_name__`, as dataclasses' fields
    run while a module imports) in a RuntimeError, so a Ctrl+C landing there surfaces as that."""
    chain: set[int] = set()
    at: BaseException | None = exc
    while at is not None and id(at) not in chain:
        if isinstance(at, KeyboardInterrupt):
            return True
        chain.add(id(at))
        at = at.__cause__ or at.__context__
    return False
