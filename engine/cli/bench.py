"""Speculation benchmark: one process, one pair of loaded models, the same prompts for every
row, so the rows compare. Prints a table (and returns the rows for --json).

Rows: autoregressive; SpecExec at each budget; Sequoia static trees at each budget (built from
the pair's acceptance by rank, measured on the autoregressive row's own outputs); Hugging Face
assisted generation (`assistant_model=`) on the same pair as an outside anchor for tokens per
target pass. With a hardware profile, a column of the planner's predicted tok/s and a line on
how the planner's choice fares against the measured best. `--out DIR` writes JSON and a PNG.
Also here: `bench hardware` (measure and save the profile) and `bench plan` (the planner's
prediction for a catalog pair on a profile or a reference GPU).
Columns: tokens per target pass, draft passes per step, seconds per step split into draft /
target / engine overhead, tok/s and speed-up against autoregressive. On CPU with a proxy draft
as large as the target the speed-up column is not meaningful (the draft costs as much as the
target); tokens per pass and the time split are.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields, replace
from pathlib import Path
from types import ModuleType
from typing import cast

import torch

from engine.cli import common
from engine.cli.parser import BENCH_METHODS
from engine.decoding.draft_choice import prior_curve
from engine.decoding.generation import Engine
from engine.decoding.pair import draft_choice_of
from engine.errors import InvalidRequest, UsageError
from engine.planning import planner
from engine.planning.calibration import AcceptanceCurve
from engine.planning.measure import measure_hardware
from engine.planning.profile import HardwareProfile, load_profile, profile_path, read_profile, save_profile
from engine.planning.reference import reference_profile
from engine.store.catalog import load_catalog
from engine.threads import set_threads
from engine.types import (
    Completion,
    GenerationRequest,
    Message,
    SamplingSettings,
    SpeculationSettings,
)
from engine.units import GB

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

    def __add__(self, other: BenchRow) -> BenchRow:
        """The same row measured again: counts and seconds add up."""
        key = ("method", "budget", "temperature")
        assert all(getattr(self, name) == getattr(other, name) for name in key)
        return replace(self, **{f.name: getattr(self, f.name) + getattr(other, f.name)
                                for f in fields(self) if f.name not in key})


def run_engine_row(engine: Engine, prompts: Sequence[str], method: str, budget: int, temperature: float,
                   new_tokens: int, max_depth: int = 16, min_pass_gain: float | None = None,
                   rank_acceptance: Sequence[float] | None = None,
                   outputs: list[list[int]] | None = None) -> BenchRow:
    """method: "autoregressive"; "context" (draft-free trees of context candidates); "specexec"
    (the draft's tree with context candidates); "draft-only" (the draft's tree, no candidates);
    "sequoia" (a static tree from `rank_acceptance`); "switched" (specexec with the engine's draft
    switch on: the draft goes off where it is measured not to pay, as in the app). The generated
    token ids of each prompt are appended to `outputs` when given."""
    totals = dict(n=0, tp=0, dp=0, d=0.0, t=0.0, o=0.0, s=0.0)
    base = SpeculationSettings()
    spec = replace(base, mode="autoregressive" if method == "autoregressive" else "specexec", budget=budget,
                   draft=method != "context", context=method not in ("draft-only", "sequoia"),
                   switch_draft=method == "switched",
                   max_depth=max_depth, tree_mode="sequoia" if method == "sequoia" else "specexec",
                   min_pass_gain=base.min_pass_gain if min_pass_gain is None else min_pass_gain,
                   rank_acceptance=tuple(rank_acceptance) if rank_acceptance else base.rank_acceptance)
    for i, prompt in enumerate(prompts):
        req = GenerationRequest(
            messages=(Message("user", prompt),), max_new_tokens=new_tokens,
            sampling=SamplingSettings(temperature=temperature, top_p=0.9 if temperature else 1.0, seed=i),
            speculation=spec,
        )
        final = list(engine.generate(req))[-1]
        assert isinstance(final, Completion)
        if outputs is not None:
            outputs.append(list(final.token_ids))
        s = final.stats
        totals["n"] += s.new_tokens
        totals["tp"] += s.target_passes
        totals["dp"] += s.draft_passes
        totals["d"] += s.draft_seconds
        totals["t"] += s.target_seconds
        totals["o"] += s.overhead_seconds
        totals["s"] += s.seconds - s.prefill_seconds
    return BenchRow(method, budget if method != "autoregressive" else 0, temperature, int(totals["n"]), int(totals["tp"]),
                    int(totals["dp"]), totals["d"], totals["t"], totals["o"], totals["s"])


def run_hf_assisted_row(engine: Engine, prompts: Sequence[str], temperature: float, new_tokens: int) -> BenchRow:
    """Hugging Face assisted generation on the same pair; target passes counted with a hook."""
    assert engine.draft is not None
    target, draft = engine.target.hf_model, engine.draft.hf_model
    # GenerationMixin's, which the *ForCausalLM has and PreTrainedModel's type lacks: token ids here
    generate = cast("Callable[..., torch.Tensor]", target.generate)
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
            out = generate(x, attention_mask=torch.ones_like(x), assistant_model=draft,
                           max_new_tokens=new_tokens, **kwargs)
            seconds += time.perf_counter() - t0
            n += out.shape[1] - len(ids)
            passes += calls["target"] - 1  # the first call is the prompt's prefill
            dpasses += calls["draft"]
    finally:
        for h in hooks:
            h.remove()
    return BenchRow("hf-assisted", 0, temperature, n, passes, dpasses, 0.0, 0.0, 0.0, seconds)


@torch.inference_mode()
def measure_rank_acceptance(engine: Engine, prompts: Sequence[str], outputs: Sequence[Sequence[int]],
                            ranks: int = 16) -> tuple[float, ...]:
    """Acceptance by rank for Sequoia trees: the share of the target's own tokens (its
    autoregressive outputs on `prompts`) that are the draft's 1st, 2nd, ... likeliest token at
    that position, with the draft reading the same text (teacher forcing)."""
    assert engine.draft is not None
    counts = torch.zeros(ranks)
    total = 0
    for prompt, out in zip(prompts, outputs):
        if not out:
            continue
        ids = engine.encode(GenerationRequest(messages=(Message("user", prompt),)))
        seq = torch.tensor([ids + list(out)], device=engine.draft.device)
        logits = engine.draft.hf_model(seq, use_cache=False).logits[0, len(ids) - 1 : -1, : engine.draft_vocab_limit]
        chosen = torch.tensor(out, device=logits.device)  # (L,)
        rank = (logits > logits.gather(1, chosen[:, None])).sum(dim=1).cpu()  # (L,) 0 = the draft's top token
        counts += torch.bincount(rank[rank < ranks], minlength=ranks)[:ranks].float()
        total += len(out)
    return tuple(float(c) / max(total, 1) for c in counts)


def pyplot() -> ModuleType | None:
    """matplotlib.pyplot on its file-only backend, or None (with a note) when the optional
    `bench` extra is not installed: the benchmarks' PNGs are the only use of matplotlib."""
    try:
        import matplotlib
    except ImportError:
        print("note: no PNG plot: matplotlib is not installed (pip install 'specchat[bench]')", file=sys.stderr)
        return None
    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt

    return plt


