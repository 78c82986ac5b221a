"""`specchat generate`: one prompt -> one or more completions, streamed as text or printed as
one JSON object per sample (the CLI contract in parser.py and the README).

Every refusal of what the options asked for is a UsageError (exit 2), also those only the
loaded model can tell: more messages than its context has tokens, a prompt longer than its
context. What the model itself refuses (its chat template) and a request that does not fit in
memory (OutOfMemory) stay runtime failures (exit 1)."""

from __future__ import annotations

import argparse
import logging
import secrets
import sys
import uuid

from engine.cli import common
from engine.cli.streaming import dim, status_printer, stream, writer
from engine.cli.main import EXIT_INTERRUPTED
from engine.errors import ContextTooLong, UsageError
from engine.types import Message

log = logging.getLogger(__name__)


def run_generate(args: argparse.Namespace) -> int:
    if args.target is None:
        raise UsageError("generate needs --target MODEL (a catalog id, a model folder or a .gguf file).")
    setup = common.setup(args)
    messages: tuple[Message, ...] = ()
    if args.prompt is not None:
        system = (Message("system", args.system),) if args.system else ()
        messages = system + (Message("user", args.prompt),)
    elif args.messages is not None:
        messages = common.read_messages(args.messages)
    # Sample i uses seed base+i, so any one sample can be re-run alone with --seed base+i.
    base_seed = args.seed if args.seed is not None else secrets.randbelow(2**31)
    sampled = args.temperature > 0
    engine = common.load(args.target, args.draft, args, setup, log.info)
    draft = common.draft_choice_of(engine)
    if draft is not None:
        log.info("draft: %s (%s)", draft.label, draft.reason)
    common.check_messages_fit(messages, engine.context_length)
    backend = common.planned(engine, log.info, None if args.json else status_printer())
    common.note_limits(engine, args, status_printer())
    out = writer(sys.stdout)
    session = f"generate-{uuid.uuid4().hex}"  # the samples share the prompt's KV cache
    for i in range(args.samples):
        seed = base_seed + i
        log.info("sample %d: seed %d", i, seed)
        request = common.request(args, setup, messages, args.raw_prompt, seed, conversation=session)
        try:
            completion, interrupted = stream(backend, request, (lambda _: None) if args.json else out)
        except ContextTooLong as exc:  # the prompt the options gave is longer than the model's context
            raise UsageError(exc.user_message) from exc
        if args.json:
            print(common.completion_json(completion, draft), flush=True)
        else:
            if completion.text and not completion.text.endswith("\n"):
                out("\n")
            line = common.stats_line(completion.stats, completion.finish_reason, seed if sampled else None, draft)
            print(dim(line, sys.stderr), file=sys.stderr, flush=True)
        if interrupted:
            return EXIT_INTERRUPTED
    return 0
