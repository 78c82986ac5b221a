"""The planner: predicted tokens/s of a target/draft pair on a measured machine, and the tree
budget and depth that maximise it (or plain autoregressive decoding when speculation does not
pay). `--budget auto`, the models page, the wizard and `specchat bench plan` use it.

Cost model of one speculation step with budget B and depth D (n = B + 1 tree tokens):

    tok/s(B, D) = a(B, D) / (T_draft(B, D) + T_target(n) + a * T_head + overhead)

- T_target(n), from the placement of the target's decoder layers: a layer resident on the
  device costs compute(n); a layer streamed from RAM costs max(bytes / pinned bandwidth,
  compute(n)) when copies overlap compute (else the sum); a disk-tier layer costs
  max(bytes / disk read speed, compute(n)). compute(n) is the profile's measured layer curve
  (profile.LayerTiming) rescaled to this model's layer size, plus unpacking a packed layer
  (NF4, GGUF blocks, AWQ/GPTQ int4) before its matmuls: at the GPU's memory speed there, at
  CPU_UNPACK_S_PER_PARAM on a CPU, where it is most of the pass (the format that runs is
  priced, not a dense stand-in for it).
- An MoE target's layer (ModelShape.experts) reads its always-on part (attention, router, shared
  experts) and the union of the experts the pass's tokens route to: u(N), the prior
  engine.planning.moe.expert_union, rising from top_k at one token towards every expert. With
  the experts on the CPU (the packed kernel, alone or beside a GPU: Placement.resident_form
  "kernel" or "experts-cpu") they cost the profile's ExpertTiming: u(N) experts read at its
  GB/s plus each further (token, expert) row's compute; beside a GPU they run after the layer's
  GPU part (no overlap yet) plus a synchronisation. Elsewhere the union is read and each token
  computes its top-k. A tree's price grows with u(N), not N, and the budget that pays is
  often small.
- T_draft = draft passes per step x one draft pass over default_expand_per_pass(B) nodes (the
  drafter's batch); the draft is resident.
- a(B, D), expected tokens per target pass, and the draft passes per step: the acceptance
  curve (calibration.py), a prior refitted to the engine's own recorded passes.
- autoregressive: 1 / (T_target(1) + T_head + small overhead); chosen when no budget beats it.

Everything here takes plain data (a HardwareProfile, ModelShapes, a Placement, a PassRecord),
never a loaded model. What this module does not do: measure (measure.py), load models or place
weights (the loader decides the real placement; `estimate_placement` predicts it for a model
that is not loaded yet).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from engine.planning import lean_timing
from engine.planning.calibration import AcceptanceCurve
from engine.planning.moe import cached_expert_seconds, expert_union
from engine.planning.placement import MemoryNeeds, activation_bytes, plan_placement
from engine.planning.profile import ExpertTiming, HardwareProfile
from engine.store.catalog import CatalogModel
from engine.shapes import ModelShape, Packing, Placement
from engine.types import DecodeMode, Fit, PassRecord, default_expand_per_pass
from engine.units import GB

DEFAULT_BUDGETS = tuple(2**i for i in range(12))  # 1 .. 2048
DEPTHS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)
STEP_OVERHEAD_S = 0.004  # engine bookkeeping per speculation step (README table: 4-9 ms on CPU)
AR_OVERHEAD_S = 0.0002
NF4_BYTES_PER_PARAM = 0.5625  # 4-bit codes + one fp16 scale per 64 weights, as in catalog.json
# Unpacking one weight of a packed layer on a CPU, every pass (the layer's matmuls then run on
# the unpacked copy). Measured on this project's 2-core CPU: GGUF blocks 4-11 ns per weight
# (README, "GGUF kept packed": Q4_K 4.2 ns on one thread; the starter's Q4_1 GGUF decoded
# 5-20x slower than its FP32 conversion, 2026-11-24), NF4 0.3-1.6 ns. A prior: a CPU's own
# figure replaces it once answers are measured there (measured.py).
CPU_UNPACK_S_PER_PARAM = {"nf4": 1.0e-9, "gguf": 5.0e-9, "awq": 5.0e-9, "gptq": 5.0e-9}
PACKED_BYTES_PER_PARAM = {"nf4": NF4_BYTES_PER_PARAM, "gguf": 0.6, "awq": 0.53, "gptq": 0.53}  # Q4_K_M ~4.8 bits
# The packed CPU kernel's time per token beyond the first against an fp32 product's, once its weights are read
# (`python scripts/bench_qmatmul.py`, 2 threads, AVX-512 panels: 0.47-0.92 at 16-64 rows; 1.4 with the tiles).
KERNEL_TOKEN_RATIO = 0.7
# What the packed CPU kernel holds per weight of a GGUF's routed experts (Q4_K_M: Q4_K gate and up,
# half a byte a code and 10 bytes of scales and 10 of minimums per 256, 0.578; its down Q6_K, six
# bits a code + 10 bytes per 128 (kind q6), 0.828, on about half the layers and Q4_K on the rest): 0.62.
KERNEL_EXPERT_BYTES_PER_PARAM = 0.62
# gpt-oss's MXFP4 experts as the kernel holds them (the file's nibbles, an fp16 power of two per
# 32: engine.loading.cpu_packed), and as its blocks sit in RAM for a GPU (4.25 bits a weight)
MXFP4_KERNEL_BYTES_PER_PARAM = 9 / 16
MXFP4_BLOCK_BYTES_PER_PARAM = 17 / 32
# The head of a GGUF as the kernel holds it: Q6_K in K-quant files (six-bit codes + 10 bytes per
# 128), 0.83 a weight (a Q8_0 file's 1.06; a one-token step reads all of it, so it is much of a
# small model's step: the synthetic MoE's 151,936 x 2048 head ~11 ms of a 33 ms step here)
KERNEL_HEAD_BYTES_PER_PARAM = 0.83
# Priors for a profile without an ExpertTiming: a further token's expert row, per weight (this
# project's 2-core CPU at 2 threads, `specchat bench hardware`, 4 tokens an expert: the integer
# rows, 1.4e-11 since the ninth session's 128-code rows, 2.3e-11 before), and RAM copy speed reads.
EXPERT_ROW_S_PER_PARAM = 1.4e-11
EXPERTS_SYNC_S = 1e-4  # per MoE layer and pass, experts on the CPU beside a GPU: states over, the sum back
HOST_MARGIN_BYTES = 2 * GB  # RAM left to the OS and the app when predicting a placement
PREDICTED_CONTEXT = 4096  # KV cache a prediction reserves room for
PREDICTED_BUDGET = 512  # tree activations a prediction reserves room for


# ---- pass times ---------------------------------------------------------------------------------
def layer_bytes(shape: ModelShape, quant: str, device: str) -> int:
    if quant in PACKED_BYTES_PER_PARAM:
        return int(shape.layer_params * PACKED_BYTES_PER_PARAM[quant])
    return shape.layer_params * (4 if device == "cpu" else 2)  # the engine runs fp32 on CPU, 16-bit on GPU


def compute_seconds(profile: HardwareProfile, params: int, tokens: int, quant: str = "none",
                    form: str = "", bytes_per_param: float | None = None) -> float:
    """One layer of `params` weights over `tokens` tokens on the profile's compute device,
    unpacking included for a packed `quant` ("nf4", "gguf", "awq", "gptq") unpacked every pass.
    `form` "kernel": its Linear weights stay packed for the packed CPU kernel (engine.kernels),
    which reads them at the speed the measured layer streamed its weights from memory and costs
    KERNEL_TOKEN_RATIO times an fp32 product per token beyond the first; "dequantised": the
    layer runs as an unpacked one."""
    timing = profile.layer_timing
    if form == "kernel" and quant in PACKED_BYTES_PER_PARAM and profile.gpu is None:
        read = params * (bytes_per_param or PACKED_BYTES_PER_PARAM[quant]) / timing.memory_bandwidth
        more = max(0.0, timing.scaled_seconds(params, tokens) - timing.scaled_seconds(params, 1))
        return timing.overhead_s + read + KERNEL_TOKEN_RATIO * more
    return timing.scaled_seconds(params, tokens) + unpack_seconds(profile, params, quant, form)


def unpack_seconds(profile: HardwareProfile, params: int, quant: str, form: str = "") -> float:
    """De-quantising `params` packed weights, as a pass does for layers kept packed and run
    de-quantised (`form` ""): to 16-bit at VRAM speed on a GPU, at CPU_UNPACK_S_PER_PARAM on a CPU."""
    if quant not in CPU_UNPACK_S_PER_PARAM or form:
        return 0.0
    if profile.gpu is not None:
        return 2 * params / (profile.gpu.device_memory_gbps * GB)
    return params * CPU_UNPACK_S_PER_PARAM[quant]


def cpu_experts(profile: HardwareProfile) -> ExpertTiming:
    """The profile's measured packed-expert timing, or a prior from its RAM speed."""
    if profile.cpu_experts is not None:
        return profile.cpu_experts
    gbps = profile.ram_copy_gbps if profile.gpu is not None else profile.layer_timing.memory_bandwidth / GB
    return ExpertTiming(1, 1, gbps, EXPERT_ROW_S_PER_PARAM, profile.torch_threads)


