"""`specchat generate`: one prompt -> one or more completions, streamed as text or printed as
one JSON object per sample (the CLI contract in parser.py and the README)."""

from __future__ import annotations

import argparse
import logging
import secrets
import sys
import uuid

from engine.cli import common
from engine.cli.main import EXIT_INTERRUPTED
from engine.types import Message

log = logging.getLogger(__name__)


def run_generate(args: argparse.Namespace) -> int:
    if args.target is None:
        raise common.UsageError("generate needs --target MODEL (a catalog id, a model folder or a .gguf file).")
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
    setup = common.plan(engine, setup, log.info, None if args.json else common.status_printer())
    common.note_limits(engine, args, common.status_printer())
    out = common.writer(sys.stdout)
    session = f"generate-{uuid.uuid4().hex}"  # the samples share the prompt's KV cache
    for i in range(args.samples):
        seed = base_seed + i
        log.info("sample %d: seed %d", i, seed)
        request = common.request(args, setup, messages, args.raw_prompt, seed, conversation=session)
        completion, interrupted = common.stream(engine, request, (lambda _: None) if args.json else out)
        if args.json:
            print(common.completion_json(completion), flush=True)
        else:
            if completion.text and not completion.text.endswith("\n"):
                out("\n")
            line = common.stats_line(completion.stats, completion.finish_reason, seed if sampled else None)
            print(common.dim(line, sys.stderr), file=sys.stderr, flush=True)
        if interrupted:
            return EXIT_INTERRUPTED
    return 0
