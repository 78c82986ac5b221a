"""The model sections of `specchat bench gpu`: the hardware profile, the random 70B-shaped NF4
target and 1B-shaped draft, the streaming rate and overlap, and timed decoding steps under VRAM
caps compared with the planner.

Each public method of `Workbench` is one section: it takes a `Deadline` and a `partial`
callback (called with the result so far, so a run cut short keeps what it measured) and returns
a JSON-ready dict. How things are timed: bench_gpu_timing.

Without CUDA the same code runs on tiny shapes (the dry run): it proves the code paths, not the
speed. What this module does not do: run subprocesses, print tables or plot (bench_gpu,
bench_gpu_report).
"""

from __future__ import annotations

import functools
import gc
import logging
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Protocol

import torch

from engine.cli.bench_gpu_timing import (
    LayerClock,
    StepTimer,
    best,
    out_of_memory,
    pass_seconds,
    plain_copy_seconds,
    stream_only,
    sync,
)
from engine.loading.layer_plan import MaterialiseSettings, device_free_bytes, host_budget, plan_layers
from engine.loading.materialise import layer_template
from engine.testing.in_place import (
    llama_config,
    meta_model,
    random_model,
    random_outer,
    random_packed_store,
    streamed_target,
)
from engine.model.causal_lm import CausalLM
from engine.offload.layout import LayerLayout
from engine.offload.streamer import LayerHome, LayerStreamer
from engine.planning import planner
from engine.planning.calibration import AcceptanceCurve
from engine.planning.measure import measure_hardware
from engine.planning.placement import RING_SLOTS
from engine.planning.profile import HardwareProfile
from engine.store.catalog import load_catalog
from engine.shapes import LayerShape, ModelShape, Placement
from engine.types import default_expand_per_pass
from engine.units import GB, GIB

if TYPE_CHECKING:
    from transformers import PreTrainedModel

log = logging.getLogger(__name__)

TARGET_ID, DRAFT_ID = "llama-3.1-70b-instruct", "llama-3.2-1b-instruct"
# the dry run: the same code on shapes a CPU runs in milliseconds (NF4 needs multiples of 64)
DRY_TARGET = ModelShape("tiny 70B-shaped target", 6, LayerShape("tiny-target", 128, 384, 4, 2, 32), 512)
DRY_DRAFT = ModelShape("tiny 1B-shaped draft", 2, LayerShape("tiny-draft", 64, 128, 4, 2, 16), 512)
CONTEXT = 4096  # KV cache the placement reserves (the planner's predicted context)
PROMPT = 512  # tokens in the caches before the timed steps (the dry run: 32)
# Tokens per target pass measured by `specchat bench speculation` on the 2-core CPU (README,
# "Measured", 2026-11-22: SmolLM2-135M target, its FP4 proxy draft, 4 chat prompts, greedy,
# SpecExec rows). Random models accept ~1 token per pass, so tok/s needs real acceptance.
CPU_TOKENS_PER_PASS = {1: 1.72, 8: 3.57, 64: 5.88, 256: 6.90}


class Deadline(Protocol):
    def left(self) -> float: ...


Partial = Callable[[dict[str, Any]], None]


def cpu_tokens_per_pass(budget: int) -> tuple[float, str]:
    """(tokens per pass, where it comes from) for a budget, from CPU_TOKENS_PER_PASS: measured,
    interpolated in log2(budget), or held at the largest measured budget's figure beyond it."""
    table = sorted(CPU_TOKENS_PER_PASS.items())
    if budget in CPU_TOKENS_PER_PASS:
        return CPU_TOKENS_PER_PASS[budget], "CPU bench"
    if budget > table[-1][0]:
        return table[-1][1], f"CPU bench at {table[-1][0]} (held)"
    for (b0, a0), (b1, a1) in zip(table, table[1:]):
        if b0 < budget < b1:
            w = (math.log2(budget) - math.log2(b0)) / (math.log2(b1) - math.log2(b0))
            return a0 + w * (a1 - a0), "CPU bench (interpolated)"
    return table[0][1], f"CPU bench at {table[0][0]} (held)"


