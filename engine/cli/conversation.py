"""The terminal conversation loop of `specchat chat`, local or `--remote`: one loop over any
backend (engine.cli.streaming.Backend).

Lines typed (or piped) in are user messages; /reset clears the conversation, /exit or Ctrl+D
quits, Ctrl+C stops an answer and keeps what came. A turn that fails prints one `error:` line
and the conversation goes on: a partial answer (a server that went away mid-answer) stays in
the history as shown, a turn with no answer leaves the question out of it. What differs between
a local and a remote chat comes in as `Turns`: how a request is built from the history (the local
one leaves out the oldest exchanges when the context is full) and how an answer is summed up.

Imports no torch: `chat --remote` starts at once.
"""

from __future__ import annotations

import sys
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import TextIO

from engine.cli.streaming import Backend, dim, stream
from engine.cli.typed_input import typed_lines
from engine.errors import EngineError
from engine.types import Completion, GenerationRequest, Message


@dataclass(frozen=True)
class Turns:
    """How one kind of chat builds a request and reports an answer.

    request(history, seed, session) -> (request, how many of the oldest history messages it
        left out from now on); raises an EngineError for a turn that cannot be asked.
    summary(completion) -> the stats line for stderr.
    """

    request: Callable[[list[Message], int | None, str], tuple[GenerationRequest, int]]
    summary: Callable[[Completion], str]
    help: str


def converse(backend: Backend, turns: Turns, status: Callable[[str], None], seed: int | None = None,
             interactive: bool | None = None, out: TextIO | None = None) -> int:
    """Chat until /exit, Ctrl+D or the end of the input; returns the exit code (0)."""
    interactive = sys.stdin.isatty() if interactive is None else interactive
    out = out or sys.stdout
    messages: list[Message] = []
    session = new_session()  # a local engine's KV cache continues from turn to turn within it
    for text in typed_lines(interactive):
        if text == "/reset":
            messages.clear()
            session = new_session()
            status("conversation cleared")
            continue
        if text.startswith("/") and " " not in text:
            status(f"unknown command {text}. {turns.help}")
            continue
        messages.append(Message("user", text))
        shown: list[str] = []

        def show(delta: str) -> None:
            shown.append(delta)
            out.write(delta)
            out.flush()

        try:
            request, dropped = turns.request(messages, seed, session)
            del messages[:dropped]
            if dropped:
                status(f"the conversation outgrew the model's context: the {dropped} oldest messages are left out "
                       "from now on; /reset starts afresh")
            completion, _ = stream(backend, request, show)
        except EngineError as exc:  # this turn failed; the conversation goes on
            if shown:  # what came stays, as shown
                out.write("\n")
                messages.append(Message("assistant", "".join(shown)))
            else:
                messages.pop()
            print(f"error: {exc.user_message}", file=sys.stderr, flush=True)
            continue
        if seed is not None:  # a fixed --seed makes the whole conversation reproducible, not every turn alike
            seed = (seed + 1) % 2**64
        out.write("\n")
        out.flush()
        messages.append(Message("assistant", completion.text))  # a stopped answer stays, as shown
        print(dim(turns.summary(completion), sys.stderr), file=sys.stderr, flush=True)
    if interactive:
        print(file=sys.stderr)
    return 0


def new_session() -> str:
    return f"chat-{uuid.uuid4().hex}"
