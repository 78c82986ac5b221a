"""`specchat bench gpu --out DIR`: the command that measures the GPU path and leaves the numbers
for the README's GPU part. From a checkout, scripts/gpu_proof.py runs it after the gpu-marked
tests and the installer's check, in the same report (an installed copy has neither).

Sections, in this order, each with its own time budget; each records its own error and the
rest still run, and DIR/gpu_bench.json is rewritten whenever one records something (a run cut
short keeps what it measured):

  environment  the packages the engine needs and their versions, the device, the RAM
  (a caller's sections: scripts/gpu_proof.py's tests and installer)
  lean         a one-token step's and an 8-token pass's cost a layer beyond the weights, general
               path against the lean step's CUDA graphs (engine.cli.bench_gpu_lean), three tiny models
  profile      the hardware profile `bench hardware` measures: the planner's inputs
  build        the Llama-3.1-70B-shaped target in NF4 with random codes straight into pinned RAM,
               the Llama-3.2-1B-shaped random draft on the device
  streaming    a streamed pass's host-to-device rate against a plain pinned copy of the same
               bytes (goal: >= 85 %), and the copy/compute overlap
  caps         per VRAM cap (24 and 12 GiB): the loader's placement under the cap, autoregressive
               and SpecExec steps per budget, pass times against the planner (goal: within
               20 %), and tok/s with tokens per pass from the CPU benchmark

Then a table on stdout and DIR/gpu_bench.png. Without CUDA (or with --device cpu) the same
sections run on tiny shapes in seconds: the dry run, which proves the code paths and says that
GPU figures need a GPU. Exit status 1 when a section failed or a gpu test failed.

The model sections live in bench_gpu_passes and are imported only when they run, so a missing
package (bitsandbytes, say) fails those sections and leaves the others' results.
"""

from __future__ import annotations

import argparse
import functools
import importlib.metadata
import json
import logging
import os
import platform
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

from engine.cli.bench_gpu_report import format_summary, write_plot
from engine.cli.parser import HANDLER
from engine.errors import InvalidRequest
from engine.threads import set_threads

log = logging.getLogger(__name__)

JSON_NAME, PNG_NAME, TESTS_LOG = "gpu_bench.json", "gpu_bench.png", "gpu_tests.log"
SECTIONS = ("lean", "profile", "streaming", "caps")
PACKAGES = ("torch", "transformers", "bitsandbytes", "huggingface-hub", "httpx2", "safetensors", "tokenizers",
            "accelerate", "psutil", "platformdirs", "nvidia-ml-py", "gguf", "matplotlib", "pytest")
# seconds per section (full, quick); the run also stops starting work at --max-minutes
BUDGETS = {"lean": (120, 90), "profile": (180, 120), "build": (300, 240),
           "streaming": (150, 60), "cap": (240, 120)}
FULL_BUDGETS, QUICK_BUDGETS, DRY_BUDGETS = (64, 128, 256, 512, 1024, 2048), (64, 512, 2048), (4, 16)
FULL_TOKENS, QUICK_TOKENS, DRY_TOKENS = (1, 256, 2048), (1, 2048), (1, 16)


@dataclass(frozen=True)
class Deadline:
    end: float

    def left(self) -> float:
        return self.end - time.monotonic()


