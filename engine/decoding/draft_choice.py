"""Which draft runs for a target, and why (issue 32): every candidate priced by the planner, the
fastest one chosen, each rejected one with its reason. Plain data in, plain data out: shapes, a
placement, a hardware profile and acceptance curves; no model is loaded or run here.

Candidates, in order (an earlier one wins a tie):
1. "mtp": MTP / NextN layers found in the checkpoint (Qwen3.5/3.6, GLM-4.5, DeepSeek-V3);
2. "assistant": an assistant or EAGLE head shipped beside the model;
3. "self": a self-draft, low-bit substitutes of the target's offloaded layers plus its resident
   layers as they are, reading the target's caches;
4. "catalog": the catalog's draft model for this target;
5. "none": draft-free (context candidates only; priced as autoregressive decoding, since no
   prior says how often a conversation repeats itself).

Acceptance: a measured curve where the engine has one (`DraftOptions.measured`, by kind), else
the kind's prior, the planner's curve a(B, D) = 1 + D'(1 - exp(-s log2(1 + B) / D')) with
D' = min(D, cap) (calibration.prior_tokens_per_pass), its slope s fitted to a published figure:
- catalog: s = 0.78, calibration.PRIOR_SLOPE (SpecExec's 70B/7B figure and the starter pair).
- self, 4-bit: s = 0.78 x 27.35 / 10.91 = 1.96. SubSpec (NeurIPS 2025): a 4-bit self-draft of
  Qwen2.5-7B in 8 GB reached 28.35 tokens per pass against 11.91 with a separate 1.5B draft;
  the tokens beyond the first scale by that ratio. 3 and 2 bits: 0.8 and 0.5 of the 4-bit
  slope, an assumption (lower bits agree less with the target) until measured self-drafts
  replace it.
- mtp: s = 2.08, cap 3. llama.cpp's MTP on Qwen3.6-27B / 35B-A3B: ~75 % acceptance of 3
  drafted tokens, i.e. 1 + 0.75 x 3 = 3.25 tokens per pass at B = 3; no deeper path credited.
- assistant: s = 1.83, cap 8. An EAGLE-3 head for Llama-3.3-70B (nebius/EAGLE3-Llama-3.3-70B-
  Instruct's model card): average acceptance length 4.8 at T = 0 with 7 drafted tokens.
  Gemma 4's assistant models (engine.model.assistant) are priced by the same prior: the figure
  found published for them is Google's "up to ~3x" tokens per second
  (ai.google.dev/gemma/docs/mtp; InfoQ, May 2026), which 4.8 tokens per pass at a draft cost
  of a few narrow layers is in line with. Their layers count at the target's width (the
  assistant's are narrower): the price errs slow.

Draft pass cost over n tree nodes:
- catalog: planner.draft_pass_seconds (a resident model of its own shape);
- head: its decoder layers (of the target's width, usually one) plus the head matmul;
- self: the target's resident layers as they run, plus each substituted layer's compute and its
  de-quantisation (reading bits/8 and writing 2 bytes per weight at VRAM speed; no PCIe copy),
  plus the head. On a CPU, or with nothing of the target offloaded, the self-draft is the
  target again at the target's cost: it cannot beat draft-free and is rejected saying so.

Without a hardware profile (or with one measured on another kind of device), fallback rules:
the first candidate that can run, in the order above, and the reason says so.

What this module does not do: find heads (engine.model.heads), build a self-draft
(engine.loading.self_draft) or load anything (pair.py).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from engine.planning.calibration import PRIOR_SLOPE, AcceptanceCurve
from engine.planning.placement import RING_SLOTS
from engine.planning.planner import (
    autoregressive_tokens_per_second,
    choose_budget,
    compute_seconds,
    draft_pass_seconds,
    PREDICTED_CONTEXT,
    head_seconds,
    predicted_needs,
)
from engine.planning.profile import HardwareProfile
from engine.shapes import ModelShape, Placement
from engine.units import GB, GIB

DraftKind = Literal["mtp", "assistant", "self", "catalog", "none"]
KINDS: tuple[DraftKind, ...] = ("mtp", "assistant", "self", "catalog", "none")
SELF_BITS = (4, 3, 2)  # engine.loading.self_draft.SELF_DRAFT_BITS
SUBSTITUTE_GROUP = 32  # weights per group of a substitute; each group keeps a byte scale and a byte zero


@dataclass(frozen=True)
class KindPrior:
    slope: float
    depth_cap: int | None
    source: str


SUBSPEC_RATIO = (28.35 - 1) / (11.91 - 1)  # SubSpec: self-draft vs 1.5B draft, tokens beyond the first
PRIORS: dict[str, KindPrior] = {
    "catalog": KindPrior(PRIOR_SLOPE, None, "the catalog-pair prior (SpecExec's 70B/7B figure, the starter pair)"),
    "self": KindPrior(PRIOR_SLOPE * SUBSPEC_RATIO, None,
                      "SubSpec's prior (NeurIPS 2025: 28.35 tokens per pass vs 11.91 with a 1.5B draft)"),
    "mtp": KindPrior(2.08, 3, "llama.cpp's MTP prior (~75% acceptance of 3 drafted tokens on Qwen3.6)"),
    "assistant": KindPrior(1.83, 8, "an EAGLE-3 prior (4.8 tokens per pass with 7 drafted, Llama-3.3-70B)"),
}
SELF_BITS_SCALE = {4: 1.0, 3: 0.8, 2: 0.5}  # share of the 4-bit slope: an assumption (module docstring)


def prior_curve(kind: str, bits: int | None = None) -> AcceptanceCurve:
    """The stated prior of a draft kind (module docstring)."""
    prior = PRIORS[kind]
    scale = SELF_BITS_SCALE.get(bits or 4, 0.5) if kind == "self" else 1.0
    return AcceptanceCurve(slope=prior.slope * scale, depth_cap=prior.depth_cap)


# ---- what can run ------------------------------------------------------------------------------
@dataclass(frozen=True)
class HeadOption:
    """A head found in or beside the checkpoint: `layers` decoder layers of the target's width
    run per draft pass, then the target's head."""

    kind: Literal["mtp", "assistant"]
    label: str
    layers: int = 1
    refusal: str = ""  # why it cannot be loaded ("" = it can)