def expert_seconds(profile: HardwareProfile, target: ModelShape, tokens: int, union: float | None = None) -> float:
    """The routed experts of one (average) decoder layer run by the packed CPU kernel over
    `tokens` tokens waking `union` experts (default: u(N) at the model's sharing, the prior
    until its routing was measured), at the profile's packed-expert timing."""
    return timed_expert_seconds(cpu_experts(profile), target, tokens, union)


def timed_expert_seconds(timing: ExpertTiming, target: ModelShape, tokens: int, union: float | None = None) -> float:
    """expert_seconds at a given ExpertTiming."""
    ex = target.experts
    if ex is None or tokens <= 0:
        return 0.0
    u = union if union is not None else expert_union(tokens, ex.experts, ex.top_k, ex.sharing)
    nbytes = int(target.expert_params * KERNEL_EXPERT_BYTES_PER_PARAM)
    return target.moe_fraction * timing.seconds(u, tokens * ex.top_k, target.expert_params, nbytes)


def streamed_expert_seconds(profile: HardwareProfile, target: ModelShape, tokens: int,
                            union: float | None = None) -> float:
    """The routed experts of one (average) layer streamed to the GPU for a pass instead of run by
    the CPU (PackedExperts.stream, engine.loading.layer_plan.stream_experts): the union's bytes as
    the file stores them over the pinned link, de-quantised there at VRAM speed; the GPU's
    products themselves are noise beside the copy. inf without a GPU or experts."""
    ex, gpu = target.experts, profile.gpu
    if ex is None or gpu is None:
        return math.inf
    u = union if union is not None else expert_union(tokens, ex.experts, ex.top_k, ex.sharing)
    params = u * target.expert_params
    return target.moe_fraction * (params * PACKED_BYTES_PER_PARAM["gguf"] / (gpu.pinned_h2d_gbps * GB)
                                  + 2 * params / (gpu.device_memory_gbps * GB))


