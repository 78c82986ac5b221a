"""A projection, not a measurement: the planner's prediction for a 2026 MoE model on consumer
machines no session of this project has, beside the figure users would compare it with
(`specchat bench plan --moe`, issue 31's "planner projection").

The model: Qwen3.6-35B-A3B as a GGUF of 4-bit experts, its shape from transformers'
Qwen3_5MoeTextConfig defaults (documented there as the Qwen3.5-35B-A3B checkpoint; Qwen3.6-35B-A3B
keeps that architecture: 40 layers, 3 of 4 Gated DeltaNet, 256 experts of width 512, 8 a token,
one shared expert, a 248,320-token vocabulary). The machines: reference GPUs from datasheet
figures (engine.planning.reference), 64 GB of DDR5, and a desktop CPU whose packed-expert read
speed is not known here, so it is a column: 30, 45 and 60 GB/s (dual-channel DDR5-5600 peaks at
89.6 GB/s; this project's 2 server cores read 19 GB/s, 10 per core, `specchat bench hardware`),
its further-token rows this project's per-core rate over CPU_THREADS cores.

The last column: from how many tokens a pass copying its experts' union over the link to the GPU
(file bytes, de-quantised there) beats the CPU running them (planner.stream_pays_from): the
issue's "stream a layer's needed experts only when the union makes that cheaper".

Placement as the loader's `--experts auto` does it (the model does not fit the GPU): attention,
router, shared expert, head and caches on the GPU, the routed experts packed in RAM and run by
the CPU kernel after each layer's GPU part, and as many experts as the GPU memory left holds
cached there in 16 bits, computed beside the CPU's (engine.kernels.expert_cache). The tree: a draft that costs one
decoder layer of the target plus its head on the GPU per pass (what a model's own MTP head
costs), with the planner's prior acceptance curve: an assumption, labelled as such.

The figure to beat: llama.cpp with `--n-cpu-moe` runs Qwen3-30B-A3B Q4_K_M at 36.7 tok/s on an
8 GB RTX 2080 (the issue's cited measurement); its experts are larger than this model's (48
layers of 8 x 3 x 2048 x 768 a token against 40 of 8 x 3 x 2048 x 512).

`overhead_sensitivity` holds everything but a decoder layer's cost on the GPU beyond its bytes
and FLOPs: the general path's measured 0.86 ms (engine.planning.reference), and less, down to
none. The lean step (engine.model.lean_step: CUDA graphs, one launch a run of layers between routed
experts) exists for that cost; `specchat bench gpu --only lean` measures what it leaves of it, a
hardware profile measured on a GPU keeps it for the planner (engine.planning.lean_timing), and no
session has had a GPU since it was written. The table says what such a figure would buy and what
it cannot: with no overhead at all the CPU's experts still set the pace.

What this module does not do: measure anything, or claim its figures were measured.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

from engine.planning import planner
from engine.planning.calibration import AcceptanceCurve
from engine.planning.profile import ExpertTiming, HardwareProfile
from engine.planning.reference import GPU_LAYER_OVERHEAD_S, reference_profile
from engine.shapes import ModelShape, Placement

MODEL = "Qwen3.6-35B-A3B (GGUF, 4-bit experts)"
LLAMA_CPP_TOK_S = 36.7  # Qwen3-30B-A3B Q4_K_M, llama.cpp --n-cpu-moe, RTX 2080 8 GB (issue 31)
EXPERT_READ_GBPS = (30.0, 45.0, 60.0)
CPU_THREADS = 8
# a further token's expert row per weight on one of this project's cores: 1.43e-11 at 2 threads
# (measure.expert_timing, 2-4 tokens an expert: the integer rows, 128 codes at a time since the
# ninth session; it was 4.6e-11 a core through the 64-code rows)
ROW_S_PER_PARAM_ONE_THREAD = 2.9e-11
FILE_BYTES_PER_PARAM = 0.6  # Q4_K_M experts in the file (what llama.cpp reads) against the kernel's 0.62
BUDGETS = (1, 2, 4, 8, 16, 32, 64, 128)
OVERHEADS_S = (GPU_LAYER_OVERHEAD_S, 4e-4, 2e-4, 1e-4, 0.0)  # a GPU layer's cost beyond its bytes and FLOPs: the measured
# general path's, then what a leaner step might leave


@dataclass(frozen=True)
class Machine:
    label: str
    gpu: str  # a REFERENCE_GPUS key
    pcie_gbps: float
    ram_gb: float


MACHINES = (
    Machine("RTX 4060 Ti 16 GB (PCIe 4 x8), 64 GB DDR5", "rtx4060ti-16gb", 13.0, 64.0),
    Machine("RTX 2080 8 GB (PCIe 3 x16), 64 GB DDR5", "rtx2080-8gb", 12.0, 64.0),
)


@dataclass(frozen=True)
class ProjectionRow:
    machine: str
    expert_gbps: float
    experts_at: str  # "kernel bytes" (as SpecChat holds them) or "file bytes" (a K-quant layout, not built)
    placement: str
    autoregressive: float  # tok/s
    best: float  # tok/s of the planner's choice (autoregressive when no tree pays)
    budget: int  # 0: autoregressive
    tokens_per_pass: float
    stream_from: int | None = None  # tokens a pass from which streaming its experts beats the CPU (None: never)
    cached: float = 0.0  # the share of routed experts the GPU memory left caches (engine.kernels.expert_cache)

    @property
    def tree_share(self) -> float:
        """The share of `best` the tree adds over autoregressive decoding."""
        return 1.0 - self.autoregressive / self.best if self.best > 0 else 0.0

    @property
    def vs_llama_cpp(self) -> float:
        return self.best / LLAMA_CPP_TOK_S


def target_shape() -> ModelShape:
    from transformers.models.qwen3_5_moe.configuration_qwen3_5_moe import Qwen3_5MoeTextConfig  # noqa: PLC0415

    return ModelShape.from_config(Qwen3_5MoeTextConfig(), "qwen3.6-35b-a3b")


def mtp_draft_pass(profile_gpu: planner.HardwareProfile, target: ModelShape) -> Callable[[int], float]:
    """Seconds of one draft pass over `nodes`: one decoder layer of the target's active size and
    the target's head, on the GPU."""
    layer = dataclasses.replace(target, experts=None, num_layers=1,
                                layer=dataclasses.replace(target.layer, intermediate_size=target.activation_width))
    return lambda nodes: planner.draft_pass_seconds(profile_gpu, layer, nodes)


