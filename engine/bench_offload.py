"""`specchat bench offload`: what streaming layers costs, and what loading takes in RAM.

Pass table: for each budget (tokens in one target pass over a 64-token context), the pass time
of the resident model, of the same weights streamed from RAM through the ring (--offload all),
and from the disk tier (RAM capped to zero), with streamed / resident ratios. On CUDA it also
prints the host-to-device rate a streamed pass achieves against a plain pinned copy of the
same bytes. The model is --target, or a synthetic Llama written on first use (random bf16
shards, never committed).

--load-rss measures peak RSS while loading (in a fresh subprocess, so the figure is the load's
own): the synthetic ~1.5 GB bf16 Llama in several shards, loaded with --quant.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from . import paths
from .loading import LoadedModel, load_model

SYNTHETIC_BIG = dict(hidden=2048, intermediate=5632, layers=14, vocab=32000, heads=16, kv_heads=4)  # ~1.5 GB bf16
SYNTHETIC_SMALL = dict(hidden=512, intermediate=1408, layers=8, vocab=8000, heads=8, kv_heads=4)  # ~45 MB bf16


def synthetic_llama(folder: Path, hidden: int, intermediate: int, layers: int, vocab: int, heads: int,
                    kv_heads: int, layers_per_shard: int = 4, seed: int = 0) -> Path:
    """Write a random bf16 Llama checkpoint (config, tokenizer, several shards) shard by shard,
    so writing it never holds more than one shard. Idempotent."""
    if (folder / "config.json").is_file():
        return folder
    from safetensors.torch import save_file
    from transformers import LlamaConfig

    from .testmodels import tiny_tokenizer_files

    folder.mkdir(parents=True, exist_ok=True)
    tiny_tokenizer_files(folder)
    g = torch.Generator().manual_seed(seed)
    head_dim = hidden // heads

    def rand(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * 0.02).to(torch.bfloat16)

    shards: list[dict[str, torch.Tensor]] = [{"model.embed_tokens.weight": rand(vocab, hidden)}]
    for i in range(layers):
        if i % layers_per_shard == 0:
            shards.append({})
        p = f"model.layers.{i}."
        shards[-1].update({
            p + "self_attn.q_proj.weight": rand(hidden, hidden),
            p + "self_attn.k_proj.weight": rand(kv_heads * head_dim, hidden),
            p + "self_attn.v_proj.weight": rand(kv_heads * head_dim, hidden),
            p + "self_attn.o_proj.weight": rand(hidden, hidden),
            p + "mlp.gate_proj.weight": rand(intermediate, hidden),
            p + "mlp.up_proj.weight": rand(intermediate, hidden),
            p + "mlp.down_proj.weight": rand(hidden, intermediate),
            p + "input_layernorm.weight": torch.ones(hidden, dtype=torch.bfloat16),
            p + "post_attention_layernorm.weight": torch.ones(hidden, dtype=torch.bfloat16),
        })
        if len(shards) > 2:  # write finished shards as we go
            _write_shard(folder, shards.pop(1), save_file)
    shards[-1].update({"model.norm.weight": torch.ones(hidden, dtype=torch.bfloat16), "lm_head.weight": rand(vocab, hidden)})
    for shard in shards:
        _write_shard(folder, shard, save_file)
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=4096,
                         tie_word_embeddings=False, bos_token_id=0, eos_token_id=2)
    config.save_pretrained(folder)
    return folder


def _write_shard(folder: Path, tensors: dict[str, torch.Tensor], save_file) -> None:  # type: ignore[no-untyped-def]
    n = len(list(folder.glob("model-*.safetensors")))
    save_file(tensors, str(folder / f"model-{n:05d}.safetensors"), metadata={"format": "pt"})


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
    return nbytes / statistics.median(times[1:]) / 1e9


def run_pass_table(target: Path, budgets: list[int], device: str, quant: str, disk: bool, repeats: int) -> list[dict]:
    from .loading import resolve_device

    dev, dtype = resolve_device(device)
    kinds = {"resident": dict(offload="none"), "streamed": dict(offload="all")}
    if disk:
        kinds["disk"] = dict(offload="all", ram_limit_bytes=0)
    models = {k: load_model(target, dev, dtype, quant=quant, **kw) for k, kw in kinds.items()}  # type: ignore[arg-type]
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
          f"{(placement.layer_bytes if placement else 0) / 2**20:.1f} MiB per streamed layer ({quant}), device {dev}")
    head = f"{'budget':>6} {'resident s':>11} {'streamed s':>11} {'ratio':>6}"
    head += f" {'disk s':>9} {'ratio':>6}" if disk else ""
    print(head)
    for r in rows:
        line = f"{r['budget']:>6} {r['resident']:>11.4f} {r['streamed']:>11.4f} {r['ratio']:>6.2f}"
        line += f" {r['disk']:>9.4f} {r['disk_ratio']:>6.2f}" if disk else ""
        print(line)
    if dev == "cuda" and placement is not None:
        moved = placement.layer_bytes * (placement.num_layers - placement.gpu_layers)
        achieved = moved / min(r["streamed"] for r in rows) / 1e9
        plain = pinned_copy_gbps(moved, torch.device("cuda"))
        print(f"host-to-device: streamed pass {achieved:.1f} GB/s, plain pinned copy {plain:.1f} GB/s "
              f"({100 * achieved / plain:.0f} %)")
    return rows


# ---- peak RSS of a load ------------------------------------------------------------------------
_CHILD = r"""
import json, sys, time, torch
torch.set_num_threads(1)
from engine.loading import load_model
import transformers, bitsandbytes  # imported before the baseline: part of the fixed overhead

