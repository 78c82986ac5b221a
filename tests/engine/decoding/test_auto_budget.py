"""Budget "auto" in one place (engine.decoding.auto_budget): the planner's choice on the saved
profile, the fallback without one, only trees that fit in free memory, pass-through otherwise."""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Iterator

import pytest

from engine.decoding.memory import free_memory
from engine.decoding.auto_budget import FALLBACK_BUDGET, AutoBudget, BudgetChoice, budgets_that_fit
from engine.decoding.generation import Engine
from engine.errors import InvalidRequest
from engine.loading.load import LoadedModel, load_model
from engine.testing.synthetic import tiny_model
from engine.planning.planner import DEFAULT_BUDGETS, plan_for_pair
from engine.planning.profile import LAYER_SHAPES, HardwareProfile, LayerTiming
from engine.planning.reference import reference_profile
from engine.types import CacheSettings, Completion, GenerationRequest, SpeculationSettings, TokenEvent

AUTO = SpeculationSettings(budget=0)


def request(spec: SpeculationSettings = AUTO) -> GenerationRequest:
    return GenerationRequest(raw_prompt="The quick brown fox", max_new_tokens=8, speculation=spec)


def profile_where_trees_pay() -> HardwareProfile:
    """A CPU profile whose layer costs the same for 1 and 128 tokens: trees are free, so the
    planner speculates (and picks large budgets when they fit)."""
    shape = LAYER_SHAPES["llama-70b"]
    flat = LayerTiming(shape, "cpu", "float32", shape.params * 4, ((1, 1.0), (16, 1.0), (128, 1.0)), 0.0)
    return dataclasses.replace(reference_profile("rtx4090"), gpus=(), layer_timing=flat)


def profile_where_trees_do_not_pay() -> HardwareProfile:
    shape = LAYER_SHAPES["llama-70b"]
    steep = LayerTiming(shape, "cpu", "float32", shape.params * 4, ((1, 0.3), (16, 4.8), (128, 38.4)), 0.0)
    return dataclasses.replace(reference_profile("rtx4090"), gpus=(), layer_timing=steep)


def test_the_engine_refuses_an_unresolved_budget(close_engine: Engine) -> None:
    with pytest.raises(InvalidRequest, match="AutoBudget"):
        close_engine.generate(request())


def test_without_a_profile_the_fallback_runs_and_says_why(close_engine: Engine) -> None:
    seen: list[BudgetChoice] = []
    auto = AutoBudget(close_engine, profile=lambda: None, on_choice=seen.append)
    out = list(auto.generate(request()))
    done = out[-1]
    assert isinstance(done, Completion) and done.stats.budget == FALLBACK_BUDGET
    assert len(seen) == 1 and seen[0].source == "fallback" and "bench hardware" in seen[0].reason
    list(auto.generate(request()))
    assert len(seen) == 1  # told once while the choice holds


@pytest.fixture(scope="module")
def big_small(model_cache, tiny_target: LoadedModel) -> Engine:
    """A target 6x as deep and 4x as wide as its draft (same tokenizer): where passes cost the
    same for any tree size, the draft's trees pay."""
    big = load_model(tiny_model("llama", seed=3, layers=6, hidden=256, cache_dir=model_cache))
    return Engine(big.model, big.tokenizer, tiny_target.model, CacheSettings(enabled=False))


def test_the_planners_choice_is_what_runs(big_small: Engine) -> None:
    profile = profile_where_trees_pay()
    auto = AutoBudget(big_small, profile=lambda: profile)
    resolved = auto.resolve(request())
    assert big_small.draft is not None
    fits = budgets_that_fit(big_small, request(), free_memory(big_small.target.device))
    plan = plan_for_pair(profile, big_small.target.shape, big_small.draft.shape, big_small.placement,
                         big_small.pass_record, budgets=fits)
    assert plan is not None and plan.mode == "specexec"
    assert (resolved.speculation.budget, resolved.speculation.max_depth) == (plan.budget, plan.max_depth)
    choice = auto.choice()
    assert choice is not None and choice.draft and choice.source == "planner"


def test_where_the_draft_does_not_pay_the_text_decodes_draft_free(close_engine: Engine) -> None:
    auto = AutoBudget(close_engine, profile=profile_where_trees_do_not_pay)
    done = list(auto.generate(request()))[-1]
    assert isinstance(done, Completion) and done.stats.mode in ("context", "autoregressive")
    assert done.stats.draft_passes == 0
    off = auto.resolve(request(dataclasses.replace(AUTO, context=False)))
    assert off.speculation.mode == "autoregressive"  # no context candidates asked for: one token per pass
    choice = auto.choice()
    assert choice is not None and not choice.draft and "does not pay" in choice.reason


def test_only_trees_that_fit_in_free_memory_are_planned(big_small: Engine) -> None:
    """The GPU proof's planner chose a 2,048-token tree under a 12 GiB cap and it ran out of
    memory. Here the free memory (what a capped card reports) holds trees up to some size."""
    all_fit = budgets_that_fit(big_small, request(), free_memory(big_small.target.device))
    assert all_fit == DEFAULT_BUDGETS  # RAM: a tiny model's trees all fit
    needs = _needs(big_small)
    assert all(needs[a] < needs[b] for a, b in zip(DEFAULT_BUDGETS, DEFAULT_BUDGETS[1:]))
    fits = budgets_that_fit(big_small, request(), needs[256])
    assert fits == tuple(b for b in DEFAULT_BUDGETS if b <= 256)
    auto = AutoBudget(big_small, profile=profile_where_trees_pay, free=lambda device: needs[256])
    assert auto.resolve(request()).speculation.budget <= 256
    choice = auto.choice()
    assert choice is not None and choice.draft and "do not fit" in choice.reason
    nothing = AutoBudget(big_small, profile=profile_where_trees_pay, free=lambda device: 0)
    assert not nothing.resolve(request()).speculation.draft


def _needs(engine: Engine) -> dict[int, int]:
    """Free memory at which exactly the budgets up to b fit (found by asking budgets_that_fit)."""
    out = {}
    for b in DEFAULT_BUDGETS:
        low, high = 0, 1 << 40
        while high - low > 1:
            mid = (low + high) // 2
            low, high = (low, mid) if b in budgets_that_fit(engine, request(), mid) else (mid, high)
        out[b] = high
    return out


class Recorder:
    """A backend that is not a local Engine (a remote server): it records what it was asked."""

    def __init__(self) -> None:
        self.requests: list[GenerationRequest] = []

    def generate(self, request: GenerationRequest,
                 cancel: threading.Event | None = None) -> Iterator[TokenEvent | Completion]:
        self.requests.append(request)
        return iter(())


def test_other_backends_and_fixed_budgets_pass_through(close_engine: Engine) -> None:
    remote = Recorder()
    list(AutoBudget(remote).generate(request()))
    assert remote.requests[0].speculation.budget == FALLBACK_BUDGET  # valid, and the server chooses its own
    fixed = request(SpeculationSettings(budget=8, max_depth=3))
    assert AutoBudget(close_engine, profile=profile_where_trees_pay).resolve(fixed) == fixed
