"""Budget "auto" in one place: the tree shape a request gets when it asks for budget 0.

`AutoBudget(backend)` wraps anything with `generate(request, cancel)`: the local Engine, a
remote engine, a test double. A request whose speculation budget is 0 leaves it with
- the planner's mode, budget and depth for the loaded pair on this machine's hardware profile
  (engine.planning.planner.plan_for_pair, calibrated from the passes the engine has recorded,
  so the choice improves as the conversation goes on; an MoE target's trees priced by the experts
  its passes were measured to wake, `routed_shape`), among the budgets whose tree pass fits
  in the memory free where the target runs (a 2,048-token tree under a 12 GiB card's cap ran
  out of memory in `bench gpu` while the planner had chosen it);
- without a profile for this device, or without a draft, FALLBACK_BUDGET: draft-free trees
  price themselves step by step (costs.best_size), so they need no plan;
- where the planner finds that the draft's trees do not pay, no draft: context candidates
  alone (they cost nothing where nothing repeats), or one token per pass when the request
  turned them off.
Every other request passes through unchanged; so does every request to a backend that is not a
local Engine (a remote server chooses its own). The CLI's chat, generate and serve and the
app's worker all decode through it; `choice()` says what was chosen and why, for their status
lines. Nothing here runs a model pass.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import Protocol

import torch

from engine.decoding.generation import Engine
from engine.decoding.memory import free_memory
from engine.kernels.expert_unions import measured_unions
from engine.planning.moe import fit_sharing
from engine.planning.placement import activation_bytes
from engine.planning.planner import DEFAULT_BUDGETS, plan_for_pair
from engine.planning.profile import HardwareProfile, load_profile
from engine.shapes import ModelShape
from engine.types import AUTO_FALLBACK_BUDGET, Completion, DecodeMode, GenerationRequest, TokenEvent

log = logging.getLogger(__name__)

FALLBACK_BUDGET = AUTO_FALLBACK_BUDGET  # without a plan (no hardware profile for this device, or no draft)
AUTO = 0  # SpeculationSettings.budget that asks for this module's choice


class Backend(Protocol):
    def generate(self, request: GenerationRequest,
                 cancel: threading.Event | None = None) -> Iterator[TokenEvent | Completion]: ...


@dataclass(frozen=True)
class BudgetChoice:
    """What budget "auto" became. draft False: the draft's trees are not grown (the planner
    found they do not pay, or none fits in memory). source: "planner" (the cost model chose)
    or "fallback" (no profile for this device, or no draft: FALLBACK_BUDGET)."""

    draft: bool
    budget: int
    max_depth: int
    source: str
    reason: str
    predicted_tokens_per_second: float | None = None

    def describe(self) -> str:
        if not self.draft:
            return f"the draft is not used ({self.reason})"
        return f"budget {self.budget}, depth {self.max_depth} ({self.reason})"


class AutoBudget:
    """`generate` with budget 0 resolved per request (see the module docstring). `on_choice`
    is called whenever the choice changes (the CLI prints it, the app shows it)."""

    def __init__(self, backend: Backend, profile: Callable[[], HardwareProfile | None] = load_profile,
                 on_choice: Callable[[BudgetChoice], None] | None = None,
                 free: Callable[[torch.device], int] = free_memory) -> None:
        self.backend = backend
        self._profile = profile
        self._free = free
        self._on_choice = on_choice
        self._last: BudgetChoice | None = None

    def choice(self) -> BudgetChoice | None:
        """The most recent choice (None before the first request that asked for one)."""
        return self._last

    def generate(self, request: GenerationRequest,
                 cancel: threading.Event | None = None) -> Iterator[TokenEvent | Completion]:
        return self.backend.generate(self.resolve(request), cancel)

    def resolve(self, request: GenerationRequest) -> GenerationRequest:
        """The request with budget 0 replaced (others unchanged)."""
        spec = request.speculation
        engine = self.backend if isinstance(self.backend, Engine) else None
        if spec.budget != AUTO:
            return request
        if engine is None:  # a remote engine chooses for itself; the field must still be valid
            return replace(request, speculation=replace(spec, budget=FALLBACK_BUDGET))
        chosen = self._choose(engine, request)
        if chosen != self._last:
            self._last = chosen
            log.info("budget auto: %s", chosen.describe())
            if self._on_choice is not None:
                self._on_choice(chosen)
        if not chosen.draft:
            mode: DecodeMode = spec.mode if spec.context else "autoregressive"
            return replace(request, speculation=replace(spec, mode=mode, draft=False, budget=chosen.budget))
        return replace(request, speculation=replace(spec, budget=chosen.budget, max_depth=chosen.max_depth))

    def _choose(self, engine: Engine, request: GenerationRequest) -> BudgetChoice:
        depth = request.speculation.max_depth
        wants_draft = request.speculation.draft and request.speculation.mode == "specexec"
        if engine.draft is None or not wants_draft:
            return BudgetChoice(False, FALLBACK_BUDGET, depth, "fallback",
                                "no draft: context candidates are priced step by step")
        fits = budgets_that_fit(engine, request, self._free(engine.target.device))
        if not fits:
            return BudgetChoice(False, FALLBACK_BUDGET, depth, "planner", "no draft tree fits in the free memory")
        try:
            profile = self._profile()
        except Exception:  # noqa: BLE001 -- a plan is an optimisation; without one the fallback runs
            log.warning("reading the hardware profile failed", exc_info=True)
            profile = None
        plan = None if profile is None else plan_for_pair(
            profile, routed_shape(engine), engine.draft.shape, engine.placement, engine.pass_record, budgets=fits)
        capped = f"; trees above {max(fits)} tokens do not fit in the free memory" if max(fits) < max(DEFAULT_BUDGETS) else ""
        if plan is None:
            budget = max((b for b in fits if b <= FALLBACK_BUDGET), default=min(fits))
            return BudgetChoice(True, budget, depth, "fallback",
                                "no hardware profile for this device (`specchat bench hardware` measures one)" + capped)
        if plan.mode == "autoregressive":
            return BudgetChoice(False, FALLBACK_BUDGET, depth, "planner", plan.reason, plan.tokens_per_second)
        return BudgetChoice(True, plan.budget, plan.max_depth, "planner", plan.reason + capped,
                            plan.tokens_per_second)


def routed_shape(engine: Engine) -> ModelShape:
    """The target's shape with the routing its MoE layers measured so far (engine.kernels.experts
    .measured_unions, with what earlier processes measured: Engine.routing_seed; fitted by
    engine.planning.moe.fit_sharing): the planner then prices trees by the experts this model's
    tokens really wake, not the prior's spread. Unchanged for a dense model, or before a pass of
    2+ tokens."""
    shape = engine.target.shape
    hf_model = getattr(engine.target, "hf_model", None)
    if shape.experts is None or hf_model is None:
        return shape
    unions = measured_unions(hf_model.modules(), getattr(engine, "routing_seed", None))
    if not unions:
        return shape
    sharing = fit_sharing(unions, shape.experts.experts, shape.experts.top_k)
    return replace(shape, experts=replace(shape.experts, sharing=sharing))


def budgets_that_fit(engine: Engine, request: GenerationRequest, free: int,
                     budgets: tuple[int, ...] = DEFAULT_BUDGETS) -> tuple[int, ...]:
    """The budgets whose tree pass fits beside the caches in `free` bytes, the memory free where
    the target runs (memory.free_memory; on a CPU the available RAM): both models' activations
    for the tree (placement.activation_bytes: a generous estimate, every head's attention
    scores included) plus both KV caches for the prompt, the answer and the tree."""
    target, draft = engine.target, engine.draft
    esize = target.dtype.itemsize
    context = engine.context_length
    tokens = min(context, len(engine.encode(request)) + request.max_new_tokens)

    def need(shape: ModelShape, budget: int) -> int:
        layer = shape.layer
        act = activation_bytes(budget, tokens + budget, layer.hidden_size, shape.activation_width,
                               layer.num_attention_heads, shape.vocab_size, esize)
        return act + shape.kv_bytes(tokens, 4 * budget, esize)  # each layer by its kind (engine.shapes)

    return tuple(b for b in budgets
                 if need(target.shape, b) + (need(draft.shape, b) if draft is not None else 0) <= free)