def status(key):  # kB fields of /proc/self/status (VmHWM is per process image, unlike ru_maxrss,
    for line in open("/proc/self/status"):  # which a child inherits from the parent across exec)
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024

base = status("VmRSS")
with open("/proc/self/clear_refs", "w") as f:  # reset the high-water mark to the current RSS
    f.write("5")
folder, quant, offload = sys.argv[1], sys.argv[2], sys.argv[3]
t0 = time.perf_counter()
m = load_model(folder, "cpu", torch.float32, quant=quant, offload=offload)
seconds = time.perf_counter() - t0
peak = status("VmHWM")
p = m.model.placement
outer = sum(t.numel() * t.element_size() for n, t in m.model.hf_model.named_parameters() if not t.is_meta
            and not n.startswith("model.layers."))
print(json.dumps(dict(base=base, peak=peak, final=status("VmRSS"), layers_bytes=p.layer_bytes * p.num_layers,
                      layer_bytes=p.layer_bytes, outer_bytes=outer, placement=p.describe(), seconds=seconds)))
"""


def measure_load_rss(folder: Path, quant: str = "nf4", offload: str = "none", cache_dir: Path | None = None) -> dict:
    """Peak RSS of loading `folder` on CPU, in a fresh interpreter (Linux: /proc). Returns base
    (after imports), peak, final, the final footprint parts (packed layers, outer weights) and
    seconds. `cache_dir` is the child's SPECCHAT_CACHE_DIR (the prepared-layer cache): a fresh
    folder by default, so the load reads the checkpoint."""
    import tempfile

    root = Path(__file__).resolve().parent.parent
    with tempfile.TemporaryDirectory(prefix="specchat-rss-") as tmp:
        env = {**_env(), "OMP_NUM_THREADS": "1", "SPECCHAT_CACHE_DIR": str(cache_dir or tmp)}
        out = subprocess.run([sys.executable, "-c", _CHILD, str(folder), quant, offload], capture_output=True,
                             text=True, cwd=root, env=env, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def _env() -> dict[str, str]:
    import os

    return dict(os.environ)


def print_load_rss(folder: Path, quant: str) -> None:
    import tempfile

    mb = 2**20
    ckpt = sum(f.stat().st_size for f in folder.glob("*.safetensors"))
    print(f"checkpoint {ckpt / mb:.0f} MiB bf16 in {len(list(folder.glob('*.safetensors')))} shards, loaded on CPU "
          f"with --quant {quant}")
    with tempfile.TemporaryDirectory(prefix="specchat-prepared-") as cache:
        for label in ("first start", "second start (prepared cache)" if quant == "nf4" else "second start"):
            r = measure_load_rss(folder, quant, cache_dir=Path(cache))
            footprint = r["layers_bytes"] + r["outer_bytes"]
            print(f"{label}: {r['seconds']:.1f} s; {r['placement']}")
            print(f"  RSS after imports {r['base'] / mb:.0f} MiB; the load adds {(r['peak'] - r['base']) / mb:.0f} MiB "
                  f"at peak, {(r['final'] - r['base']) / mb:.0f} MiB at the end")
            print(f"  final footprint {footprint / mb:.0f} MiB (layers {r['layers_bytes'] / mb:.0f} + embeddings/head "
                  f"{r['outer_bytes'] / mb:.0f}); peak excess over it {(r['peak'] - r['base'] - footprint) / mb:.0f} MiB; "
                  f"one packed layer {r['layer_bytes'] / mb:.1f} MiB")


def add_offload_bench(bench: argparse.ArgumentParser) -> None:
    kinds = next(a for a in bench._actions if isinstance(a, argparse._SubParsersAction))
    p = kinds.add_parser("offload", help="streamed vs resident pass time; peak RSS of a load",
                         description="Pass time of the resident vs streamed (and disk-tier) target per budget; "
                         "with --load-rss, peak RSS of loading a synthetic ~1.5 GB Llama.")
    p.add_argument("--target", metavar="MODEL", help="a model folder (default: a synthetic Llama)")
    p.add_argument("--budgets", default="1,4,16,64,256", metavar="LIST")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument("--quant", choices=("none", "nf4"), default="none")
    p.add_argument("--no-disk", action="store_true", help="skip the disk-tier column")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument("--load-rss", action="store_true", help="measure peak RSS of loading the ~1.5 GB synthetic Llama")
    p.set_defaults(handler=run_bench_offload)


def run_bench_offload(args: argparse.Namespace) -> int:
    from .bench import _parse_list

    if args.threads:
        torch.set_num_threads(args.threads)
    if args.load_rss:
        folder = synthetic_llama(paths.cache_dir() / "synthetic" / "llama-1.5g", **SYNTHETIC_BIG)  # type: ignore[arg-type]
        print_load_rss(folder, args.quant)
        return 0
    target = Path(args.target) if args.target else synthetic_llama(
        paths.cache_dir() / "synthetic" / "llama-small", **SYNTHETIC_SMALL)  # type: ignore[arg-type]
    run_pass_table(target, _parse_list(args.budgets, int, "budgets"), args.device, args.quant,
                   not args.no_disk, args.repeats)
    return 0