def stream_pays_from(profile: HardwareProfile, target: ModelShape, most: int = 4096) -> int | None:
    """The fewest tokens a pass of which streams its experts to the GPU faster than the CPU runs
    them (passes of more tokens wake more experts, and each expert's further tokens cost the CPU
    compute the GPU does not feel); None when none up to `most` does."""
    n = 1
    while n <= most:
        if streamed_expert_seconds(profile, target, n) < expert_seconds(profile, target, n):
            lo, hi = n // 2 + 1, n  # the first power of two that pays; the first count, between
            while lo < hi:
                mid = (lo + hi) // 2
                if streamed_expert_seconds(profile, target, mid) < expert_seconds(profile, target, mid):
                    hi = mid
                else:
                    lo = mid + 1
            return lo
        n *= 2
    return None


def layer_seconds(profile: HardwareProfile, target: ModelShape, placement: Placement, tokens: int) -> float:
    """One decoder layer's compute over `tokens` tokens as `placement` runs it (its weights'
    copy over a link is priced by target_pass_seconds)."""
    quant, form = placement.quant, placement.resident_form
    if target.experts is None:
        return compute_seconds(profile, target.layer_params, tokens, quant, form)
    if form == "experts-cpu" or (form == "kernel" and profile.gpu is None):
        always = compute_seconds(profile, target.always_params, tokens, quant,
                                 "dequantised" if form == "experts-cpu" else form)
        if form != "experts-cpu":
            return always + expert_seconds(profile, target, tokens)
        # cached experts run on the GPU beside the CPU's, serving their share (routing taken as even)
        cached = placement.cached_experts
        cpu = (1.0 - cached) * expert_seconds(profile, target, tokens)
        gpu = cached * cached_expert_seconds(profile, target, tokens)
        return always + max(cpu, gpu) + target.moe_fraction * EXPERTS_SYNC_S
    # the experts de-quantised where they live: the union read once, each token computing its top-k;
    # a pass that unpacks a GGUF layer de-quantises the union alone (engine.offload.routed), others all
    timing, active, union = profile.layer_timing, target.active_params, target.union_params(tokens)
    return (timing.scaled_seconds(union, 1) + timing.scaled_seconds(active, tokens) - timing.scaled_seconds(active, 1)
            + unpack_seconds(profile, union if quant == "gguf" else target.layer_params, quant, form))