def _plan(machine: Machine, read: float, target: ModelShape,
          overhead_s: float = GPU_LAYER_OVERHEAD_S) -> tuple[Placement, planner.Plan, HardwareProfile]:
    timing = ExpertTiming(1, 1, read, ROW_S_PER_PARAM_ONE_THREAD / CPU_THREADS, CPU_THREADS)
    profile = reference_profile(machine.gpu, pinned_gbps=machine.pcie_gbps, ram_gb=machine.ram_gb, cpu_experts=timing,
                                layer_overhead_s=overhead_s)
    placement = planner.estimate_placement(profile, target, "gguf")
    plan = planner.choose_budget(profile, target, target, placement, AcceptanceCurve(), budgets=BUDGETS,
                                 draft_pass=mtp_draft_pass(profile, target))
    return placement, plan, profile


def project(machines: tuple[Machine, ...] = MACHINES, gbps: tuple[float, ...] = EXPERT_READ_GBPS) -> list[ProjectionRow]:
    target = target_shape()
    rows = []
    for machine in machines:
        for read in gbps:
            for experts_at, scale in (("kernel bytes", 1.0),
                                      ("file bytes", planner.KERNEL_EXPERT_BYTES_PER_PARAM / FILE_BYTES_PER_PARAM)):
                placement, plan, profile = _plan(machine, read * scale, target)
                best = max(plan.curve, key=lambda p: p.tokens_per_second)
                rows.append(ProjectionRow(machine.label, read, experts_at, placement.describe(),
                                          plan.autoregressive_tokens_per_second, plan.tokens_per_second,
                                          plan.budget, best.tokens_per_pass if plan.budget else 1.0,
                                          planner.stream_pays_from(profile, target), placement.cached_experts))
    return rows


