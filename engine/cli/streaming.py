"""Running one generation from a terminal, for any backend (the local Engine through
AutoBudget, a remote server): the answer streams to stdout while Ctrl+C stays a clean cancel;
and the terminal's small helpers (dim status lines, a flushing writer).

Imports no torch: `chat --remote` uses it and starts at once.
"""

from __future__ import annotations

import os
import queue
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Protocol, TextIO

from engine.cli.main import leave_now
from engine.cli.parser import EXIT_INTERRUPTED
from engine.types import Completion, GenerationRequest, TokenEvent


class Backend(Protocol):
    """What decodes: Engine, AutoBudget, RemoteEngine."""

    def generate(self, request: GenerationRequest,
                 cancel: threading.Event | None = None) -> Iterator[TokenEvent | Completion]: ...


_DONE = object()


def stream(backend: Backend, request: GenerationRequest, on_text: Callable[[str], None]) -> tuple[Completion, bool]:
    """Run one generation in a worker thread, pass each text delta to `on_text`, return the
    Completion and whether Ctrl+C stopped it.

    The worker is what makes Ctrl+C a clean cancel: the main thread receives KeyboardInterrupt
    while it waits on the queue, sets the Event, and keeps reading until the engine's own
    Completion (finish_reason "cancelled", real stats) arrives after the current step. A second
    Ctrl+C stops waiting: the process ends at once with 130.

    However this returns or raises (a closed stdout pipe, an error), the worker has ended: a
    thread still inside PyTorch when the interpreter exits is ended by Python with
    pthread_exit, whose unwinding through PyTorch's C++ frames aborts the whole process
    ("terminate called without an active exception").
    """
    cancel = threading.Event()
    events: queue.Queue[object] = queue.Queue()

    def work() -> None:
        try:
            for event in backend.generate(request, cancel):
                events.put(event)
        except BaseException as exc:  # handed to the main thread, which re-raises it
            events.put(exc)
        finally:
            events.put(_DONE)

    worker = threading.Thread(target=work, name="specchat-generate", daemon=True)
    worker.start()
    completion: Completion | None = None
    interrupted = False
    try:
        while True:
            try:
                try:
                    event = events.get(timeout=0.2)  # a timeout keeps Ctrl+C responsive on every platform
                except queue.Empty:
                    continue
                if event is _DONE:
                    break
                if isinstance(event, BaseException):
                    raise event
                if isinstance(event, TokenEvent):
                    if event.text:
                        on_text(event.text)
                elif isinstance(event, Completion):
                    completion = event
            except KeyboardInterrupt:  # only the main thread gets signals, so this is the user
                if interrupted:
                    leave_now(EXIT_INTERRUPTED)
                interrupted = True
                cancel.set()
    finally:
        cancel.set()  # leaving early: the engine stops after its current step
        join(worker)
    assert completion is not None, "generate() ended without a Completion"
    return completion, interrupted


def join(worker: threading.Thread) -> None:
    """Wait for `worker` to end; a Ctrl+C meanwhile ends the process at once (130)."""
    while worker.is_alive():
        try:
            worker.join(0.2)
        except KeyboardInterrupt:
            leave_now(EXIT_INTERRUPTED)


def dim(text: str, out: TextIO) -> str:
    if out.isatty() and not os.environ.get("NO_COLOR"):
        return f"\x1b[2m{text}\x1b[0m"
    return text


def writer(out: TextIO) -> Callable[[str], None]:
    def write(text: str) -> None:
        out.write(text)
        out.flush()

    return write


def status_printer() -> Callable[[str], None]:
    def status(message: str) -> None:
        print(dim(f"specchat: {message}", sys.stderr), file=sys.stderr, flush=True)

    return status