def format_table(rows: Sequence[BenchRow], predicted: dict[tuple[str, int], float] | None = None) -> str:
    """The table; `predicted` adds the planner's tok/s for (method, budget) rows it priced."""
    predicted = predicted or {}
    ar = {r.temperature: r.tokens_per_second for r in rows if r.method == "autoregressive"}
    head = (f"{'method':<15}{'T':>5}{'budget':>7}{'tok/pass':>9}{'drafts/step':>12}"
            f"{'draft s/step':>13}{'target s/step':>14}{'other s/step':>13}{'tok/s':>7}{'vs AR':>7}"
            + (f"{'pred tok/s':>11}" if predicted else ""))
    lines = [head, "-" * len(head)]
    for r in rows:
        steps = max(r.target_passes, 1)
        base = ar.get(r.temperature)
        speed = f"{r.tokens_per_second / base:.2f}x" if base else "-"
        timing = (f"{r.draft_s / steps:>13.3f}{r.target_s / steps:>14.3f}{r.overhead_s / steps:>13.4f}"
                  if r.method != "hf-assisted" else f"{'-':>13}{'-':>14}{'-':>13}")
        pred = predicted.get((r.method, r.budget))
        lines.append(f"{r.method:<15}{r.temperature:>5.1f}{r.budget or '-':>7}{r.tokens_per_pass:>9.2f}"
                     f"{r.draft_passes / steps:>12.1f}{timing}{r.tokens_per_second:>7.2f}{speed:>7}"
                     + ((f"{pred:>11.2f}" if pred is not None else f"{'-':>11}") if predicted else ""))
    return "\n".join(lines)