class Report:
    """DIR/gpu_bench.json: a header, then one entry per section with its status, seconds,
    result (also a partial one) and error; written atomically after every change."""

    def __init__(self, out: Path, head: dict[str, Any], end: float) -> None:
        self.path = out / JSON_NAME
        self.data: dict[str, Any] = {**head, "sections": {}}
        self.end = end  # the whole run's deadline (time.monotonic)
        self.save()

    def save(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data, indent=1, default=str), encoding="utf-8")
        os.replace(tmp, self.path)  # a reader (or a run killed now) never sees half a file

    def section(self, name: str, budget_s: float, fn: Callable[[Deadline, Callable[[dict], None]], dict]) -> dict | None:
        """Run one section under min(its budget, the run's time left); return its result, or
        None when it failed or was skipped (the entry says why)."""
        entry: dict[str, Any] = {"status": "running", "budget_s": budget_s}
        self.data["sections"][name] = entry
        left = self.end - time.monotonic()
        if left <= 0:
            entry["status"] = "skipped"
            entry["error"] = "the run's time limit (--max-minutes) was reached"
            self.save()
            return None
        print(f"[bench gpu] {name} ...", file=sys.stderr, flush=True)
        self.save()

        def partial(result: dict) -> None:
            entry["result"] = result
            self.save()

        t0 = time.perf_counter()
        try:
            entry["result"] = fn(Deadline(time.monotonic() + min(budget_s, left)), partial)
            entry["status"] = "ok"
        except KeyboardInterrupt:
            entry["status"] = "interrupted"
            raise
        except Exception as exc:  # noqa: BLE001 -- one section's failure is its result; the rest run
            log.debug("section %s failed", name, exc_info=True)
            entry["status"] = "error"
            entry["error"] = f"{type(exc).__name__}: {exc}"
            entry["traceback"] = traceback.format_exc()[-4000:]
            print(f"[bench gpu] {name} failed: {entry['error']}", file=sys.stderr, flush=True)
        finally:
            entry["seconds"] = time.perf_counter() - t0
            self.save()
        return entry.get("result") if entry["status"] == "ok" else None


# ---- the sections that need no model -------------------------------------------------------------
def environment(dry_run: bool) -> dict[str, Any]:
    versions: dict[str, str | None] = {}
    for name in PACKAGES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    out: dict[str, Any] = {"python": sys.version.split()[0], "platform": platform.platform(), "cpus": os.cpu_count(),
                           "packages": versions, "missing": [n for n, v in versions.items() if v is None],
                           "torch_cuda": torch.version.cuda, "cuda_available": torch.cuda.is_available(),
                           "dry_run": dry_run}
    try:
        import psutil

        vm = psutil.virtual_memory()
        out.update(ram_total=vm.total, ram_available=vm.available)
    except ImportError:
        pass
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        free, total = torch.cuda.mem_get_info(0)
        out.update(device=props.name, capability=f"{props.major}.{props.minor}", multiprocessors=props.multi_processor_count,
                   memory_total=total, memory_free=free, bf16=torch.cuda.is_bf16_supported())
    return out


# ---- the command ------------------------------------------------------------------------------------
def device_choice(choice: str) -> tuple[str, torch.dtype]:
    """--device -> (device, compute dtype), as the loader resolves it (engine.loading.load,
    not imported here: it needs bitsandbytes, which the environment section reports on)."""
    if choice == "cuda" and not torch.cuda.is_available():
        raise InvalidRequest("PyTorch sees no CUDA GPU here (a CPU-only build of torch, or no driver); "
                             "leave out --device cuda for the CPU dry run.")
    if choice == "cpu" or not torch.cuda.is_available():
        return "cpu", torch.float32
    return "cuda", torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16


Section = tuple[str, float, Callable[[Deadline, Callable[[dict], None]], dict]]  # name, budget s, fn