def target_pass_seconds(profile: HardwareProfile, target: ModelShape, placement: Placement, tokens: int) -> float:
    """One target pass over `tokens` tree tokens (the decoder layers; the head is separate)."""
    compute = layer_seconds(profile, target, placement, tokens)
    if profile.gpu is not None:  # a model whose layers all live on the GPU: its steps in CUDA graphs
        compute -= lean_timing.saving(profile.layer_timing, target, tokens, placement)
    total = placement.gpu_layers * compute
    gpu = profile.gpu
    if placement.ram_layers:
        if gpu is not None and placement.device != "cpu":
            copy = placement.layer_bytes / (gpu.pinned_h2d_gbps * GB)
            per = max(copy, compute) if gpu.copy_overlaps_compute else copy + compute
        else:  # CPU streaming is a RAM copy
            per = placement.layer_bytes / (profile.ram_copy_gbps * GB) + compute
        total += placement.ram_layers * per
    if placement.disk_layers:
        read = placement.layer_bytes / (profile.disk_read_gbps * GB)
        total += placement.disk_layers * max(read, compute)
    return total


def head_seconds(profile: HardwareProfile, model: ModelShape, rows: int, placement: Placement | None = None) -> float:
    """The output head over `rows` rows: dense, or packed for the CPU kernel where `placement`'s
    layers are (a GGUF run resident by the kernel keeps its head in the file's blocks too)."""
    if placement is not None and placement.resident_form == "kernel" and profile.gpu is None:
        return compute_seconds(profile, model.head_params, rows, placement.quant, "kernel", KERNEL_HEAD_BYTES_PER_PARAM)
    return compute_seconds(profile, model.head_params, rows)


def draft_pass_seconds(profile: HardwareProfile, draft: ModelShape, nodes: int) -> float:
    lean = lean_timing.saving(profile.layer_timing, draft, nodes, levels=True) if profile.gpu is not None else 0.0
    return (draft.num_layers * (compute_seconds(profile, draft.layer_params, nodes) - lean)
            + head_seconds(profile, draft, nodes))


# ---- choosing -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class BudgetPrediction:
    budget: int
    max_depth: int
    tokens_per_pass: float
    draft_seconds: float
    target_seconds: float
    tokens_per_second: float


@dataclass(frozen=True)
class Plan:
    """The planner's choice. mode "autoregressive" has budget 0 and max_depth 0."""

    mode: DecodeMode
    budget: int
    max_depth: int
    tokens_per_second: float
    autoregressive_tokens_per_second: float
    curve: tuple[BudgetPrediction, ...]
    reason: str


def predict_budget(profile: HardwareProfile, target: ModelShape, draft: ModelShape, placement: Placement,
                   budget: int, max_depth: int, curve: AcceptanceCurve = AcceptanceCurve(),
                   draft_pass: Callable[[int], float] | None = None) -> BudgetPrediction:
    """`draft_pass(nodes)`: seconds of one draft pass over `nodes` tree nodes, for a draft that
    is not a separate resident model (a head, a self-draft: engine.decoding.draft_choice);
    default: `draft` run as a resident model (draft_pass_seconds)."""
    a = curve.tokens_per_pass(budget, max_depth)
    per_pass = default_expand_per_pass(budget)
    t_draft = curve.draft_seconds(budget)
    if t_draft is None:
        one = draft_pass(per_pass) if draft_pass is not None else draft_pass_seconds(profile, draft, per_pass)
        t_draft = curve.draft_passes(budget, max_depth) * one * curve.draft_time_scale
    t_target = curve.target_time_scale * (target_pass_seconds(profile, target, placement, budget + 1)
                                          + a * head_seconds(profile, target, 1, placement))
    return BudgetPrediction(budget, max_depth, a, t_draft, t_target, a / (t_draft + t_target + STEP_OVERHEAD_S))