def write_plot(rows: Sequence[BenchRow], path: Path,
               predicted: dict[tuple[str, int], float] | None = None) -> Path | None:
    """PNG: tok/s and tokens per pass vs budget, one line per method and temperature;
    autoregressive and HF assisted as horizontal references, the planner's prediction dashed.
    None (and a note on stderr) without matplotlib, the optional `bench` extra."""
    plt = pyplot()
    if plt is None:
        return None

    fig, (ax_speed, ax_pass) = plt.subplots(1, 2, figsize=(11, 4.2))
    for temperature in sorted({r.temperature for r in rows}):
        for method, style in (("specexec", "o-"), ("sequoia", "s-")):
            pts = sorted((r.budget, r.tokens_per_second, r.tokens_per_pass) for r in rows
                         if r.method == method and r.temperature == temperature)
            if pts:
                label = f"{method} T={temperature:g}"
                ax_speed.plot([p[0] for p in pts], [p[1] for p in pts], style, label=label)
                ax_pass.plot([p[0] for p in pts], [p[2] for p in pts], style, label=label)
        for r in rows:
            if r.temperature == temperature and r.method in ("autoregressive", "hf-assisted"):
                ax_speed.axhline(r.tokens_per_second, linestyle=":", color="grey" if r.method == "autoregressive" else "tab:red")
                ax_speed.annotate(f"{r.method} T={temperature:g}", (1, r.tokens_per_second), fontsize=7)
    if predicted:
        curve = sorted((b, v) for (m, b), v in predicted.items() if m == "specexec")
        ax_speed.plot([p[0] for p in curve], [p[1] for p in curve], "k--", label="planner (predicted)")
    for ax, label in ((ax_speed, "tokens / s"), (ax_pass, "tokens per target pass")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("tree budget")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    ax_pass.legend(fontsize=8)
    ax_speed.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# ---- specchat bench speculation | hardware | plan ------------------------------------------------
def run_bench_speculation(args: argparse.Namespace) -> int:
    budgets = common.parse_list(args.budgets, int, "budgets")
    if min(budgets) < 1:
        raise UsageError("Every budget must be at least 1.")
    temperatures = common.parse_list(args.temperatures, float, "temperatures")
    for t in temperatures:  # refused before the models load, as a usage error
        try:
            SamplingSettings(temperature=t)
        except InvalidRequest as exc:
            raise UsageError(f"--temperatures: {exc.user_message}") from None
    prompts = common.read_prompts(args.prompts, DEFAULT_PROMPTS)
    named_profile(args.profile)  # a --profile FILE that cannot be read is refused before the load
    methods = common.parse_list(args.methods, str, "methods")
    unknown = sorted(set(methods) - set(BENCH_METHODS))
    if unknown:
        raise UsageError(f"Unknown bench methods: {', '.join(unknown)}; choose from {', '.join(BENCH_METHODS)}.")
    if args.no_sequoia:
        methods = [m for m in methods if m != "sequoia"]
    if args.no_hf_assisted:
        methods = [m for m in methods if m != "hf-assisted"]
    if args.threads:
        set_threads(args.threads)
    common.quiet_libraries(args.verbose)
    engine = common.bench_engine(args.target, args.draft)
    chosen = draft_choice_of(engine)
    if chosen is not None:
        print(f"draft: {chosen.label} ({chosen.reason})", file=sys.stderr, flush=True)
    if engine.draft is None:  # rows that need a draft are left out
        methods = [m for m in methods if m in ("autoregressive", "context")]
    measured: dict[tuple[str, int, float], BenchRow] = {}  # in the order first run; rounds add up

    def add(row: BenchRow) -> None:
        key = (row.method, row.budget, row.temperature)
        measured[key] = measured[key] + row if key in measured else row

    rank_acceptance: dict[float, tuple[float, ...]] = {}
    for _ in range(args.rounds):  # the whole sweep again: a drift of the machine's speed hits every row alike
        for temperature in temperatures:
            outputs: list[list[int]] = []
            add(run_engine_row(engine, prompts, "autoregressive", 1, temperature, args.max_new_tokens,
                               outputs=outputs))
            for method in ("context", "specexec", "draft-only", "switched"):
                if method in methods:
                    for budget in budgets:
                        add(run_engine_row(engine, prompts, method, budget, temperature, args.max_new_tokens,
                                           args.max_depth, args.min_pass_gain))
            if "sequoia" in methods:
                if temperature not in rank_acceptance:
                    rank_acceptance[temperature] = measure_rank_acceptance(engine, prompts, outputs)
                for budget in budgets:
                    add(run_engine_row(engine, prompts, "sequoia", budget, temperature, args.max_new_tokens,
                                       args.max_depth, rank_acceptance=rank_acceptance[temperature]))
            if "hf-assisted" in methods:
                add(run_hf_assisted_row(engine, prompts, temperature, args.max_new_tokens))
    rows = list(measured.values())
    predicted, plan_text = _planner_view(engine, args.profile, budgets, rows)
    rounds = f" x {args.rounds} rounds" if args.rounds > 1 else ""
    draft_name = "(none)" if engine.draft is None else chosen.label if chosen is not None else Path(args.draft).name
    print(f"{len(prompts)} chat prompts x {args.max_new_tokens} new tokens{rounds}; target {Path(args.target).name}, "
          f"draft {draft_name}; {torch.get_num_threads()} CPU threads" if engine.target.device.type == "cpu"
          else f"{len(prompts)} prompts x {args.max_new_tokens} tokens{rounds} on {engine.target.device}")
    print(format_table(rows, predicted))
    for temperature, accept in rank_acceptance.items():
        print(f"acceptance by rank (T={temperature:g}, for Sequoia trees): "
              + " ".join(f"{a:.3f}" for a in accept[:8]) + f" (top-8 sum {sum(accept[:8]):.3f})")
    for line in plan_text:
        print(line)
    result = {"rows": [r.as_dict() for r in rows],
              "rank_acceptance": {str(t): list(a) for t, a in rank_acceptance.items()},
              "predicted_tokens_per_second": {f"{m}:{b}": v for (m, b), v in predicted.items()},
              "planner": plan_text}
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "speculation.json").write_text(json.dumps(result, indent=1), encoding="utf-8")
        png = write_plot(rows, args.out / "speculation.png", predicted)
        print(f"wrote {args.out / 'speculation.json'}" + (f" and {png}" if png else ""))
    if args.json:
        print(json.dumps(result))
    return 0


