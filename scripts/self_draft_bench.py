"""Self-drafts against the starter's FP4 proxy draft: tokens per target pass and draft memory.

The starter (SmolLM2-135M-Instruct, fp32) is loaded with every decoder layer offloaded
(`--offload all`), so a self-draft substitutes every layer. Each draft drafts SpecExec trees
(draft + context candidates, the engine's defaults, the draft switch off so that every step
uses the draft) at each budget, greedy and T=0.6 (top-p 0.9, one seed per prompt), on prompts
no setting was tuned on (resources/prompts/chat.txt; tuning.txt is the tuning set).

Memory, on one basis: the bytes a draft's decoder layers take as that draft keeps them: the
self-draft's 2-4-bit substitutes with their fp16 scales, offsets and column scales
(engine.offload.lowbit, engine.offload.calibrate; `--uncalibrated` adds the self-drafts built
without the column scales' calibration),
and the proxy's layers as bitsandbytes FP4 with an fp32 absmax per 64 weights (4.5 bits; the
proxy folder itself is stored de-quantised to fp32). The proxy also needs an embedding and a
head of its own; the self-draft uses the target's.

    python scripts/self_draft_bench.py [--budgets 64,256,1024] [--tokens 48] [--prompts FILE] [--min-pass-gain 0] [--uncalibrated] [--no-proxy]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from engine.cli.bench import run_engine_row
from engine.cli.common import read_prompts
from engine.decoding.generation import Engine
from engine.loading.load import load_model
from engine.loading.self_draft import SELF_DRAFT_BITS, build_self_draft
from engine.loading.starter import proxy_draft_folder, starter_folder
from engine.threads import set_threads

ROOT = Path(__file__).resolve().parent.parent
FP4_BITS_PER_WEIGHT = 4 + 32 / 64


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--budgets", default="64,256,1024")
    parser.add_argument("--temperatures", default="0,0.6")
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--prompts", type=Path, default=ROOT / "resources" / "prompts" / "chat.txt")
    parser.add_argument("--count", type=int, default=6, help="prompts used from the file")
    parser.add_argument("--bits", default=",".join(str(b) for b in sorted(SELF_DRAFT_BITS)))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--uncalibrated", action="store_true",
                        help="also the self-drafts built without the tokenizer (no activation-aware scaling)")
    parser.add_argument("--min-pass-gain", type=float, default=None,
                        help="0 grows every tree to its budget (compares drafts, not this CPU's costs); default: "
                        "the engine's own stop, from the measured costs of a draft pass and a step")
    parser.add_argument("--no-proxy", action="store_true",
                        help="leave out the FP4 proxy's row (its memory still sets the 'vs FP4' column)")
    args = parser.parse_args()
    set_threads(args.threads)
    budgets = [int(b) for b in args.budgets.split(",")]
    temperatures = [float(t) for t in args.temperatures.split(",")]
    prompts = read_prompts(args.prompts, ())[: args.count]
    target = load_model(starter_folder(), offload="all")
    layer_params = target.model.shape.layer_params * target.model.shape.num_layers
    drafts = []
    proxy_bytes = int(layer_params * FP4_BITS_PER_WEIGHT / 8)
    if not args.no_proxy:
        drafts.append(("FP4 proxy (bitsandbytes, blocksize 64)", load_model(proxy_draft_folder()).model, proxy_bytes))
    for bits in (int(b) for b in args.bits.split(",")):
        for calibrated in (True, False) if args.uncalibrated else (True,):
            t0 = time.perf_counter()
            draft = build_self_draft(target.model, bits, cache_dir=None,
                                     tokenizer=target.tokenizer if calibrated else None)
            info = draft.self_draft  # type: ignore[attr-defined]
            label = info.label + ("" if calibrated else ", plain")
            print(f"built the {label} in {time.perf_counter() - t0:.1f} s")
            drafts.append((label, draft, info.nbytes - draft.streamer.dense_layout.nbytes))  # type: ignore[union-attr]
    stop = "trees grown to the budget" if args.min_pass_gain == 0 else "the engine's own tree stop"
    print(f"\nstarter, every layer offloaded; {len(prompts)} prompts of {args.prompts.name} x {args.tokens} tokens; "
          f"tokens per target pass (SpecExec, draft + context candidates, {stop})\n")
    head = f"{'draft':44} {'layers MiB':>10} {'vs FP4':>7}" + "".join(
        f" {f'T={t:g} B={b}':>11}" for t in temperatures for b in budgets)
    print(head)
    print("-" * len(head))
    for label, draft, nbytes in drafts:
        engine = Engine(target.model, target.tokenizer, draft)
        cells = []
        for t in temperatures:
            for b in budgets:
                row = run_engine_row(engine, prompts, "specexec", b, t, args.tokens, min_pass_gain=args.min_pass_gain)
                cells.append(row.new_tokens / max(row.target_passes, 1))
                print(f"  ({label}, T={t:g} B={b}: {cells[-1]:.2f})", flush=True)
        print(f"{label:44} {nbytes / 2**20:10.1f} {nbytes / proxy_bytes:7.2f}" + "".join(f" {c:11.2f}" for c in cells),
              flush=True)


if __name__ == "__main__":
    main()