def autoregressive_tokens_per_second(profile: HardwareProfile, target: ModelShape, placement: Placement,
                                     time_scale: float = 1.0) -> float:
    step = time_scale * (target_pass_seconds(profile, target, placement, 1) + head_seconds(profile, target, 1, placement))
    return 1.0 / (step + AR_OVERHEAD_S)


def time_scales(profile: HardwareProfile, target: ModelShape, draft: ModelShape, placement: Placement,
                records: PassRecord) -> tuple[float, float]:
    """(target, draft) measured / predicted seconds over the engine's recorded SpecExec passes."""
    t_meas = t_pred = d_meas = d_pred = 0.0
    for (mode, b), r in records.items():
        if mode != "specexec" or not r.passes:
            continue
        t_meas += r.target_seconds
        t_pred += r.passes * (target_pass_seconds(profile, target, placement, b + 1)
                              + r.tokens / r.passes * head_seconds(profile, target, 1, placement))
        d_meas += r.draft_seconds
        d_pred += r.draft_passes * draft_pass_seconds(profile, draft, default_expand_per_pass(b))
    return (t_meas / t_pred if t_meas and t_pred else 1.0, d_meas / d_pred if d_meas and d_pred else 1.0)


def choose_budget(profile: HardwareProfile, target: ModelShape, draft: ModelShape | None, placement: Placement,
                  curve: AcceptanceCurve = AcceptanceCurve(), budgets: Sequence[int] = DEFAULT_BUDGETS,
                  depths: Sequence[int] = DEPTHS, draft_pass: Callable[[int], float] | None = None) -> Plan:
    """The budget and depth with the most predicted tok/s, or autoregressive when none beats it
    (`draft_pass` as for predict_budget)."""
    ar = autoregressive_tokens_per_second(profile, target, placement, curve.target_time_scale)
    if draft is None:
        return Plan("autoregressive", 0, 0, ar, ar, (), "no draft model: one target pass per token")
    best_per_budget = []
    for b in budgets:
        options = [predict_budget(profile, target, draft, placement, b, d, curve, draft_pass)
                   for d in depths if d <= max(b, 1)]
        best_per_budget.append(max(options, key=lambda p: p.tokens_per_second))
    best = max(best_per_budget, key=lambda p: p.tokens_per_second)
    if best.tokens_per_second <= ar:
        reason = (f"speculation does not pay here: the best tree (budget {best.budget}) would give "
                  f"{best.tokens_per_second:.2f} tok/s against {ar:.2f} without a draft")
        return Plan("autoregressive", 0, 0, ar, ar, tuple(best_per_budget), reason)
    reason = (f"budget {best.budget}, depth {best.max_depth}: {best.tokens_per_pass:.1f} tokens per pass, "
              f"draft {best.draft_seconds:.3f} s + target {best.target_seconds:.3f} s per step, "
              f"{best.tokens_per_second / ar:.1f}x autoregressive")
    return Plan("specexec", best.budget, best.max_depth, best.tokens_per_second, ar, tuple(best_per_budget), reason)


# ---- catalog pairs --------------------------------------------------------------------------------
@dataclass(frozen=True)
class PairPrediction:
    """Predicted speed of a catalog pair on a profile. fit: "fits" (weights in VRAM + RAM, at
    least 1 tok/s), "slow" (in memory but under 1 tok/s), "too big" (needs the disk tier)."""

    tokens_per_second: float
    budget: int
    max_depth: int
    mode: DecodeMode
    fit: Fit
    placement: Placement
    quant: str
    reason: str
    autoregressive_tokens_per_second: float = 0.0


