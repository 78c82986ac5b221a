"""The planner: predicted tokens/s of a target/draft pair on a measured machine, and the tree
budget and depth that maximise it (or plain autoregressive decoding when speculation does not
pay). `--budget auto`, the models page, the wizard and `specchat bench plan` use it.

Cost model of one speculation step with budget B and depth D (n = B + 1 tree tokens):

    tok/s(B, D) = a(B, D) / (T_draft(B, D) + T_target(n) + a * T_head + overhead)

- T_target(n), from the placement of the target's decoder layers: a layer resident on the
  device costs compute(n); a layer streamed from RAM costs max(bytes / pinned bandwidth,
  compute(n)) when copies overlap compute (else the sum); a disk-tier layer costs
  max(bytes / disk read speed, compute(n)). compute(n) is the profile's measured layer curve
  (hardware.LayerTiming) rescaled to this model's layer size.
- T_draft = draft passes per step x one draft pass over ceil(B / 8) nodes (drafting's batch);
  the draft is resident. Passes per step follow a fit to the starter pair's measured growth
  (1.0 / 6.5 / 9.8 / 11.3 / 12.3 passes at B = 1 / 8 / 64 / 256 / 1024), capped at D + 1,
  and are replaced by the engine's own counts once it has recorded passes at that budget.
- a(B, D), expected tokens per target pass: a prior 1 + s * log2(1 + B) with s = 0.78, which
  matches SpecExec's published 70B/7B figure (7.99 at B = 512) and the starter pair
  (1.72 / 3.57 / 5.88 / 6.90 / 8.00 at B = 1 / 8 / 64 / 256 / 1024), softly capped by depth;
  calibrated from the engine's recorded passes (`AcceptanceCurve.calibrated`).
- autoregressive: 1 / (T_target(1) + T_head + small overhead); chosen when no budget beats it.

What this module does not do: measure (hardware.py), load models or place weights (offload.py
decides the real placement; `estimate_placement` only predicts it for models not loaded yet).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from .hardware import GB, HardwareProfile, LayerShape
from .types import Placement

DEFAULT_BUDGETS = tuple(2**i for i in range(12))  # 1 .. 2048
DEPTHS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)
PRIOR_SLOPE = 0.78  # tokens per pass gained per doubling of the budget (see module docstring)
STEP_OVERHEAD_S = 0.004  # engine bookkeeping per speculation step (README table: 4-9 ms on CPU)
AR_OVERHEAD_S = 0.0002
NF4_BYTES_PER_PARAM = 0.5625  # 4-bit codes + one fp16 scale per 64 weights, as in catalog.json
GIB = 1 << 30


@dataclass(frozen=True)
class ModelShape:
    """What the cost model needs of a model: its decoder layer, how many, and the head."""

    name: str
    num_layers: int
    layer: LayerShape
    vocab_size: int

    @property
    def layer_params(self) -> int:
        return self.layer.params

    @property
    def head_params(self) -> int:
        return self.vocab_size * self.layer.hidden_size

    @property
    def params(self) -> int:
        return self.num_layers * self.layer_params + 2 * self.head_params

    @staticmethod
    def from_config(config: Any, name: str = "model") -> ModelShape:
        """From a transformers config (a loaded model's)."""
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        layer = LayerShape(name, config.hidden_size, config.intermediate_size, heads,
                           getattr(config, "num_key_value_heads", None) or heads, head_dim)
        return ModelShape(name, config.num_hidden_layers, layer, config.vocab_size)

    @staticmethod
    def from_catalog(model: Any) -> ModelShape:
        """From a catalog entry's shape fields; without them, a layer sized from the parameter
        count (hidden size guessed from the usual aspect ratio)."""
        if getattr(model, "hidden_size", None):
            layer = LayerShape(model.id, model.hidden_size, model.intermediate_size, model.num_attention_heads,
                               model.num_kv_heads, model.head_dim)
            return ModelShape(model.id, model.layers, layer, model.vocab_rows)
        hidden = 128 * max(1, round(math.sqrt(model.parameters / model.layers / 12) / 128))
        layer = LayerShape(model.id, hidden, int(3.5 * hidden), hidden // 128, max(1, hidden // 1024), 128)
        return ModelShape(model.id, model.layers, layer, model.vocab_rows)


# ---- tokens per pass ------------------------------------------------------------------------------
def prior_tokens_per_pass(budget: int, max_depth: int, slope: float = PRIOR_SLOPE) -> float:
    """1 + slope * log2(1 + B), softly capped at 1 + D (no path is longer than D tokens)."""
    free = slope * math.log2(1 + budget)
    return 1.0 + max_depth * (1.0 - math.exp(-free / max_depth))


def prior_draft_passes(budget: int, max_depth: int) -> float:
    return min(max_depth + 1.0, 1.0 + 2.1 * math.log2(budget) ** 0.75) if budget > 1 else 1.0


@dataclass(frozen=True)
class MeasuredBudget:
    """One budget's recorded passes: tokens per pass, draft passes and draft seconds per step."""

    budget: int
    passes: int
    tokens_per_pass: float
    draft_passes: float
    draft_seconds: float | None = None


@dataclass(frozen=True)
class AcceptanceCurve:
    """Expected tokens per pass (and draft work per step) vs budget: the prior, refitted to and
    overridden by `measured` budgets (each needs MIN_PASSES passes to count on its own)."""

    slope: float = PRIOR_SLOPE
    measured: tuple[MeasuredBudget, ...] = ()
    # measured / predicted pass time of this pair on this machine (engine overhead the bare
    # layer timing does not see); 1.0 until the engine has recorded passes
    target_time_scale: float = 1.0
    draft_time_scale: float = 1.0

    MIN_PASSES = 8

    def _at(self, budget: int) -> MeasuredBudget | None:
        return next((m for m in self.measured if m.budget == budget and m.passes >= self.MIN_PASSES), None)

    def tokens_per_pass(self, budget: int, max_depth: int) -> float:
        hit = self._at(budget)
        return hit.tokens_per_pass if hit is not None else prior_tokens_per_pass(budget, max_depth, self.slope)

    def draft_passes(self, budget: int, max_depth: int) -> float:
        hit = self._at(budget)
        return hit.draft_passes if hit is not None else prior_draft_passes(budget, max_depth)

    def draft_seconds(self, budget: int) -> float | None:
        """Measured draft seconds per step at this budget, if recorded."""
        hit = self._at(budget)
        return hit.draft_seconds if hit is not None else None

    @staticmethod
    def calibrated(records: Mapping[tuple[str, int], Any], tree_mode: str = "specexec") -> AcceptanceCurve:
        """From Engine.pass_record ({(tree_mode, budget): PassTotals}): a passes-weighted
        least-squares slope of (a - 1) on log2(1 + B), and each budget's own means."""
        rows = [MeasuredBudget(b, r.passes, r.tokens / r.passes, r.draft_passes / r.passes,
                               r.draft_seconds / r.passes if r.draft_seconds else None)
                for (mode, b), r in sorted(records.items()) if mode == tree_mode and r.passes]
        if not rows:
            return AcceptanceCurve()
        num = sum(m.passes * (m.tokens_per_pass - 1.0) * math.log2(1 + m.budget) for m in rows)
        den = sum(m.passes * math.log2(1 + m.budget) ** 2 for m in rows)
        return AcceptanceCurve(slope=num / den if den else PRIOR_SLOPE, measured=tuple(rows))


# ---- pass times ---------------------------------------------------------------------------------
def layer_bytes(shape: ModelShape, quant: str, device: str) -> int:
    if quant == "nf4":
        return int(shape.layer_params * NF4_BYTES_PER_PARAM)
    return shape.layer_params * (4 if device == "cpu" else 2)  # the engine runs fp32 on CPU, 16-bit on GPU


def compute_seconds(profile: HardwareProfile, params: int, tokens: int, quant: str = "none") -> float:
    """One layer of `params` weights over `tokens` tokens on the profile's compute device."""
    t = profile.layer_timing.scaled_seconds(params, tokens)
    if quant == "nf4" and profile.gpu is not None:  # dequantise to 16-bit before the matmuls
        t += 2 * params / (profile.gpu.device_memory_gbps * GB)
    return t


def target_pass_seconds(profile: HardwareProfile, target: ModelShape, placement: Placement, tokens: int) -> float:
    """One target pass over `tokens` tree tokens (the decoder layers; the head is separate)."""
    compute = compute_seconds(profile, target.layer_params, tokens, placement.quant)
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


def head_seconds(profile: HardwareProfile, model: ModelShape, rows: int) -> float:
    return compute_seconds(profile, model.head_params, rows)


def draft_pass_seconds(profile: HardwareProfile, draft: ModelShape, nodes: int) -> float:
    return (draft.num_layers * compute_seconds(profile, draft.layer_params, nodes)
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

    mode: str
    budget: int
    max_depth: int
    tokens_per_second: float
    autoregressive_tokens_per_second: float
    curve: tuple[BudgetPrediction, ...]
    reason: str


def predict_budget(profile: HardwareProfile, target: ModelShape, draft: ModelShape, placement: Placement,
                   budget: int, max_depth: int, curve: AcceptanceCurve = AcceptanceCurve()) -> BudgetPrediction:
    a = curve.tokens_per_pass(budget, max_depth)
    per_pass = max(1, math.ceil(budget / 8))
    t_draft = curve.draft_seconds(budget)
    if t_draft is None:
        t_draft = (curve.draft_passes(budget, max_depth) * draft_pass_seconds(profile, draft, per_pass)
                   * curve.draft_time_scale)
    t_target = curve.target_time_scale * (target_pass_seconds(profile, target, placement, budget + 1)
                                          + a * head_seconds(profile, target, 1))
    return BudgetPrediction(budget, max_depth, a, t_draft, t_target, a / (t_draft + t_target + STEP_OVERHEAD_S))


def autoregressive_tokens_per_second(profile: HardwareProfile, target: ModelShape, placement: Placement,
                                     time_scale: float = 1.0) -> float:
    step = time_scale * (target_pass_seconds(profile, target, placement, 1) + head_seconds(profile, target, 1))
    return 1.0 / (step + AR_OVERHEAD_S)


def time_scales(profile: HardwareProfile, target: ModelShape, draft: ModelShape, placement: Placement,
                records: Mapping[tuple[str, int], Any]) -> tuple[float, float]:
    """(target, draft) measured / predicted seconds over the engine's recorded SpecExec passes."""
    t_meas = t_pred = d_meas = d_pred = 0.0
    for (mode, b), r in records.items():
        if mode != "specexec" or not r.passes:
            continue
        t_meas += r.target_seconds
        t_pred += r.passes * (target_pass_seconds(profile, target, placement, b + 1)
                              + r.tokens / r.passes * head_seconds(profile, target, 1))
        d_meas += r.draft_seconds
        d_pred += r.draft_passes * draft_pass_seconds(profile, draft, max(1, math.ceil(b / 8)))
    return (t_meas / t_pred if t_meas and t_pred else 1.0, d_meas / d_pred if d_meas and d_pred else 1.0)


def choose_budget(profile: HardwareProfile, target: ModelShape, draft: ModelShape | None, placement: Placement,
                  curve: AcceptanceCurve = AcceptanceCurve(), budgets: Sequence[int] = DEFAULT_BUDGETS,
                  depths: Sequence[int] = DEPTHS) -> Plan:
    """The budget and depth with the most predicted tok/s, or autoregressive when none beats it."""
    ar = autoregressive_tokens_per_second(profile, target, placement, curve.target_time_scale)
    if draft is None:
        return Plan("autoregressive", 0, 0, ar, ar, (), "no draft model: one target pass per token")
    best_per_budget = []
    for b in budgets:
        options = [predict_budget(profile, target, draft, placement, b, d, curve) for d in depths if d <= max(b, 1)]
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
    mode: str
    fit: str
    placement: Placement
    quant: str
    reason: str
    autoregressive_tokens_per_second: float = 0.0


def estimate_placement(profile: HardwareProfile, target: ModelShape, quant: str,
                       draft: ModelShape | None = None, context_length: int = 4096) -> Placement:
    """Where offload.py would put the target's layers on this machine (a prediction for a model
    that is not loaded: offload.plan_placement with estimated needs, or a simple fallback)."""
    device = "cpu" if profile.gpu is None else "cuda:0"
    lbytes = layer_bytes(target, quant, device)
    dtype_bytes = 4 if device == "cpu" else 2
    draft_bytes = draft.params * dtype_bytes if draft is not None else 0
    fixed = 2 * target.head_params * dtype_bytes + draft_bytes
    host_free = max(0, profile.ram_available - 2 * 10**9)
    try:
        from . import offload

        needs = offload.MemoryNeeds(
            fixed=fixed,
            kv_per_token=offload.kv_bytes_per_token(target.num_layers, target.layer.num_kv_heads,
                                                   target.layer.head_dim, dtype_bytes),
            activations=offload.activation_bytes(512, context_length, target.layer.hidden_size,
                                                 target.layer.intermediate_size, target.layer.num_attention_heads,
                                                 target.vocab_size, dtype_bytes))
        device_free = profile.gpu.vram_free if profile.gpu is not None else host_free
        return offload.plan_placement(num_layers=target.num_layers, layer_bytes=lbytes,
                                      dense_layer_bytes=target.layer_params * 2, quant=quant, offload="auto",
                                      device=device, device_free=device_free, needs=needs,
                                      context_length=context_length, host_free=host_free)
    except (ImportError, AttributeError, TypeError):  # offload.py not there or its API moved
        pass
    if device == "cpu":
        resident = min(target.num_layers, max(0, host_free - fixed) // lbytes)
        return Placement(target.num_layers, resident, 0, target.num_layers - resident, lbytes, quant, device)  # type: ignore[arg-type]
    spare = profile.gpu.vram_free - fixed - int(1.5 * GIB) - 3 * lbytes  # type: ignore[union-attr]
    gpu = max(0, min(target.num_layers, spare // lbytes))
    ram = min(target.num_layers - gpu, host_free // lbytes)
    return Placement(target.num_layers, gpu, ram, target.num_layers - gpu - ram, lbytes, quant, device)  # type: ignore[arg-type]


def _quant_options(profile: HardwareProfile, model: Any, quant: str) -> list[str]:
    if getattr(model, "prequantised", None):
        return ["nf4"]
    if profile.gpu is None:
        return ["none"]  # CPU runs fp32; NF4 kernels are GPU-only
    if quant in ("none", "nf4"):
        return [quant]
    if quant == "bf16":
        return ["none"]
    return ["none", "nf4"]


def predict_pair(profile: HardwareProfile, target: Any, draft: Any | None, quant: str = "auto",
                 curve: AcceptanceCurve = AcceptanceCurve()) -> PairPrediction:
    """Predicted tok/s of catalog models `target` (+ `draft`, None = no draft) on `profile`.
    quant "auto" tries 16-bit and NF4 and keeps the faster one that avoids the disk tier."""
    tshape = ModelShape.from_catalog(target)
    dshape = ModelShape.from_catalog(draft) if draft is not None else None
    results = []
    for q in _quant_options(profile, target, quant):
        placement = estimate_placement(profile, tshape, q, dshape)
        plan = choose_budget(profile, tshape, dshape, placement, curve)
        results.append((placement.disk_layers > 0, -plan.tokens_per_second, q, placement, plan))
    on_disk, _, q, placement, plan = min(results, key=lambda r: (r[0], r[1]))
    fit = "too big" if on_disk else "fits" if plan.tokens_per_second >= 1.0 else "slow"
    where = placement.describe()
    reason = f"{where}; {plan.reason}" if plan.mode == "specexec" else f"{where}; autoregressive: {plan.reason}"
    if on_disk:
        reason = (f"{where}: the weights do not fit in VRAM + RAM, so {placement.disk_layers} layers are read "
                  f"from disk every pass; {plan.reason}")
    quant_name = "bf16" if q == "none" and placement.device != "cpu" else "fp32" if q == "none" else q
    return PairPrediction(plan.tokens_per_second, plan.budget, plan.max_depth, plan.mode, fit, placement,
                          quant_name, reason, plan.autoregressive_tokens_per_second)


def predict_curve(profile: HardwareProfile, target: Any, draft: Any, quant: str = "auto",
                  budgets: Sequence[int] = DEFAULT_BUDGETS) -> list[tuple[int, float]]:
    """(budget, predicted tok/s at its best depth) for the quantisation predict_pair picks."""
    chosen = predict_pair(profile, target, draft, quant)
    tshape, dshape = ModelShape.from_catalog(target), ModelShape.from_catalog(draft)
    plan = choose_budget(profile, tshape, dshape, chosen.placement, budgets=budgets)
    return [(p.budget, p.tokens_per_second) for p in plan.curve]


# ---- calibration from the app -------------------------------------------------------------------
def record_calibration(stats: Any, path: Any = None) -> None:
    """Remember a calibration run's tokens per pass at its budget (the app's wizard calls this),
    next to the hardware profile; `saved_curve()` reads it back."""
    import json

    from .hardware import profile_path

    if getattr(stats, "mode", "") != "specexec" or not getattr(stats, "target_passes", 0):
        return
    target = path or profile_path().with_name("calibration.json")
    try:
        rows = json.loads(target.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        rows = []
    rows.append([int(stats.budget), int(stats.target_passes), int(stats.new_tokens), int(stats.draft_passes)])
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(json.dumps(rows[-200:]), encoding="utf-8")


def saved_curve(path: Any = None) -> AcceptanceCurve:
    """The acceptance curve calibrated from record_calibration's file (the prior without one)."""
    import json

    from .generation import PassTotals
    from .hardware import profile_path

    source = path or profile_path().with_name("calibration.json")
    try:
        rows = json.loads(source.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return AcceptanceCurve()
    totals: dict[tuple[str, int], PassTotals] = {}
    for budget, passes, tokens, drafts in rows:
        old = totals.get(("specexec", budget), PassTotals())
        totals[("specexec", budget)] = replace(old, passes=old.passes + passes, tokens=old.tokens + tokens,
                                               draft_passes=old.draft_passes + drafts)
    return AcceptanceCurve.calibrated(totals)


# ---- a loaded pair (`--budget auto`, the bench) ---------------------------------------------------
def plan_for_engine(engine: Any, profile: HardwareProfile, curve: AcceptanceCurve | None = None,
                    budgets: Sequence[int] = DEFAULT_BUDGETS) -> Plan | None:
    """The plan for a loaded Engine: shapes from its models' configs, the target's placement
    (all layers on its device unless the loader recorded one), and, unless `curve` is given,
    the acceptance curve and pass-time scales calibrated from the engine's own recorded passes. None when the profile's
    layer curve was measured on another kind of device than the one the models run on."""
    device = str(engine.target.device)
    if device.startswith("cuda") != profile.layer_timing.device.startswith("cuda"):
        return None
    target = ModelShape.from_config(engine.target.config, "target")
    draft = ModelShape.from_config(engine.draft.config, "draft") if engine.draft is not None else None
    placement = getattr(engine.target, "placement", None)
    if not isinstance(placement, Placement):
        lbytes = target.layer_params * (4 if device == "cpu" else 2)
        placement = Placement(target.num_layers, target.num_layers, 0, 0, lbytes, "none", device)
    if curve is None and draft is not None:
        curve = AcceptanceCurve.calibrated(engine.pass_record)
        t_scale, d_scale = time_scales(profile, target, draft, placement, engine.pass_record)
        curve = replace(curve, target_time_scale=t_scale, draft_time_scale=d_scale)
    return choose_budget(profile, target, draft, placement, curve or AcceptanceCurve(), budgets)