def _planner_view(engine: Engine, profile_file: Path | None, budgets: Sequence[int],
                  rows: Sequence[BenchRow]) -> tuple[dict[tuple[str, int], float], list[str]]:
    """The planner's prediction per budget for this loaded pair (prior acceptance curve, no
    calibration from this run) and how its choice fares against the measured sweep."""
    profile = load_profile(profile_file)
    if profile is None:
        return {}, ["planner: no hardware profile (run `specchat bench hardware`), no prediction column"]
    draft = engine.draft.shape if engine.draft is not None else None
    plan = planner.plan_for_pair(profile, engine.target.shape, draft, engine.placement, engine.pass_record,
                                 AcceptanceCurve(), budgets)
    if plan is None:
        return {}, ["planner: the profile was measured on another device than the models run on"]
    predicted = {("specexec", p.budget): p.tokens_per_second for p in plan.curve}
    predicted[("autoregressive", 0)] = plan.autoregressive_tokens_per_second
    device = profile.cpu_model if profile.gpu is None else profile.gpu.name
    choice = "autoregressive" if plan.mode == "autoregressive" else f"budget {plan.budget}, depth {plan.max_depth}"
    lines = [f"planner (prior acceptance curve, profile of {device}): {choice} - {plan.reason}"]
    for temperature in sorted({r.temperature for r in rows}):
        measured = [r for r in rows if r.temperature == temperature and r.method in ("autoregressive", "specexec")]
        best = max(measured, key=lambda r: r.tokens_per_second)
        chosen = next((r for r in measured if (r.method == "autoregressive") == (plan.mode == "autoregressive")
                       and (plan.mode == "autoregressive" or r.budget == plan.budget)), None)
        if chosen is None:
            lines.append(f"  T={temperature:g}: the planner's budget {plan.budget} was not in the sweep")
            continue
        lines.append(f"  T={temperature:g}: measured best {best.method} {best.budget or ''} {best.tokens_per_second:.2f} tok/s; "
                     f"the planner's choice measured {chosen.tokens_per_second:.2f} tok/s "
                     f"({100 * chosen.tokens_per_second / best.tokens_per_second:.0f}% of the best)")
    return predicted, lines


