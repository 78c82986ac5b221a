"""Speculation benchmark: one process, one pair of loaded models, the same prompts for every
row, so the rows compare. Prints a table (and returns the rows for --json).

Rows: autoregressive; SpecExec at each budget; Hugging Face assisted generation
(`assistant_model=`) on the same pair as an outside anchor for tokens per target pass.
Columns: tokens per target pass, draft passes per step, seconds per step split into draft /
target / engine overhead, tok/s and speed-up against autoregressive. On CPU with a proxy draft
as large as the target the speed-up column is not meaningful (the draft costs as much as the
target); tokens per pass and the time split are.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from .errors import InvalidRequest
from .generation import Engine
from .types import Completion, GenerationRequest, Message, SamplingSettings, SpeculationSettings

DEFAULT_PROMPTS = (
    "What is the capital of France?",
    "Write a short poem about the sea.",
    "Explain how a CPU cache works.",
    "Give me three tips for learning Python.",
)


@dataclass(frozen=True)
class BenchRow:
    method: str
    budget: int
    temperature: float
    new_tokens: int
    target_passes: int
    draft_passes: int
    draft_s: float
    target_s: float
    overhead_s: float
    seconds: float

    @property
    def tokens_per_pass(self) -> float:
        return self.new_tokens / max(self.target_passes, 1)

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.seconds if self.seconds else 0.0

    def as_dict(self) -> dict[str, float | int | str]:
        return {**self.__dict__, "tokens_per_pass": self.tokens_per_pass, "tokens_per_second": self.tokens_per_second}


def run_engine_row(engine: Engine, prompts: Sequence[str], method: str, budget: int, temperature: float,
                   new_tokens: int, max_depth: int = 16, min_pass_gain: float | None = None) -> BenchRow:
    totals = dict(n=0, tp=0, dp=0, d=0.0, t=0.0, o=0.0, s=0.0)
    for i, prompt in enumerate(prompts):
        req = GenerationRequest(
            messages=(Message("user", prompt),), max_new_tokens=new_tokens,
            sampling=SamplingSettings(temperature=temperature, top_p=0.9 if temperature else 1.0, seed=i),
            speculation=SpeculationSettings(mode=method, budget=budget, max_depth=max_depth,  # type: ignore[arg-type]
                                            min_pass_gain=SpeculationSettings().min_pass_gain
                                            if min_pass_gain is None else min_pass_gain),
        )
        final = list(engine.generate(req))[-1]
        assert isinstance(final, Completion)
        s = final.stats
        totals["n"] += s.new_tokens
        totals["tp"] += s.target_passes
        totals["dp"] += s.draft_passes
        totals["d"] += s.draft_seconds
        totals["t"] += s.target_seconds
        totals["o"] += s.overhead_seconds
        totals["s"] += s.seconds - s.prefill_seconds
    return BenchRow(method, budget if method == "specexec" else 0, temperature, int(totals["n"]), int(totals["tp"]),
                    int(totals["dp"]), totals["d"], totals["t"], totals["o"], totals["s"])


def run_hf_assisted_row(engine: Engine, prompts: Sequence[str], temperature: float, new_tokens: int) -> BenchRow:
    """Hugging Face assisted generation on the same pair; target passes counted with a hook."""
    assert engine.draft is not None
    target, draft = engine.target.hf_model, engine.draft.hf_model
    calls = {"target": 0, "draft": 0}
    hooks = [target.register_forward_pre_hook(lambda *_: calls.__setitem__("target", calls["target"] + 1)),
             draft.register_forward_pre_hook(lambda *_: calls.__setitem__("draft", calls["draft"] + 1))]
    n = passes = dpasses = 0
    seconds = 0.0
    try:
        for i, prompt in enumerate(prompts):
            ids = engine.encode(GenerationRequest(messages=(Message("user", prompt),)))
            x = torch.tensor([ids])
            torch.manual_seed(i)
            calls.update(target=0, draft=0)
            t0 = time.perf_counter()
            kwargs = dict(do_sample=True, temperature=temperature, top_p=0.9) if temperature else dict(do_sample=False)
            out = target.generate(x, attention_mask=torch.ones_like(x), assistant_model=draft,
                                  max_new_tokens=new_tokens, **kwargs)
            seconds += time.perf_counter() - t0
            n += out.shape[1] - len(ids)
            passes += calls["target"] - 1  # the first call is the prompt's prefill
            dpasses += calls["draft"]
    finally:
        for h in hooks:
            h.remove()
    return BenchRow("hf-assisted", 0, temperature, n, passes, dpasses, 0.0, 0.0, 0.0, seconds)


def format_table(rows: Sequence[BenchRow]) -> str:
    ar = {r.temperature: r.tokens_per_second for r in rows if r.method == "autoregressive"}
    head = (f"{'method':<15}{'T':>5}{'budget':>7}{'tok/pass':>9}{'drafts/step':>12}"
            f"{'draft s/step':>13}{'target s/step':>14}{'other s/step':>13}{'tok/s':>7}{'vs AR':>7}")
    lines = [head, "-" * len(head)]
    for r in rows:
        steps = max(r.target_passes, 1)
        base = ar.get(r.temperature)
        speed = f"{r.tokens_per_second / base:.2f}x" if base else "-"
        timing = (f"{r.draft_s / steps:>13.3f}{r.target_s / steps:>14.3f}{r.overhead_s / steps:>13.4f}"
                  if r.method != "hf-assisted" else f"{'-':>13}{'-':>14}{'-':>13}")
        lines.append(f"{r.method:<15}{r.temperature:>5.1f}{r.budget or '-':>7}{r.tokens_per_pass:>9.2f}"
                     f"{r.draft_passes / steps:>12.1f}{timing}{r.tokens_per_second:>7.2f}{speed:>7}")
    return "\n".join(lines)


# ---- CLI: specchat bench speculation ------------------------------------------------------------
def add_bench_parser(commands: argparse._SubParsersAction) -> None:
    bench = commands.add_parser("bench", help="benchmarks that print tables")
    kinds = bench.add_subparsers(dest="bench_kind", metavar="KIND", required=True)
    spec = kinds.add_parser("speculation", help="tokens per pass and time split per budget, one run",
                            description="Autoregressive, SpecExec at each budget and Hugging Face assisted "
                            "generation on the same pair and prompts, in one process.")
    spec.add_argument("--target", required=True, metavar="MODEL")
    spec.add_argument("--draft", required=True, metavar="MODEL")
    spec.add_argument("--prompts", type=Path, metavar="FILE", help="one chat prompt per line (default: 4 built in)")
    spec.add_argument("--budgets", default="16,64,256", metavar="LIST", help="comma-separated (default: 16,64,256)")
    spec.add_argument("--temperatures", default="0,0.6", metavar="LIST",
                      help="comma-separated; T > 0 samples with top-p 0.9 (default: 0,0.6)")
    spec.add_argument("--max-new-tokens", type=int, default=64, metavar="N")
    spec.add_argument("--max-depth", type=int, default=SpeculationSettings().max_depth, metavar="D")
    spec.add_argument("--min-pass-gain", type=float, default=None, metavar="G",
                      help=f"stop tree growth below this expected gain per draft pass "
                      f"(default: {SpeculationSettings().min_pass_gain:g}; 0 grows every budget to the full)")
    spec.add_argument("--no-hf-assisted", action="store_true", help="skip the transformers assisted-generation row")
    spec.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    spec.add_argument("--json", action="store_true", help="also print the rows as one JSON object")
    spec.set_defaults(handler=run_bench_speculation)


def _parse_list(text: str, kind: type, what: str) -> list:
    try:
        values = [kind(v) for v in text.split(",") if v.strip()]
    except ValueError:
        values = []
    if not values:
        raise InvalidRequest(f"--{what} must be a comma-separated list of numbers, got '{text}'.")
    return values


def run_bench_speculation(args: argparse.Namespace) -> int:
    from .loading import check_pair, load_model

    budgets = _parse_list(args.budgets, int, "budgets")
    if min(budgets) < 1:
        raise InvalidRequest("Every budget must be at least 1.")
    temperatures = _parse_list(args.temperatures, float, "temperatures")
    prompts: Sequence[str] = DEFAULT_PROMPTS
    if args.prompts is not None:
        try:
            prompts = [line.strip() for line in args.prompts.read_text(encoding="utf-8").splitlines() if line.strip()]
        except OSError as exc:
            raise InvalidRequest(f"Cannot read the prompts file '{args.prompts}': {exc.strerror}.") from exc
        if not prompts:
            raise InvalidRequest(f"The prompts file '{args.prompts}' has no prompts (one per line).")
    if args.threads:
        torch.set_num_threads(args.threads)
    from .cli import _quiet_libraries

    _quiet_libraries(args.verbose)
    target, draft = load_model(args.target), load_model(args.draft)
    check_pair(target, draft)
    engine = Engine(target.model, target.tokenizer, draft.model)
    rows: list[BenchRow] = []
    for temperature in temperatures:
        rows.append(run_engine_row(engine, prompts, "autoregressive", 1, temperature, args.max_new_tokens))
        for budget in budgets:
            rows.append(run_engine_row(engine, prompts, "specexec", budget, temperature, args.max_new_tokens,
                                       args.max_depth, args.min_pass_gain))
        if not args.no_hf_assisted:
            rows.append(run_hf_assisted_row(engine, prompts, temperature, args.max_new_tokens))
    print(f"{len(prompts)} chat prompts x {args.max_new_tokens} new tokens; target {target.path.name}, "
          f"draft {draft.path.name}; {torch.get_num_threads()} CPU threads" if target.model.device.type == "cpu"
          else f"{len(prompts)} prompts x {args.max_new_tokens} tokens on {target.model.device}")
    print(format_table(rows))
    if args.json:
        print(json.dumps({"rows": [r.as_dict() for r in rows]}))
    return 0