def estimate_placement(profile: HardwareProfile, target: ModelShape, quant: Packing,
                       draft: ModelShape | None = None, context_length: int = PREDICTED_CONTEXT,
                       mxfp4: bool = False) -> Placement:
    """Where the loader would put the target's layers on this machine: plan_placement with the
    memory a model that is not loaded yet is estimated to need. `mxfp4` (quant "gguf"): gpt-oss's
    experts kept in MXFP4 blocks, the rest of its layers dense (engine.loading.weights)."""
    device = "cpu" if profile.gpu is None else "cuda:0"
    lbytes = layer_bytes(target, quant, device)
    if mxfp4:
        dense = target.always_params * (4 if device == "cpu" else 2)
        expert = MXFP4_KERNEL_BYTES_PER_PARAM if device == "cpu" else MXFP4_BLOCK_BYTES_PER_PARAM
        lbytes = int(dense + target.routed_params * expert)
    host_free = max(0, profile.ram_available - HOST_MARGIN_BYTES)
    needs = predicted_needs(profile, target, draft, context_length)
    device_free = profile.gpu.vram_free if profile.gpu is not None else host_free
    placement = plan_placement(num_layers=target.num_layers, layer_bytes=lbytes,
                               dense_layer_bytes=target.layer_params * 2, quant=quant, offload="auto", device=device,
                               device_free=device_free, needs=needs, context_length=context_length,
                               host_free=host_free)
    if device == "cpu" and quant == "gguf":  # its Linear weights stay packed for the CPU kernel (cpu_packed)
        placement = replace(placement, resident_form="kernel")
    elif placement.gpu_layers < target.num_layers and quant == "gguf" and target.experts is not None:
        placement = _experts_on_cpu(target, placement, needs, context_length, device_free, host_free,
                                    MXFP4_KERNEL_BYTES_PER_PARAM if mxfp4 else KERNEL_EXPERT_BYTES_PER_PARAM)
    return placement


def _experts_on_cpu(target: ModelShape, streamed: Placement, needs: MemoryNeeds, context_length: int,
                    device_free: int, host_free: int, expert_bytes: float = KERNEL_EXPERT_BYTES_PER_PARAM) -> Placement:
    """An MoE GGUF too big for the GPU, as the loader's `--experts auto` places it
    (engine.loading.layer_plan.experts_on_cpu): everything but the routed experts on the GPU
    (16-bit), the experts packed in RAM for the CPU kernel, when both fit, and the GPU memory left
    caching experts (their share in `cached_experts`); else `streamed`."""
    gpu_bytes = target.num_layers * target.always_params * 2 + needs.fixed + needs.kv_at(context_length) \
        + needs.activations + GB
    host_bytes = target.num_layers * target.routed_params * expert_bytes
    if gpu_bytes > device_free or host_bytes > host_free:
        return streamed
    every_expert = target.num_layers * target.routed_params * 2  # 16-bit in the cache (engine.kernels.expert_cache)
    cached = min(1.0, (device_free - gpu_bytes) / every_expert) if every_expert else 0.0
    return replace(streamed, gpu_layers=target.num_layers, ram_layers=0, disk_layers=0, resident_form="experts-cpu",
                   cached_experts=cached)


def predicted_needs(profile: HardwareProfile, target: ModelShape, draft: ModelShape | None = None,
                    context_length: int = PREDICTED_CONTEXT) -> MemoryNeeds:
    """The device memory a target that is not loaded yet needs besides its decoder layers."""
    dtype_bytes = 4 if profile.gpu is None else 2
    draft_bytes = draft.params * dtype_bytes if draft is not None else 0
    layer = target.layer
    return MemoryNeeds(
        fixed=2 * target.head_params * dtype_bytes + draft_bytes,
        kv_per_token=target.kv_bytes_per_token(dtype_bytes),
        kv_bytes=target.kv_bytes(context_length, PREDICTED_BUDGET, dtype_bytes),
        activations=activation_bytes(PREDICTED_BUDGET, context_length, layer.hidden_size, target.activation_width,
                                     layer.num_attention_heads, target.vocab_size, dtype_bytes))


def _quant_options(profile: HardwareProfile, model: CatalogModel, quant: str) -> list[Packing]:
    """How the loader would keep the target's layers: a pre-quantised checkpoint as it is
    packed (bnb 4-bit as NF4, a GGUF's blocks, AWQ int4), else 16-bit (32-bit on a CPU) or NF4."""
    packed = getattr(model, "prequantised", None)
    if packed:
        return ["gguf" if packed == "gguf" else "awq" if packed in ("awq", "gptq") else "nf4"]
    if _mxfp4(model) and quant in ("auto", "none", "bf16"):
        return ["gguf"]  # the loader keeps the MXFP4 experts in their blocks (a "gguf" layout)
    if profile.gpu is None:
        return ["none"]  # CPU runs fp32; NF4 kernels are GPU-only
    if quant == "none":
        return ["none"]
    if quant == "nf4":
        return ["nf4"]
    if quant == "bf16":
        return ["none"]
    return ["none", "nf4"]