def run_bench_gpu(args: argparse.Namespace, before: Sequence[Section] = ()) -> int:
    """The command. `before`: sections a caller runs first, in the same report (from a
    checkout, scripts/gpu_proof.py adds the gpu-marked tests and the installer's check)."""
    device, dtype = device_choice(args.device)
    dry = device == "cpu"
    quick = bool(args.quick)
    if args.threads:
        set_threads(args.threads)
    budgets = tuple(args.budgets or (DRY_BUDGETS if dry else QUICK_BUDGETS if quick else FULL_BUDGETS))
    caps = tuple(args.caps or ((24.0,) if quick and not dry else (24.0, 12.0)))
    sections = [s for s in args.only or SECTIONS if s not in args.skip]
    minutes = args.max_minutes or (6.0 if quick else 18.0)
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    end = time.monotonic() + 60 * minutes
    if dry:
        print("No CUDA GPU here: this is the CPU dry run on tiny shapes (seconds). It checks the code paths; "
              "GPU figures need a GPU.", file=sys.stderr)
    head = {"version": 1, "started": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "options": {k: v for k, v in vars(args).items() if k != HANDLER}, "mode": "cpu dry run" if dry else "gpu",
            "quick": quick, "sections_asked": sections, "caps_gib": caps, "budgets": budgets, "max_minutes": minutes}
    report = Report(out, head, end)
    pick = 1 if quick else 0
    report.section("environment", 30, lambda d, p: environment(dry))
    for name, budget_s, fn in before:
        report.section(name, budget_s, fn)
    if "lean" in sections:
        report.section("lean", BUDGETS["lean"][pick], functools.partial(_lean, device, dtype, dry))
    if {"profile", "streaming", "caps"} & set(sections):
        _model_sections(report, args, sections, caps, budgets, quick, dry, device, dtype, pick)
    report.data["finished"] = datetime.now(timezone.utc).isoformat(timespec="seconds")
    png = None
    try:
        png = write_plot(report.data, out / PNG_NAME)
    except Exception as exc:  # noqa: BLE001 -- a plot must not cost the numbers
        report.data["plot_error"] = f"{type(exc).__name__}: {exc}"
    report.data["files"] = [JSON_NAME] + ([PNG_NAME] if png else []) + ([TESTS_LOG] if (out / TESTS_LOG).exists() else [])
    report.save()
    print(format_summary(report.data))
    print(f"wrote {', '.join(str(out / f) for f in report.data['files'])}")
    states = report.data["sections"].values()
    failed_tests = (report.data["sections"].get("tests", {}).get("result") or {}).get("counts", {}).get("failed", 0)
    return 1 if any(s["status"] == "error" for s in states) or failed_tests else 0


def _model_sections(report: Report, args: argparse.Namespace, sections: list[str], caps: tuple[float, ...],
                    budgets: tuple[int, ...], quick: bool, dry: bool, device: str, dtype: torch.dtype, pick: int) -> None:
    try:
        from engine.cli import bench_gpu_passes as passes
        from engine.cli.common import quiet_libraries

        quiet_libraries(args.verbose)
        # an explicit index: the per-process memory cap API refuses a bare "cuda"
        dev = torch.device("cuda", torch.cuda.current_device()) if device == "cuda" else torch.device("cpu")
        bench = passes.Workbench(passes.RunSettings(
            device=dev, dtype=dtype, tiny=dry, quick=quick, layers=args.layers, budgets=budgets,
            tokens=DRY_TOKENS if dry else QUICK_TOKENS if quick else FULL_TOKENS,
            repeats=1 if dry else 2 if quick else 3))
    except Exception as exc:  # noqa: BLE001 -- a missing package (bitsandbytes, say): each model section says so
        for name in ("profile", "build", "streaming", *(f"cap {c:g} GiB" for c in caps)):
            report.section(name, 1, lambda d, p: _raise(exc))  # run at once, inside this except
        return
    try:
        if "profile" in sections or "caps" in sections:  # the caps compare against it
            report.section("profile", BUDGETS["profile"][pick], bench.measure_profile)
        if not {"streaming", "caps"} & set(sections) or report.section("build", BUDGETS["build"][pick],
                                                                    bench.build) is None:
            return
        if "streaming" in sections:
            report.section("streaming", BUDGETS["streaming"][pick], bench.streaming)
        if "caps" in sections:
            for cap in caps:
                report.section(f"cap {cap:g} GiB", BUDGETS["cap"][pick], functools.partial(bench.cap, cap))
    finally:
        bench.close()


def _raise(exc: BaseException) -> dict:
    raise exc


def _lean(device: str, dtype: torch.dtype, dry: bool, deadline: Deadline, partial: Callable[[dict], None]) -> dict:
    from engine.cli.bench_gpu_lean import lean_section

    dev = torch.device("cuda", torch.cuda.current_device()) if device == "cuda" else torch.device("cpu")
    return lean_section(dev, dtype, dry)