@dataclass(frozen=True)
class SelfOption:
    """A self-draft: `bits` the widest of SELF_BITS whose substitutes fit in the memory left
    (None: none fits); `refusal` why none can be built at all ("" when one can)."""

    bits: int | None
    substituted: int
    resident: int
    refusal: str = ""


@dataclass(frozen=True)
class CatalogOption:
    label: str
    shape: ModelShape


@dataclass(frozen=True)
class DraftOptions:
    """What a target could draft with. `measured`: acceptance curves the engine recorded, by
    kind (they replace that kind's prior)."""

    target: ModelShape
    placement: Placement
    heads: tuple[HeadOption, ...] = ()
    self_draft: SelfOption | None = None
    catalog: CatalogOption | None = None
    measured: Mapping[str, AcceptanceCurve] = field(default_factory=dict)


@dataclass(frozen=True)
class Candidate:
    """One priced (or refused) candidate. tokens_per_second None: not priced."""

    kind: DraftKind
    label: str
    tokens_per_second: float | None
    reason: str
    budget: int = 0
    max_depth: int = 0
    bits: int | None = None
    runnable: bool = True  # False: it cannot run here at all (reason says why)


@dataclass(frozen=True)
class DraftChoice:
    """The draft that runs: kind, a label for people, the predicted tok/s (None without a
    profile), why, and every other candidate with its reason."""

    kind: DraftKind
    label: str
    tokens_per_second: float | None
    reason: str
    rejected: tuple[Candidate, ...] = ()
    bits: int | None = None
    budget: int = 0
    max_depth: int = 0

    def as_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "label": self.label, "reason": self.reason}


NONE_LABEL = "none (draft-free)"


def manual_choice(kind: DraftKind, label: str, reason: str = "chosen by hand", bits: int | None = None) -> DraftChoice:
    """A draft the user named (--draft MODEL, self:BITS, none): nothing priced."""
    return DraftChoice(kind, label, None, reason, bits=bits)


def self_label(bits: int, substituted: int, num_layers: int) -> str:
    return f"self-draft, {bits}-bit ({substituted} of {num_layers} layers)"


# ---- pricing -----------------------------------------------------------------------------------
def head_pass(profile: HardwareProfile, target: ModelShape, layers: int) -> Callable[[int], float]:
    """A head's draft pass over n nodes: its decoder layers plus the target's head."""
    return lambda n: layers * compute_seconds(profile, target.layer_params, n) + head_seconds(profile, target, n)


