"""`specchat bench offload`: what streaming layers costs, and what loading takes in RAM.

Pass table: for each budget (tokens in one target pass over a 64-token context), the pass time
of the resident model, of the same weights streamed from RAM through the ring (--offload all),
and from the disk tier (RAM capped to zero), with streamed / resident ratios. On CUDA it also
prints the host-to-device rate a streamed pass achieves against a plain pinned copy of the
same bytes. The model is --target, or a synthetic Llama written on first use (random bf16
shards, never committed).

--load-rss measures peak RSS while loading (in a fresh subprocess, so the figure is the load's
own): the synthetic ~1.5 GB bf16 Llama in several shards, loaded with --quant; with --gguf, a
synthetic ~1.5 GB Q4_K_M GGUF, streamed from its host store.

--moe: an MoE model's experts run packed on the CPU, per tokens in a pass (bench_moe.py).

--gguf alone compares packings on one synthetic shape: a GGUF's own Q4_K_M blocks, NF4 and dense
layers: bytes per streamed layer, and resident and streamed pass times per budget.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import cast

import torch

from engine import paths
from engine.cli import common
from engine.kernels.experts import PackedExperts
from engine.kernels.linear import PackedLinear
from engine.loading.load import LoadedModel, load_model, resolve_device
from engine.testing.random_gguf import SYNTHETIC_GGUF_BIG, SYNTHETIC_GGUF_SMALL, synthetic_gguf
from engine.testing.synthetic import SYNTHETIC_BIG, SYNTHETIC_SMALL, synthetic_llama
from engine.peak_memory import peak_rss_bytes, reset_peak, rss_bytes
from engine.threads import set_threads
from engine.types import Offload, Quant
from engine.units import GB, MIB


DEFAULT_BUDGETS = "1,4,16,64,256"  # the parser's --budgets default
MOE_BUDGETS = [1, 2, 4, 8, 16, 32, 64]  # --moe: where the union of experts grows fastest


# ---- pass times -------------------------------------------------------------------------------
def pass_seconds(loaded: LoadedModel, budget: int, context: int = 64, repeats: int = 3) -> float:
    """Fastest of `repeats` target passes over `budget` new tokens after `context` cached ones
    (the minimum is the figure least disturbed by other work on the machine)."""
    model = loaded.model
    cache = model.new_cache(context + budget + 8)
    vocab = min(model.shape.vocab_size, 256)
    model.forward(torch.arange(context) % vocab, torch.arange(context), cache, None)
    ids = torch.arange(budget) % vocab
    pos = torch.arange(context, context + budget)
    times = []
    for _ in range(repeats + 1):  # the first pass warms the ring and the allocator
        cache.truncate(context)
        _sync(model.device)
        t0 = time.perf_counter()
        model.forward(ids, pos, cache, None)
        _sync(model.device)
        times.append(time.perf_counter() - t0)
    return min(times[1:])


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def pinned_copy_gbps(nbytes: int, device: torch.device, repeats: int = 5) -> float:
    """Host-to-device GB/s of one plain pinned copy of `nbytes` (the ceiling streaming aims at)."""
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    times = []
    for _ in range(repeats + 1):
        torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
    return nbytes / statistics.median(times[1:]) / GB


def run_pass_table(target: Path, budgets: list[int], device: str, quant: Quant, disk: bool, repeats: int) -> list[dict]:
    dev, dtype = resolve_device(device)
    # kind -> (offload, RAM limit: 0 sends every streamed layer to the disk tier)
    kinds: dict[str, tuple[Offload, int | None]] = {"resident": ("none", None), "streamed": ("all", None)}
    if disk:
        kinds["disk"] = ("all", 0)
    models = {k: load_model(target, dev, dtype, quant=quant, offload=offload, ram_limit_bytes=ram)
              for k, (offload, ram) in kinds.items()}
    rows = []
    for b in budgets:
        row: dict = {"budget": b}
        for k, m in models.items():
            row[k] = pass_seconds(m, b, repeats=repeats)
        row["ratio"] = row["streamed"] / row["resident"]
        if disk:
            row["disk_ratio"] = row["disk"] / row["resident"]
        rows.append(row)
    streamed = models["streamed"].model
    placement = streamed.placement
    print(f"model {target.name}: {placement.num_layers if placement else '?'} layers, "
          f"{(placement.layer_bytes if placement else 0) / MIB:.1f} MiB per streamed layer ({quant}), device {dev}")
    head = f"{'budget':>6} {'resident s':>11} {'streamed s':>11} {'ratio':>6}"
    head += f" {'disk s':>9} {'ratio':>6}" if disk else ""
    print(head)
    for r in rows:
        line = f"{r['budget']:>6} {r['resident']:>11.4f} {r['streamed']:>11.4f} {r['ratio']:>6.2f}"
        line += f" {r['disk']:>9.4f} {r['disk_ratio']:>6.2f}" if disk else ""
        print(line)
    if dev == "cuda" and placement is not None:
        moved = placement.layer_bytes * (placement.num_layers - placement.gpu_layers)
        achieved = moved / min(r["streamed"] for r in rows) / GB
        plain = pinned_copy_gbps(moved, torch.device("cuda"))
        print(f"host-to-device: streamed pass {achieved:.1f} GB/s, plain pinned copy {plain:.1f} GB/s "
              f"({100 * achieved / plain:.0f} %)")
    return rows


def run_packing_table(budgets: list[int], device: str, repeats: int) -> list[dict]:
    """GGUF blocks (Q4_K, Q4_K_M, IQ4_XS) vs NF4 vs dense, on one synthetic shape: MiB per
    streamed layer, resident and streamed pass seconds per budget."""
    dev, dtype = resolve_device(device)
    root = paths.cache_dir() / "synthetic"
    folder = synthetic_llama(root / "llama-gguf-small-bf16", **SYNTHETIC_GGUF_SMALL)
    kinds: list[tuple[str, Path, Quant]] = [
        (f"GGUF {name}", synthetic_gguf(root / f"llama-gguf-small-{name}.gguf", layer_types=(types,),
                                        **SYNTHETIC_GGUF_SMALL), "none")
        for name, types in (("Q4_K", "Q4_K"), ("Q4_K_M", "Q4_K/Q6_K"), ("IQ4_XS", "IQ4_XS"))]
    kinds += [("NF4", folder, "nf4"), (f"dense {str(dtype)[6:]}", folder, "none")]
    rows = []
    print(f"synthetic Llama {SYNTHETIC_GGUF_SMALL}, device {dev}")
    print(f"{'packing':>14} {'MiB/layer':>9} {'budget':>6} {'resident s':>11} {'streamed s':>11} {'ratio':>6}")
    for label, target, quant in kinds:
        resident = load_model(target, dev, dtype, quant=quant, offload="none")
        streamed = load_model(target, dev, dtype, quant=quant, offload="all")
        layer = streamed.model.placement.layer_bytes
        for b in budgets:
            r, s = pass_seconds(resident, b, repeats=repeats), pass_seconds(streamed, b, repeats=repeats)
            rows.append(dict(packing=label, layer_bytes=layer, budget=b, resident=r, streamed=s))
            print(f"{label:>14} {layer / MIB:>9.2f} {b:>6} {r:>11.4f} {s:>11.4f} {s / r:>6.2f}")
        del resident, streamed
    return rows


# ---- peak RSS of a load ------------------------------------------------------------------------
def load_rss_child(folder: str, quant: Quant, offload: Offload) -> None:
    """The child of measure_load_rss (run as `python -m engine.cli.bench_offload FOLDER QUANT
    OFFLOAD`): load the model after this module's imports (torch, transformers, bitsandbytes:
    the fixed overhead) and print the figures as one JSON line. The peak is engine.peak_memory's
    (VmHWM on Linux, reset to the RSS before the load: ru_maxrss would carry the parent's over)."""

    torch.set_num_threads(1)
    base = rss_bytes()
    reset_peak()  # the high-water mark back to the RSS: what follows is the load's
    t0 = time.perf_counter()
    m = load_model(folder, "cpu", torch.float32, quant=quant, offload=offload)
    seconds = time.perf_counter() - t0
    peak = peak_rss_bytes()
    p = m.model.placement
    outer = sum(t.numel() * t.element_size() for n, t in m.model.hf_model.named_parameters()
                if not t.is_meta and not n.startswith("model.layers."))
    # a head and an embedding table kept packed (one weight when tied)
    packed = {id(w): w.nbytes for mod in (m.model.embed, m.model.head)
              for w in [getattr(mod, "qweight", None) or getattr(mod, "packed", None)] if w is not None}
    outer += sum(packed.values())
    print(json.dumps(dict(base=base, peak=peak, final=rss_bytes(), layers_bytes=held_layer_bytes(m),
                          layer_bytes=p.layer_bytes, outer_bytes=outer, placement=p.describe(), seconds=seconds)))


def held_layer_bytes(m: LoadedModel) -> int:
    """Bytes the decoder layers hold in memory: resident modules (their parameters, buffers and
    packed-kernel weights), packed buffers, RAM arenas."""
    s = m.model.streamer
    layers = m.model.hf_model.model.layers
    held = sum(t.numel() * t.element_size() for t in [*layers.parameters(), *layers.buffers()] if not t.is_meta)
    held += sum(mod.qweight.nbytes for mod in layers.modules() if isinstance(mod, PackedLinear))
    held += sum(mod.packed_nbytes for mod in layers.modules() if isinstance(mod, PackedExperts))
    if s is not None:
        held += sum(h.packed.numel() for h in s.homes if h.packed is not None)
        held += s.store.ram_bytes if s.store is not None else 0
    return held


def measure_load_rss(folder: Path, quant: Quant = "nf4", offload: Offload = "none",
                     cache_dir: Path | None = None) -> dict:
    """Peak RSS of loading `folder` on CPU, in a fresh interpreter (Linux: /proc). Returns base
    (after imports), peak, final, the final footprint parts (packed layers, outer weights) and
    seconds. `cache_dir` is the child's SPECCHAT_CACHE_DIR (the prepared-layer cache): a fresh
    folder by default, so the load reads the checkpoint."""
    root = Path(__file__).resolve().parents[2]  # the folder holding engine/
    with tempfile.TemporaryDirectory(prefix="specchat-rss-") as tmp:
        env = {**os.environ, "OMP_NUM_THREADS": "1", "SPECCHAT_CACHE_DIR": str(cache_dir or tmp)}
        out = subprocess.run([sys.executable, "-m", "engine.cli.bench_offload", str(folder), quant, offload],
                             capture_output=True, text=True, cwd=root, env=env, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def print_load_rss(folder: Path, quant: Quant, offload: Offload = "none") -> None:
    mb = MIB
    if folder.is_file():
        print(f"GGUF {folder.stat().st_size / mb:.0f} MiB, loaded on CPU with --quant {quant} --offload {offload}")
    else:
        ckpt = sum(f.stat().st_size for f in folder.glob("*.safetensors"))
        print(f"checkpoint {ckpt / mb:.0f} MiB bf16 in {len(list(folder.glob('*.safetensors')))} shards, loaded on "
              f"CPU with --quant {quant}")
    with tempfile.TemporaryDirectory(prefix="specchat-prepared-") as cache:
        for label in ("first start", "second start (prepared cache)" if quant == "nf4" else "second start"):
            r = measure_load_rss(folder, quant, offload, cache_dir=Path(cache))
            footprint = r["layers_bytes"] + r["outer_bytes"]
            print(f"{label}: {r['seconds']:.1f} s; {r['placement']}")
            print(f"  RSS after imports {r['base'] / mb:.0f} MiB; the load adds {(r['peak'] - r['base']) / mb:.0f} MiB "
                  f"at peak, {(r['final'] - r['base']) / mb:.0f} MiB at the end")
            print(f"  final footprint {footprint / mb:.0f} MiB (layers {r['layers_bytes'] / mb:.0f} + embeddings/head "
                  f"{r['outer_bytes'] / mb:.0f}); peak excess over it {(r['peak'] - r['base'] - footprint) / mb:.0f} MiB; "
                  f"one packed layer {r['layer_bytes'] / mb:.1f} MiB")


def run_bench_offload(args: argparse.Namespace) -> int:
    if args.threads:
        set_threads(args.threads)
    if args.moe and args.load_rss:  # the synthetic MoE resident (experts packed), then streamed
        from engine.cli.bench_moe import synthetic_target  # noqa: PLC0415

        for offload in ("none", "all"):
            print_load_rss(synthetic_target(args.quick), "none", offload)
        return 0
    if args.moe:
        from engine.cli.bench_moe import run_bench_moe  # noqa: PLC0415

        budgets = common.parse_list(args.budgets, int, "budgets") if args.budgets != DEFAULT_BUDGETS else MOE_BUDGETS
        return run_bench_moe(args, budgets)
    if args.load_rss and args.gguf:
        gguf = synthetic_gguf(paths.cache_dir() / "synthetic" / "llama-1.5g-q4km.gguf", **SYNTHETIC_GGUF_BIG)
        print_load_rss(gguf, args.quant, "all")
        return 0
    if args.load_rss:
        folder = synthetic_llama(paths.cache_dir() / "synthetic" / "llama-1.5g", **SYNTHETIC_BIG)
        print_load_rss(folder, args.quant)
        return 0
    if args.gguf:
        run_packing_table(common.parse_list(args.budgets, int, "budgets"), args.device, args.repeats)
        return 0
    target = Path(args.target) if args.target else synthetic_llama(
        paths.cache_dir() / "synthetic" / "llama-small", **SYNTHETIC_SMALL)
    run_pass_table(target, common.parse_list(args.budgets, int, "budgets"), args.device, args.quant,
                   not args.no_disk, args.repeats)
    return 0


if __name__ == "__main__":
    folder, quant, offload = sys.argv[1:4]
    load_rss_child(folder, cast(Quant, quant), cast(Offload, offload))  # as measure_load_rss passed them
