"""`specchat bench offload --moe`: what a target pass over N tokens costs an MoE model whose
routed experts run packed on the CPU (engine.kernels.experts), against N; and `specchat bench
plan --moe`'s printing of the labelled MoE projection (engine.planning.projection).

The model is --target (an MoE GGUF) or the synthetic MoE with Qwen3-30B-A3B's layers
(engine.testing.random_gguf, Q4_K_M, written on first use; --quick: the small one). Each pass
runs N tokens after a 64-token context: the N tokens that follow the context in a prompt of
resources/prompts (consecutive text, as a tree's first path would be). Per N, the fastest of
--repeats passes:

- pass s: the whole pass; expert s: the part spent in the routed experts (timed around each
  experts call), and its share;
- u(N): experts woken per MoE layer (mean over layers), measured, beside the planner's prior
  (engine.planning.moe.expert_union: routing spread evenly);
- expert MB: the routed experts' bytes the pass read (u(N) x bytes per expert x layers), and the
  seconds per token of the pass;
- model s: the experts' seconds by the cost model's formula (profile.ExpertTiming, timed here on
  random experts of Qwen3-30B-A3B's shape: `specchat bench hardware` keeps the same figure) with
  the measured u(N) and this model's bytes per expert: the formula against the measurement;
- planner s: what the planner prices them at before anything of the model was measured (the
  prior u(N), KERNEL_EXPERT_BYTES_PER_PARAM).

What this module does not do: place experts on a GPU (not built yet).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import asdict
from pathlib import Path

import torch

from engine import paths
from engine.errors import UsageError
from engine.kernels.experts import PackedExperts
from engine.loading.load import LoadedModel, load_model
from engine.planning import planner
from engine.planning.measure import expert_timing
from engine.planning.moe import expert_union, fit_sharing
from engine.planning.profile import HardwareProfile
from engine.shapes import ModelShape
from engine.testing.random_gguf import SYNTHETIC_MOE, SYNTHETIC_MOE_SMALL, synthetic_moe_gguf
from engine.units import MIB

PROMPTS = Path(__file__).resolve().parents[2] / "resources" / "prompts" / "chat.txt"
CONTEXT = 64


def experts_of(loaded: LoadedModel) -> list[PackedExperts]:
    return [m for m in loaded.model.hf_model.modules() if isinstance(m, PackedExperts)]


def prompt_ids(loaded: LoadedModel, need: int) -> list[int]:
    """`need` token ids of the prompts file's text, repeated if short."""
    text = PROMPTS.read_text(encoding="utf-8") if PROMPTS.is_file() else "The quick brown fox jumps over the lazy dog. "
    ids: list[int] = loaded.tokenizer(text)["input_ids"]
    while len(ids) < need:
        ids = ids + ids
    return ids[:need]


def run_moe_table(loaded: LoadedModel, budgets: list[int], repeats: int,
                  profile: HardwareProfile | None = None) -> list[dict]:
    """One row per N of `budgets`; `profile`: a hardware profile whose ExpertTiming prices the
    experts (default: timed now)."""
    experts = experts_of(loaded)
    if not experts:
        raise UsageError("The model has no routed experts the packed CPU kernel runs (an MoE GGUF in Q4_0, Q4_1, "
                         "Q5_x, Q8_0 or K-quant types, on a CPU with a C compiler).")
    spent = [0.0]

    def before(_m: torch.nn.Module, _args: tuple) -> None:
        spent.append(-time.perf_counter())

    def after(_m: torch.nn.Module, _args: tuple, _out: torch.Tensor) -> None:
        spent[0] += time.perf_counter() + spent.pop()

    hooks = [h for e in experts for h in (e.register_forward_pre_hook(before), e.register_forward_hook(after))]
    model = loaded.model
    fused, model.fused = model.fused, None  # the experts' seconds come from their modules' calls, which
    # the fused decode step (one C call for a whole 1-token pass) does not make: the general path here
    ids = torch.tensor(prompt_ids(loaded, CONTEXT + max(budgets)))
    cache = model.new_cache(CONTEXT + max(budgets) + 8)
    num_experts, top_k = experts[0].num_experts, _top_k(loaded)
    per_expert = statistics.mean(e.nbytes / e.num_experts for e in experts)
    shape = ModelShape.from_config(model.hf_model.config)
    timing = profile.cpu_experts if profile is not None and profile.cpu_experts is not None else expert_timing()
    rows = []
    try:
        with torch.inference_mode():
            model.forward(ids[:CONTEXT], torch.arange(CONTEXT), cache, None)
            for n in budgets:
                best: tuple[float, float, float] | None = None
                for _ in range(repeats + 1):  # the first pass warms caches and the allocator
                    cache.truncate(CONTEXT)
                    spent[:] = [0.0]
                    t0 = time.perf_counter()
                    model.forward(ids[CONTEXT:CONTEXT + n], torch.arange(CONTEXT, CONTEXT + n), cache, None)
                    seconds = time.perf_counter() - t0
                    union = statistics.mean(e.last_union for e in experts)
                    if best is None or seconds < best[0]:
                        best = (seconds, spent[0], union)
                assert best is not None
                seconds, expert_s, union = best
                modelled = planned = float("nan")
                if timing is not None:
                    modelled = len(experts) * timing.seconds(union, n * top_k, shape.expert_params, int(per_expert))
                    planned = shape.num_layers * planner.timed_expert_seconds(timing, shape, n)
                rows.append({"tokens": n, "pass_s": seconds, "expert_s": expert_s, "union": union,
                             "prior": expert_union(n, num_experts, top_k),
                             "expert_mb": union * per_expert * len(experts) / MIB, "s_per_token": seconds / n,
                             "model_s": modelled, "planner_s": planned})
    finally:
        for h in hooks:
            h.remove()
        model.fused = fused
    return rows