def self_pass(profile: HardwareProfile, target: ModelShape, placement: Placement, bits: int,
              substituted: int, fused: bool = False) -> Callable[[int], float]:
    """A self-draft's pass over n nodes: the resident layers as the target runs them, each
    substitute's compute and de-quantisation at VRAM speed, the head; no PCIe copy. `fused`: a
    what-if for projections, a low-bit kernel that reads the codes instead of a de-quantised
    copy (the substitute's memory-bound time at bits/16 of a 16-bit layer's bytes)."""
    params = target.layer_params
    gpu = profile.gpu
    unpack = params * (bits / 8 + 2) / (gpu.device_memory_gbps * GB) if gpu is not None else 0.0

    def substitute(n: int) -> float:
        dense = compute_seconds(profile, params, n)
        if not fused:
            return dense + unpack
        one = compute_seconds(profile, params, 1)
        return compute_seconds(profile, int(params * bits / 16), 1) + dense - one

    def seconds(n: int) -> float:
        resident = placement.gpu_layers * compute_seconds(profile, params, n, placement.quant,
                                                          placement.resident_form)
        return resident + substituted * substitute(n) + head_seconds(profile, target, n)
    return seconds


def _self_refusal(options: DraftOptions) -> str:
    placement, opt = options.placement, options.self_draft
    if opt is not None and opt.refusal:
        return opt.refusal
    if not placement.device.startswith("cuda"):
        return ("on a CPU a self-draft runs the target's own layers on the same cores, as costly as the target, "
                "so it cannot beat draft-free")
    if placement.gpu_layers >= placement.num_layers:
        return ("every layer of the target is resident on the GPU, so a self-draft would be the target itself at "
                "its cost: it cannot beat draft-free")
    if opt is None:
        return "no self-draft could be built here"
    if opt.bits is None:
        return (f"low-bit substitutes of its {opt.substituted} offloaded layers do not fit in the memory left, "
                f"even at {SELF_BITS[-1]} bits")
    return ""


def choose_draft(options: DraftOptions, profile: HardwareProfile | None) -> DraftChoice:
    """The fastest candidate on `profile` (the fallback rules without one); module docstring."""
    target, placement = options.target, options.placement
    why_no_profile = ""
    if profile is None:
        why_no_profile = "no hardware profile (`specchat bench hardware` measures one)"
    elif placement.device.startswith("cuda") != profile.layer_timing.device.startswith("cuda"):
        why_no_profile = "the hardware profile was measured on another kind of device"
    priced = None if why_no_profile else profile
    ar = autoregressive_tokens_per_second(priced, target, placement) if priced is not None else None
    out: list[Candidate] = []
    for head in options.heads:
        if head.refusal:
            out.append(Candidate(head.kind, head.label, None, head.refusal, runnable=False))
            continue
        out.append(_price(priced, options, head.kind, head.label, None, ModelShape(
            head.label, head.layers, target.layer, target.vocab_size),
            head_pass(priced, target, head.layers) if priced is not None else None))
    refusal = _self_refusal(options)
    if refusal:
        out.append(Candidate("self", "self-draft", None, refusal, runnable=False))
    else:
        opt = options.self_draft
        assert opt is not None and opt.bits is not None
        label = self_label(opt.bits, opt.substituted, target.num_layers)
        out.append(_price(priced, options, "self", label, opt.bits, target,
                          self_pass(priced, target, placement, opt.bits, opt.substituted) if priced else None))
    if options.catalog is not None:
        out.append(_price(priced, options, "catalog", options.catalog.label, None, options.catalog.shape, None))
    else:
        out.append(Candidate("catalog", "catalog draft", None, "no catalog draft for this target (or it is not downloaded)",
                             runnable=False))
    runnable = [c for c in out if c.runnable]
    if not priced:
        if runnable:
            best = runnable[0]
            reason = f"{why_no_profile}: the first candidate that can run is taken ({best.label})"
            return _chosen(best, None, reason, out)
        return DraftChoice("none", NONE_LABEL, None, f"{why_no_profile}; no draft can run here", tuple(out))
    assert ar is not None
    faster = [c for c in out if c.tokens_per_second is not None and c.tokens_per_second > ar]
    if not faster:
        tried = [c for c in out if c.tokens_per_second is not None]
        top = max(tried, key=lambda c: c.tokens_per_second or 0.0) if tried else None
        best_note = f"; the best, {top.label}, would give {top.tokens_per_second:.2f}" if top else ""
        return DraftChoice("none", NONE_LABEL, ar, f"no draft is predicted faster than draft-free decoding "
                           f"({ar:.2f} tok/s){best_note}", tuple(_demote(c, ar) for c in out))
    best = max(faster, key=lambda c: (c.tokens_per_second, -KINDS.index(c.kind)))
    reason = (f"predicted fastest: {best.tokens_per_second:.2f} tok/s at budget {best.budget} against "
              f"{ar:.2f} tok/s draft-free ({_source(options, best)})")
    others = [_demote(c, ar) for c in out if c is not best]  # "slower than the chosen draft" where above ar
    others.append(Candidate("none", NONE_LABEL, ar, f"{ar:.2f} tok/s: slower than {best.label}"))
    return _chosen(best, best.tokens_per_second, reason, others)


