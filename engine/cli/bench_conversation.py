"""`specchat bench conversation`: what KV-cache reuse saves on a multi-turn chat.

One process, one loaded pair, the same 8-turn conversation played twice per turn: by an Engine
that keeps its caches between turns and by one that starts every turn from empty caches (the
previous behaviour), alternating so both see the same machine. Per turn: prompt tokens, tokens
reused, target weight passes before the first token (prefill passes plus the first decoding
pass, which reads the prompt's unread tail), and time to first token. Greedy, so both answer
alike (checked: a turn whose answers differ is reported). The default target is the starter
with every layer streamed (--offload all), the case reuse exists for: each pass streams the
weights.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass

import torch

from engine.cli import common
from engine.decoding.generation import Engine
from engine.loading.load import check_pair, load_model, resolve_device
from engine.loading.starter import starter_model
from engine.threads import set_threads
from engine.types import (
    CacheSettings,
    Completion,
    GenerationRequest,
    Message,
    SpeculationSettings,
)

# Long-ish user turns (a pasted paragraph and a question), so the history grows to thousands of
# tokens and reading it again costs passes.
TURNS = (
    "Here are my notes on the French Revolution: it began in 1789 with the Estates-General, the storming of "
    "the Bastille on 14 July, and the Declaration of the Rights of Man. The monarchy fell in 1792. Summarise "
    "them in two sentences.",
    "Now the Industrial Revolution: steam power, textile mills in Lancashire, railways from the 1830s, the growth "
    "of cities like Manchester and Birmingham, child labour and the Factory Acts. What changed most for workers?",
    "Compare the two revolutions: which one changed daily life more for ordinary people, and why? Give three "
    "reasons, each in one sentence.",
    "Write a short paragraph for a school newsletter about why history matters, using one example from each "
    "revolution.",
    "Make the paragraph friendlier for ten-year-olds, and keep it under eighty words.",
    "Suggest a title for the newsletter piece, and two alternatives.",
    "List five questions a teacher could ask the class after reading it.",
    "Finally, give me a one-line summary of our whole conversation.",
)


@dataclass(frozen=True)
class TurnRow:
    turn: int
    prompt_tokens: int
    reused_tokens: int
    passes_before_first_token: int
    passes_before_first_token_fresh: int
    ttft_seconds: float
    ttft_seconds_fresh: float
    same_answer: bool


def _ask(engine: Engine, messages: tuple[Message, ...], args: argparse.Namespace) -> Completion:
    spec = SpeculationSettings(budget=args.budget) if args.draft else SpeculationSettings(mode="autoregressive")
    request = GenerationRequest(messages=messages, max_new_tokens=args.max_new_tokens, speculation=spec,
                                conversation="bench")
    final = list(engine.generate(request))[-1]
    assert isinstance(final, Completion)
    return final


def play(reusing: Engine, fresh: Engine, args: argparse.Namespace) -> list[TurnRow]:
    _ask(fresh, (Message("user", "Hello!"),), args)  # warm-up: allocations, the streamer's ring, kernels
    messages: tuple[Message, ...] = (Message("system", "You are a concise, friendly assistant."),)
    rows = []
    for i, text in enumerate(TURNS[: args.turns], start=1):
        messages += (Message("user", text),)
        if i % 2:  # alternate which goes first, so neither always finds the other's warm caches
            baseline, reused = _ask(fresh, messages, args), _ask(reusing, messages, args)
        else:
            reused, baseline = _ask(reusing, messages, args), _ask(fresh, messages, args)
        rows.append(TurnRow(i, reused.stats.prompt_tokens, reused.stats.cached_tokens,
                            reused.stats.prefill_passes + 1, baseline.stats.prefill_passes + 1,
                            reused.stats.ttft_seconds, baseline.stats.ttft_seconds,
                            reused.token_ids == baseline.token_ids))
        messages += (Message("assistant", reused.text),)
    return rows


def format_table(rows: list[TurnRow]) -> str:
    head = (f"{'turn':>4}{'prompt':>8}{'reused':>8}{'passes to 1st token':>21}{'':>9}"
            f"{'TTFT s':>9}{'':>9}{'same':>6}")
    sub = f"{'':>20}{'reuse':>21}{'fresh':>9}{'reuse':>9}{'fresh':>9}"
    lines = [head, sub, "-" * len(head)]
    for r in rows:
        lines.append(f"{r.turn:>4}{r.prompt_tokens:>8}{r.reused_tokens:>8}{r.passes_before_first_token:>21}"
                     f"{r.passes_before_first_token_fresh:>9}{r.ttft_seconds:>9.3f}{r.ttft_seconds_fresh:>9.3f}"
                     f"{'yes' if r.same_answer else 'NO':>6}")
    if len(rows) >= 2:
        first, last = rows[0], rows[-1]
        lines.append(f"turn {last.turn} / turn 1 TTFT: {last.ttft_seconds / first.ttft_seconds:.2f}x with reuse, "
                     f"{last.ttft_seconds_fresh / first.ttft_seconds_fresh:.2f}x without")
    return "\n".join(lines)


def run_bench_conversation(args: argparse.Namespace) -> int:
    if args.threads:
        set_threads(args.threads)
    common.quiet_libraries(args.verbose)
    device, dtype = resolve_device(args.device)
    target_path = args.target or str(starter_model())
    target = load_model(target_path, device, dtype, quant=args.quant, offload=args.offload)
    draft = None
    if args.draft:
        draft = load_model(args.draft, device, dtype)
        check_pair(target, draft)
    draft_model = draft.model if draft is not None else None
    reusing = Engine(target.model, target.tokenizer, draft_model, CacheSettings(disk_budget_bytes=0))
    fresh = Engine(target.model, target.tokenizer, draft_model, CacheSettings(enabled=False))
    placement = target.model.placement
    print(f"{target.path.name}{' + ' + draft.path.name if draft else ''} on {device}; "
          f"{placement.describe()}; {args.max_new_tokens} new tokens per turn, greedy; "
          f"{torch.get_num_threads()} CPU threads", file=sys.stderr)
    rows = play(reusing, fresh, args)
    print(format_table(rows))
    if args.json:
        print(json.dumps({"rows": [asdict(r) for r in rows]}))
    return 0