def _top_k(loaded: LoadedModel) -> int:
    return int(getattr(loaded.model.hf_model.config, "num_experts_per_tok", 0) or 0)


def format_moe_table(name: str, loaded: LoadedModel, rows: list[dict]) -> str:
    experts = experts_of(loaded)
    cfg = loaded.model.hf_model.config
    lines = [f"model {name}: {len(experts)} MoE layers of {experts[0].num_experts} experts, "
             f"{getattr(cfg, 'num_experts_per_tok', '?')} routed per token, "
             f"{statistics.mean(e.nbytes / e.num_experts for e in experts) / MIB:.2f} MiB per expert (packed, CPU)",
             f"{'tokens':>6} {'pass s':>8} {'expert s':>9} {'share':>6} {'u(N)':>7} {'prior':>7} {'expert MB':>10} "
             f"{'s/token':>8} {'model s':>8} {'planner s':>9}"]
    for r in rows:
        lines.append(f"{r['tokens']:>6} {r['pass_s']:>8.4f} {r['expert_s']:>9.4f} {r['expert_s'] / r['pass_s']:>6.0%} "
                     f"{r['union']:>7.1f} {r['prior']:>7.1f} {r['expert_mb']:>10.1f} {r['s_per_token']:>8.4f} "
                     f"{r['model_s']:>8.4f} {r['planner_s']:>9.4f}")
    lines.append("u(N): experts woken per layer, measured on consecutive prompt tokens; prior: the planner's, "
                 "routing spread evenly (engine.planning.moe); model s: the experts' seconds by the cost "
                 "model with the measured u(N) and this model's bytes; planner s: with the prior u(N) and its "
                 "assumed bytes per weight")
    sharing = fit_sharing({r["tokens"]: (1, r["union"]) for r in rows}, experts[0].num_experts, _top_k(loaded))
    fitted = ", ".join(f"{r['tokens']}: {expert_union(r['tokens'], experts[0].num_experts, _top_k(loaded), sharing):.1f}"
                       for r in rows if r["tokens"] > 1)
    lines.append(f"measured routing: sharing {sharing:.2f} (1.00 = the prior), its u(N) {fitted}: what the "
                 "planner prices this model's trees by once its passes measured it")
    return "\n".join(lines)


def synthetic_target(quick: bool) -> Path:
    """The synthetic MoE GGUF (Q4_K_M), written on first use; `quick`: the small one."""
    shape = SYNTHETIC_MOE_SMALL if quick else SYNTHETIC_MOE
    name = "moe-small-q4km.gguf" if quick else "moe-30b-a3b-8-layers-q4km.gguf"
    return synthetic_moe_gguf(paths.cache_dir() / "synthetic" / name, **shape)


def run_bench_moe(args: argparse.Namespace, budgets: list[int]) -> int:
    target = Path(args.target) if args.target else synthetic_target(args.quick)
    loaded = load_model(target, "cpu", torch.float32, offload="none")
    print(format_moe_table(target.name, loaded, run_moe_table(loaded, budgets, args.repeats)))
    return 0


def print_projection(as_json: bool) -> int:
    """`specchat bench plan --moe`: the labelled MoE projection (engine.planning.projection)."""
    from engine.planning import projection  # noqa: PLC0415 - reads transformers' Qwen3.5-MoE config

    rows = projection.project()
    if as_json:
        print(json.dumps({"projection": True, "model": projection.MODEL, "llama_cpp_tok_s": projection.LLAMA_CPP_TOK_S,
                          "rows": [{**asdict(r), "tree_share": r.tree_share, "vs_llama_cpp": r.vs_llama_cpp}
                                   for r in rows],
                          "by_gpu_layer_overhead": [{"machine": m, "expert_gbps": g, "overhead_s": list(projection.OVERHEADS_S),
                                                     "best_tok_s": [p[0] for p in pts], "budget": [p[1] for p in pts]}
                                                    for m, g, pts in projection.overhead_sensitivity()]}))
    else:
        print("\n".join(projection.format_projection(rows)))
        print()
        print("\n".join(projection.format_sensitivity(projection.overhead_sensitivity())))
    return 0