def run_bench_hardware(args: argparse.Namespace) -> int:
    if args.threads:
        set_threads(args.threads)

    def progress(fraction: float, message: str) -> None:
        if not args.json:
            print(f"\r[{fraction * 100:3.0f}%] {message:<60}", end="", file=sys.stderr, flush=True)

    profile = measure_hardware(progress, layer_shape=args.layer_shape, quick=args.quick)
    if not args.json:
        print(file=sys.stderr)
    path = save_profile(profile, args.output)
    if args.json:
        print(json.dumps(profile.to_json()))
    else:
        print("\n".join(profile.summary_lines()))
        print(f"measured in {profile.measure_seconds:.0f} s; saved to {path}")
    return 0


def named_profile(path: Path | None) -> HardwareProfile | None:
    """The profile a user named with --profile (None when none was named); a file that is not
    one is a usage error (exit 2) saying what is wrong with it."""
    if path is None:
        return None
    try:
        return read_profile(path)
    except InvalidRequest as exc:
        raise UsageError(f"--profile: {exc.user_message}") from None


def run_bench_plan(args: argparse.Namespace) -> int:
    if args.moe:
        from engine.cli.bench_moe import print_projection  # noqa: PLC0415

        return print_projection(args.json)
    if not args.target:
        raise UsageError("bench plan: --target ID is needed (or --moe for the MoE projection).")
    catalog = load_catalog()
    target = catalog.find(args.target)
    draft = catalog.find(args.draft) if args.draft else None
    for spec, found in ((args.target, target), (args.draft, draft)):
        if spec and found is None:
            raise InvalidRequest(f"'{spec}' is not in the catalog; `specchat models list` shows the ids.")
    if args.gpu:
        ram_gb = args.ram_gb or 128.0
        profile = reference_profile(args.gpu, pinned_gbps=args.pcie_gbps, ram_gb=ram_gb)
        where = f"{args.gpu} (datasheet roofline), {args.pcie_gbps:g} GB/s host->GPU, {ram_gb:g} GB RAM"
    else:
        loaded = named_profile(args.profile) if args.profile is not None else load_profile()
        if loaded is None:
            raise InvalidRequest("No hardware profile: run `specchat bench hardware` first, or pass --gpu NAME.")
        profile, where = loaded, f"profile {args.profile or profile_path()}"
        if args.ram_gb:
            ram = int(args.ram_gb * GB)
            profile = replace(profile, ram_total=ram, ram_available=ram - (profile.ram_total - profile.ram_available))
            where += f", as if it had {args.ram_gb:g} GB RAM"
    assert target is not None
    # an EAGLE-3 head is priced with the prior draft_choice prices every head by
    prior = prior_curve("assistant") if draft is not None and draft.is_head else AcceptanceCurve()
    pred = planner.predict_pair(profile, target, draft, quant=args.quant, curve=prior)
    curve = planner.predict_curve(profile, target, draft, quant=args.quant, curve=prior) if draft is not None else []
    if args.json:
        print(json.dumps({"target": target.id, "draft": draft.id if draft else None, "where": where,
                          "mode": pred.mode, "budget": pred.budget, "max_depth": pred.max_depth,
                          "tokens_per_second": pred.tokens_per_second, "fit": pred.fit, "quant": pred.quant,
                          "autoregressive_tokens_per_second": pred.autoregressive_tokens_per_second,
                          "placement": pred.placement.describe(), "reason": pred.reason, "curve": curve}))
        return 0
    print(f"{target.id} + {draft.id if draft else 'no draft'} on {where}")
    print(f"{'budget':>7}{'pred tok/s':>12}")
    for budget, tps in curve:
        print(f"{budget:>7}{tps:>12.3g}{'  <- chosen' if budget == pred.budget and pred.mode == 'specexec' else ''}")
    print(f"{'AR':>7}{pred.autoregressive_tokens_per_second:>12.3g}{'  <- chosen' if pred.mode == 'autoregressive' else ''}")
    print(f"choice: {pred.mode}" + (f", budget {pred.budget}, depth {pred.max_depth}" if pred.mode == "specexec" else "")
          + f"; {pred.tokens_per_second:.3g} tok/s predicted; quantisation {pred.quant}; fit: {pred.fit}")
    print(f"why: {pred.reason}")
    return 0