def overhead_sensitivity(machines: tuple[Machine, ...] = MACHINES, gbps: tuple[float, ...] = EXPERT_READ_GBPS,
                         overheads: tuple[float, ...] = OVERHEADS_S) -> list[tuple[str, float, list[tuple[float, int]]]]:
    """Per machine and expert read speed (kernel bytes): the planner's best tok/s and its budget
    (0: autoregressive) at each GPU layer overhead of `overheads`."""
    target = target_shape()
    return [(machine.label, read, [(plan.tokens_per_second, plan.budget)
                                   for plan in (_plan(machine, read, target, o)[1] for o in overheads)])
            for machine in machines for read in gbps]


def format_sensitivity(rows: list[tuple[str, float, list[tuple[float, int]]]],
                       overheads: tuple[float, ...] = OVERHEADS_S) -> list[str]:
    head = "".join(f"{f'{1e3 * o:.2f} ms':>16}" for o in overheads)
    lines = ["PROJECTION by the GPU side's cost a layer beyond its weights (best tok/s, x llama.cpp; "
             "0.86 ms: the general path, measured; below: what a leaner step would leave, not measured)",
             f"{'machine':<44}{'expert GB/s':>12}{head}"]
    for label, read, points in rows:
        cells = "".join(f"{f'{tok_s:.1f} {tok_s / LLAMA_CPP_TOK_S:.2f}x' + ('' if budget else ' AR'):>16}"
                        for tok_s, budget in points)
        lines.append(f"{label:<44}{read:>12.0f}{cells}")
    lines.append("'AR': no tree pays there (each further token's experts cost the CPU more than the tree saves)")
    return lines


def format_projection(rows: list[ProjectionRow]) -> list[str]:
    lines = [f"PROJECTION (the planner's prediction, not a measurement): {MODEL}",
             f"  experts on the CPU ({CPU_THREADS} threads), the rest on the GPU; a draft costing one target layer "
             "+ head, prior acceptance curve",
             f"  against llama.cpp --n-cpu-moe: {LLAMA_CPP_TOK_S} tok/s (Qwen3-30B-A3B Q4_K_M, RTX 2080 8 GB, measured "
             "by others)",
             f"{'machine':<44}{'expert GB/s':>12}{'experts at':>14}{'in VRAM':>8}{'AR tok/s':>10}{'best':>8}{'budget':>8}"
             f"{'tok/pass':>9}{'tree %':>8}{'x llama.cpp':>12}{'stream from':>12}"]
    for r in rows:
        lines.append(f"{r.machine:<44}{r.expert_gbps:>12.0f}{r.experts_at:>14}{100 * r.cached:>7.0f}%{r.autoregressive:>10.1f}{r.best:>8.1f}"
                     f"{r.budget or 'AR':>8}{r.tokens_per_pass:>9.2f}{100 * r.tree_share:>7.0f}%{r.vs_llama_cpp:>11.2f}x"
                     f"{r.stream_from or 'never':>12}")
    lines.append(f"'file bytes': the experts read at the GGUF's own {FILE_BYTES_PER_PARAM} bytes a weight instead of "
                 f"the {planner.KERNEL_EXPERT_BYTES_PER_PARAM} SpecChat's kernel holds")
    lines.append("'in VRAM': the share of the routed experts (16-bit) the GPU memory left holds, run there beside the "
                 "CPU's; priced as serving that share of the experts' work (routing spread evenly)")
    lines.append("'stream from': the fewest tokens a pass from which copying its experts' union to the GPU beats the "
                 "CPU running them (prompt chunks, not decode trees; `--experts auto` streams from there)")
    return lines