def _chosen(best: Candidate, tps: float | None, reason: str, candidates: list[Candidate]) -> DraftChoice:
    rest = tuple(c for c in candidates if c is not best)
    return DraftChoice(best.kind, best.label, tps, reason, rest, best.bits, best.budget, best.max_depth)


def _demote(c: Candidate, ar: float) -> Candidate:
    """A priced candidate that lost: its figure against draft-free's leads its reason."""
    if c.tokens_per_second is None:
        return c
    verdict = "not faster than draft-free" if c.tokens_per_second <= ar else "slower than the chosen draft"
    return replace(c, reason=f"{c.tokens_per_second:.2f} tok/s, {verdict} ({ar:.2f} draft-free): {c.reason}")


def _source(options: DraftOptions, c: Candidate) -> str:
    if c.kind in options.measured:
        return "measured acceptance"
    return PRIORS[c.kind].source if c.kind in PRIORS else "no prior"


def _price(profile: HardwareProfile | None, options: DraftOptions, kind: DraftKind, label: str, bits: int | None,
           shape: ModelShape, draft_pass: Callable[[int], float] | None) -> Candidate:
    if profile is None:
        return Candidate(kind, label, None, "not priced", bits=bits)
    curve = options.measured.get(kind) or prior_curve(kind, bits)
    plan = choose_budget(profile, options.target, shape, options.placement, curve, draft_pass=draft_pass)
    best = max(plan.curve, key=lambda p: p.tokens_per_second)
    return Candidate(kind, label, best.tokens_per_second,
                     f"{best.tokens_per_pass:.1f} tokens per pass at budget {best.budget}, draft "
                     f"{best.draft_seconds:.3f} s + target {best.target_seconds:.3f} s per step",
                     best.budget, best.max_depth, bits)


# ---- a self-draft's memory, for a target that is not loaded (projections) ------------------------
def substitute_bytes_estimate(target: ModelShape, layers: int, bits: int) -> int:
    """Low-bit substitutes of `layers` decoder layers: the codes plus a byte scale and zero per
    SUBSTITUTE_GROUP weights (engine.loading.self_draft measures the real figure)."""
    return int(layers * target.layer_params * (bits / 8 + 2 / SUBSTITUTE_GROUP))


def device_left(profile: HardwareProfile, target: ModelShape, placement: Placement) -> int:
    """VRAM a profile's GPU has left beside `placement` of a target that is not loaded: less
    the resident layers, the head and embeddings, the caches, a pass's activations, the
    streaming ring and a margin (planner.estimate_placement's arithmetic)."""
    if profile.gpu is None:
        return 0
    needs = predicted_needs(profile, target)
    streamed = placement.gpu_layers < placement.num_layers
    ring = RING_SLOTS * placement.layer_bytes + (target.layer_params * 2 if placement.quant != "none" else 0)
    return (profile.gpu.vram_free - needs.fixed - needs.kv_at(PREDICTED_CONTEXT) - needs.activations - GIB
            - placement.gpu_layers * placement.layer_bytes - (ring if streamed else 0))


def projected_self_option(profile: HardwareProfile, target: ModelShape, placement: Placement) -> SelfOption:
    """The self-draft a profile's GPU could hold beside `placement`: the widest bits whose
    substitutes fit in device_left."""
    offloaded = placement.num_layers - placement.gpu_layers
    left = device_left(profile, target, placement)
    bits = next((b for b in SELF_BITS if substitute_bytes_estimate(target, offloaded, b) <= left), None)
    return SelfOption(bits, offloaded, placement.gpu_layers)


def project_self_placements(profile: HardwareProfile, target: ModelShape,
                            placement: Placement) -> list[tuple[Placement, SelfOption]]:
    """The placements a self-draft could run beside: the loader's own, and with fewer resident
    target layers (each resident layer given up makes room for its substitute and others)."""
    out = []
    for gpu in range(placement.gpu_layers, -1, -1):
        moved = placement.gpu_layers - gpu
        trial = replace(placement, gpu_layers=gpu, ram_layers=placement.ram_layers + moved)
        option = projected_self_option(profile, target, trial)
        if option.bits is not None:
            out.append((trial, option))
            if option.bits == SELF_BITS[0]:
                break
    return out