# ---- the workbench -------------------------------------------------------------------------------
@dataclass(frozen=True)
class RunSettings:
    device: torch.device
    dtype: torch.dtype
    tiny: bool  # tiny shapes and a quick profile: the CPU dry run (and the GPU smoke test)
    quick: bool
    layers: int | None  # decoder layers to build (None: all, or as RAM allows)
    budgets: tuple[int, ...]
    tokens: tuple[int, ...]  # streaming section: tokens per pass
    repeats: int


class Workbench:
    """The models and measurements shared by the sections of one run."""

    def __init__(self, settings: RunSettings) -> None:
        self.s = settings
        self.device = settings.device
        self.cuda = self.device.type == "cuda"
        self.profile: HardwareProfile | None = None
        self.target_shape, self.draft_shape = (DRY_TARGET, DRY_DRAFT) if settings.tiny else _catalog_shapes()
        self.hf: PreTrainedModel | None = None
        self.layout: LayerLayout | None = None
        self.store: Any = None
        self.draft: CausalLM | None = None
        self.layers = 0
        self.overhead = 0  # device memory this process holds outside the caching allocator

    # -- profile --
    def measure_profile(self, deadline: Deadline, partial: Partial) -> dict[str, Any]:
        """The hardware profile `bench hardware` measures (full, or quick with tiny shapes): the
        planner's inputs for every prediction below. Its disk test uses the models folder, as
        there, not DIR (whose files travel back from a device machine)."""
        profile = measure_hardware(layer_shape="llama-70b", quick=self.s.tiny)
        self.profile = profile
        gpu = profile.gpu
        return {"summary": profile.summary_lines(), "pinned_h2d_gbps": gpu.pinned_h2d_gbps if gpu else None,
                "copy_overlaps_compute": gpu.copy_overlaps_compute if gpu else None,
                "layer_timing": {"shape": profile.layer_timing.shape.name, "device": profile.layer_timing.device,
                                 "points": profile.layer_timing.points},
                "profile": profile.to_json()}

    # -- build --
    def build(self, deadline: Deadline, partial: Partial) -> dict[str, Any]:
        """The target: Llama-3.1-70B's shape, every decoder layer packed NF4 with random codes
        and scales written straight into (pinned) RAM; embeddings, norm and head real size and
        random on the device. The draft: Llama-3.2-1B's shape, random, resident."""
        t0 = time.perf_counter()
        full = self.target_shape.num_layers
        hf = meta_model(llama_config(self.target_shape), self.s.dtype)
        layout = LayerLayout.of(hf.model.layers[0], self.s.dtype, "nf4")
        fit = host_budget(None) // layout.nbytes
        n = min(self.s.layers or full, full, fit)
        if n < 2:
            raise RuntimeError(f"only {fit} NF4 layers of {layout.nbytes / GB:.2f} GB fit in the free RAM")
        if n != full:
            hf = meta_model(llama_config(replace(self.target_shape, num_layers=n)), self.s.dtype)
        self.store = random_packed_store(layout, n, pin=self.cuda, device=self.device)
        t_store = time.perf_counter() - t0
        random_outer(hf, self.device)
        self.hf, self.layout, self.layers = hf, layout, n
        self.draft = random_model(llama_config(self.draft_shape, tie_embeddings=True), self.device, self.s.dtype, seed=1)
        sync(self.device)
        outer = sum(p.numel() * p.element_size() for name, p in hf.named_parameters() if not p.is_meta)
        return {"target": self.target_shape.name, "draft": self.draft_shape.name, "layers_built": n,
                "layers_full": full, "layers_note": "" if n == full else f"{n} of {full} layers (RAM); figures "
                f"scaled to {full}", "layer_bytes": layout.nbytes, "dense_layer_bytes": layout.dense_nbytes,
                "host_bytes": n * layout.nbytes,
                "pinned": all(self.store.ram_buffer(j).is_pinned() for j in range(n)),  # every arena, not just one
                "outer_bytes_on_device": outer, "vocab": self.target_shape.vocab_size,
                "embeddings": f"{self.target_shape.vocab_size} x {self.target_shape.hidden_size}"
                + (" (tiny)" if self.s.tiny else " (the real vocabulary)") + ", random, on the device",
                "dtype": str(self.s.dtype).removeprefix("torch."),
                "draft_params": sum(p.numel() for p in self.draft.hf_model.parameters()),
                "store_seconds": t_store, "seconds": time.perf_counter() - t0}

    def _built(self) -> tuple[PreTrainedModel, LayerLayout]:
        if self.hf is None or self.layout is None or self.draft is None:
            raise RuntimeError("the models were not built (see the build section)")
        return self.hf, self.layout

    def _placement(self, gpu_layers: int) -> Placement:
        assert self.layout is not None
        return Placement(self.layers, gpu_layers, self.layers - gpu_layers, 0, self.layout.nbytes, "nf4",
                         "cuda" if self.cuda else "cpu")

    # -- streaming --
    def streaming(self, deadline: Deadline, partial: Partial) -> dict[str, Any]:
        """Every layer streamed from pinned RAM: a pass's host-to-device rate against a plain
        pinned copy of the same bytes from the same arenas, and how much of the copy hides
        behind compute (overlap = (copy + compute - both) / the smaller of the two)."""
        hf, layout = self._built()
        n, dev = self.layers, self.device
        t_plain = plain_copy_seconds(self.store, n, dev, self.s.repeats)
        moved = n * layout.nbytes
        result: dict[str, Any] = {"layers": n, "bytes_per_pass": moved, "plain_copy_s": t_plain,
                                  "plain_copy_gbps": moved / t_plain / GB, "rows": []}
        partial(result)
        streamed = streamed_target(hf, layout, self.store, self._placement(0), dev)
        one = self.store.ram_buffer(0).to(dev)  # every layer of the compute-only model runs from here
        still = LayerStreamer([LayerHome(packed=one)] * n, layout, None, layer_template(hf), dev, RING_SLOTS)
        try:
            self._stream_rows(streamed, CausalLM(hf, streamer=still, placement=self._placement(n)), t_plain,
                              deadline, result, partial)
        finally:
            assert streamed.streamer is not None
            streamed.streamer.close(close_store=False)
            still.close(close_store=False)
        del streamed, still, one
        self._free()
        rows = [r for r in result["rows"] if "pass_s" in r]
        bound = [r for r in rows if r["copy_bound"]] or rows
        if bound:
            result["goal_of_plain"] = min(r["of_plain"] for r in bound)
            result["goal_met"] = result["goal_of_plain"] >= 0.85
        return result

    def _stream_rows(self, streamed: CausalLM, resident: CausalLM, t_plain: float, deadline: Deadline,
                     result: dict[str, Any], partial: Partial) -> None:
        assert streamed.streamer is not None
        dev, reps, moved = self.device, self.s.repeats, result["bytes_per_pass"]
        clock = LayerClock(streamed.streamer, dev)
        for tokens in self.s.tokens:
            if deadline.left() <= 0:
                result["rows"].append({"tokens": tokens, "skipped": "time budget"})
                break
            clock.passes.clear()
            t_both = pass_seconds(streamed, tokens, reps, clock)
            t_alone = best(functools.partial(stream_only, streamed, tokens), dev, reps)
            t_compute = pass_seconds(resident, tokens, reps)
            overlap = (t_plain + t_compute - t_both) / min(t_plain, t_compute)
            result["rows"].append({
                "tokens": tokens, "pass_s": t_both, "pass_gbps": moved / t_both / GB, "of_plain": t_plain / t_both,
                "streamer_alone_s": t_alone, "streamer_alone_gbps": moved / t_alone / GB,
                "compute_only_s": t_compute, "copy_bound": t_compute <= t_plain,
                "overlap": max(0.0, min(1.0, overlap)), "streamed_layer_s": clock.split()[1]})
            partial(result)

    def _free(self) -> None:
        gc.collect()
        if self.cuda:
            torch.cuda.empty_cache()

    # -- caps --
    def cap(self, cap_gib: float, deadline: Deadline, partial: Partial) -> dict[str, Any]:
        """The card as a `cap_gib` GiB one: the caching allocator capped so that it and this
        process's memory outside it (CUDA context, libraries) stay within the cap; the loader's
        placement under it (the KV cache for CONTEXT tokens and the activations of the largest
        budget reserved); then autoregressive steps and SpecExec steps per budget."""
        hf, layout = self._built()
        assert self.draft is not None
        dev = self.device
        result: dict[str, Any] = {"cap_gib": cap_gib}
        self._free()
        if self.cuda:
            total = torch.cuda.mem_get_info(dev)[1]
            limit = int(cap_gib * GIB) - self._outside_allocator()
            if limit <= torch.cuda.memory_reserved(dev):
                raise RuntimeError(f"a {cap_gib:g} GiB card cannot even hold the embeddings, head and draft "
                                   f"({torch.cuda.memory_reserved(dev) / GIB:.1f} GiB)")
            if limit >= total:
                result["note"] = f"the card has only {total / GIB:.1f} GiB: no cap applied"
            torch.cuda.set_per_process_memory_fraction(min(1.0, limit / total), dev)
            result.update(allocator_limit_bytes=limit, outside_allocator_bytes=self.overhead,
                          device_free_bytes=device_free_bytes(dev), reserved_before_bytes=torch.cuda.memory_reserved(dev))
            settings = MaterialiseSettings(device=str(dev), dtype=self.s.dtype, quant="nf4", offload="auto",
                                           ram_limit_bytes=self.layers * layout.nbytes, context_length=CONTEXT,
                                           max_budget=max(self.s.budgets))
            placement = plan_layers(hf, layout, settings, "nf4")
        else:  # no memory to cap: resident share as on a GPU, half the layers for 24 GiB
            placement = self._placement(min(self.layers, round(self.layers * cap_gib / 48)))
            result["note"] = "dry run: no GPU to cap; the resident share is scaled from the cap"
        result.update(placement=placement.describe(), gpu_layers=placement.gpu_layers, ram_layers=placement.ram_layers,
                      disk_layers=placement.disk_layers)
        partial(result)
        target = streamed_target(hf, layout, self.store, placement, dev)
        try:
            self._steps(target, placement, deadline, result, partial)
        finally:
            if target.streamer is not None:
                target.streamer.close(close_store=False)
            del target
            self._free()
            if self.cuda:
                result["peak_reserved_bytes"] = torch.cuda.max_memory_reserved(dev)
                torch.cuda.set_per_process_memory_fraction(1.0, dev)
                torch.cuda.reset_peak_memory_stats(dev)
        return result

    def _outside_allocator(self) -> int:
        """What this process holds on the device outside the caching allocator (the CUDA
        context, cuBLAS and kernels), measured once after work that loads them: a real card of
        the cap's size pays the same."""
        if not self.overhead:
            a = torch.randn(256, 256, device=self.device, dtype=self.s.dtype)
            (a @ a).sum().item()
            self._free()
            free, total = torch.cuda.mem_get_info(self.device)
            self.overhead = max(0, total - free - torch.cuda.memory_reserved(self.device))
            torch.cuda.reset_peak_memory_stats(self.device)
        return self.overhead

    def _steps(self, target: CausalLM, placement: Placement, deadline: Deadline, result: dict[str, Any],
               partial: Partial) -> None:
        assert self.draft is not None
        budgets, reps = self.s.budgets, self.s.repeats
        timer = StepTimer(target, self.draft, 32 if self.s.tiny else PROMPT, (len(budgets) + 1) * (reps + 1),
                          max(budgets))
        rows: list[dict[str, Any]] = []
        result["rows"] = rows
        for budget in (0, *budgets):
            mode = "specexec" if budget else "autoregressive"
            if deadline.left() <= 0:
                rows.append({"mode": mode, "budget": budget, "skipped": "time budget"})
                continue
            draft_length = timer.dcache.length
            step = functools.partial(timer.speculative, budget) if budget else timer.autoregressive
            try:
                step()  # warm-up: kernels for this size, the allocator
                timer.clock.passes.clear()
                measured = [step() for _ in range(reps)]
            except (torch.OutOfMemoryError, RuntimeError) as exc:
                if not out_of_memory(exc):
                    raise
                timer.rollback(draft_length)
                self._free()
                rows.append({"mode": mode, "budget": budget, "error": f"out of memory under the {result['cap_gib']:g} "
                             "GiB cap"})
                partial(result)
                continue
            rows.append(self._row(budget, measured, timer.clock, placement))
            partial(result)
        plan = planner.plan_for_pair(self.profile, target.shape, self.draft.shape, placement, {}, AcceptanceCurve(),
                                     budgets) if self.profile is not None else None
        if plan is not None:
            result["planner_choice"] = (plan.mode + (f", budget {plan.budget}" if plan.budget else "")
                                        + f": {plan.tokens_per_second:.2f} tok/s predicted (prior acceptance curve)")

    def _row(self, budget: int, measured: list[dict[str, float]], clock: LayerClock,
             placement: Placement) -> dict[str, Any]:
        assert self.draft is not None and self.layout is not None
        med = {k: statistics.median(m[k] for m in measured) for k in measured[0]}
        step_s = med["draft_s"] + med["target_s"] + med["other_s"]
        resident_s, streamed_s = clock.split()
        if budget:
            tpp, source = cpu_tokens_per_pass(budget)
        else:
            tpp, source = 1.0, "autoregressive"
        row: dict[str, Any] = {"mode": "specexec" if budget else "autoregressive", "budget": budget, "steps": len(measured),
                               **med, "step_s": step_s, "resident_layer_s": resident_s, "streamed_layer_s": streamed_s,
                               "tokens_per_pass": tpp, "tokens_per_pass_source": source, "tok_s": tpp / step_s}
        shape = replace(self.target_shape, num_layers=self.layers)
        if self.profile is not None:
            p = self.profile
            nodes = int(med["tree_nodes"])
            pred_t = planner.target_pass_seconds(p, shape, placement, nodes)
            if not budget:
                pred_t += planner.head_seconds(p, shape, 1)
            pred_d = med["draft_passes"] * planner.draft_pass_seconds(p, self.draft_shape, default_expand_per_pass(budget)) \
                if budget else 0.0
            compute = planner.compute_seconds(p, shape.layer_params, nodes, "nf4")
            copy = placement.layer_bytes / (p.gpu.pinned_h2d_gbps * GB) if p.gpu else \
                placement.layer_bytes / (p.ram_copy_gbps * GB)
            overhead = planner.STEP_OVERHEAD_S if budget else planner.AR_OVERHEAD_S
            row.update(pred_target_s=pred_t, target_ratio=med["target_s"] / pred_t, pred_draft_s=pred_d,
                       draft_ratio=med["draft_s"] / pred_d if pred_d else None,
                       pred_resident_layer_s=compute,
                       pred_streamed_layer_s=max(copy, compute) if p.gpu and p.gpu.copy_overlaps_compute else copy + compute,
                       pred_tok_s=tpp / (pred_d + pred_t + (tpp * planner.head_seconds(p, shape, 1) if budget else 0.0)
                                         + overhead))
        full = self.target_shape.num_layers
        if self.layers < full and streamed_s is not None:  # the missing layers would all stream
            row["scaled_step_s"] = step_s + (full - self.layers) * streamed_s
            row["scaled_tok_s"] = tpp / row["scaled_step_s"]
        return row

    def close(self) -> None:
        if self.store is not None:
            self.store.close()
        self.hf = self.draft = self.store = None
        self._free()


def _catalog_shapes() -> tuple[ModelShape, ModelShape]:
    catalog = load_catalog()
    target, draft = catalog.find(TARGET_ID), catalog.find(DRAFT_ID)
    assert target is not None and draft is not None, "the catalog lost its Llama entries"
    return target.shape(), draft.shape()