def _mxfp4(model: CatalogModel) -> bool:
    """A checkpoint whose experts are MXFP4 (gpt-oss as OpenAI ships it)."""
    return getattr(model, "dtype", "") == "mxfp4" and getattr(model, "experts", None) is not None


def predict_pair(profile: HardwareProfile, target: CatalogModel, draft: CatalogModel | None, quant: str = "auto",
                 curve: AcceptanceCurve = AcceptanceCurve()) -> PairPrediction:
    """Predicted tok/s of catalog models `target` (+ `draft`, None = no draft) on `profile`.
    quant "auto" tries 16-bit and NF4 and keeps the faster one that avoids the disk tier."""
    tshape = target.shape()
    dshape = draft.shape() if draft is not None else None
    results = []
    for q in _quant_options(profile, target, quant):
        placement = estimate_placement(profile, tshape, q, dshape, mxfp4=_mxfp4(target) and q == "gguf")
        plan = choose_budget(profile, tshape, dshape, placement, curve)
        results.append((placement.disk_layers > 0, -plan.tokens_per_second, q, placement, plan))
    on_disk, _, q, placement, plan = min(results, key=lambda r: (r[0], r[1]))
    fit: Fit = "too big" if on_disk else "fits" if plan.tokens_per_second >= 1.0 else "slow"
    where = placement.describe()
    reason = f"{where}; {plan.reason}" if plan.mode == "specexec" else f"{where}; autoregressive: {plan.reason}"
    if on_disk:
        reason = (f"{where}: the weights do not fit in VRAM + RAM, so {placement.disk_layers} layers are read "
                  f"from disk every pass; {plan.reason}")
    quant_name = "bf16" if q == "none" and placement.device != "cpu" else "fp32" if q == "none" else q
    return PairPrediction(plan.tokens_per_second, plan.budget, plan.max_depth, plan.mode, fit, placement,
                          quant_name, reason, plan.autoregressive_tokens_per_second)


def predict_curve(profile: HardwareProfile, target: CatalogModel, draft: CatalogModel, quant: str = "auto",
                  budgets: Sequence[int] = DEFAULT_BUDGETS,
                  curve: AcceptanceCurve = AcceptanceCurve()) -> list[tuple[int, float]]:
    """(budget, predicted tok/s at its best depth) for the quantisation predict_pair picks. Give
    the same `curve` as predict_pair's, so the plot's peak is the table's figure."""
    chosen = predict_pair(profile, target, draft, quant, curve)
    tshape, dshape = target.shape(), draft.shape()
    plan = choose_budget(profile, tshape, dshape, chosen.placement, curve, budgets=budgets)
    return [(p.budget, p.tokens_per_second) for p in plan.curve]


# ---- a loaded pair (`--budget auto`, the app, the bench) -------------------------------------------
def plan_for_pair(profile: HardwareProfile, target: ModelShape, draft: ModelShape | None, placement: Placement,
                  records: PassRecord, curve: AcceptanceCurve | None = None,
                  budgets: Sequence[int] = DEFAULT_BUDGETS) -> Plan | None:
    """The plan for a loaded pair: its shapes, the target's placement and the passes its engine
    has recorded. Unless `curve` is given, the acceptance curve and the pass-time scales are
    calibrated from `records`. None when the profile's layer curve was measured on another kind
    of device than the one the models run on (its timings would not apply)."""
    if placement.device.startswith("cuda") != profile.layer_timing.device.startswith("cuda"):
        return None
    if curve is None and draft is not None:
        t_scale, d_scale = time_scales(profile, target, draft, placement, records)
        curve = replace(AcceptanceCurve.from_records(records), target_time_scale=t_scale, draft_time_scale=d_scale)
    return choose_budget(profile, target, draft, placement, curve or AcceptanceCurve(), budgets)
