"""engine.decoding.draft_choice: which draft runs, from plain data (hardware profiles, shapes,
placements), and where the choice flips: a CPU decodes draft-free, a GPU streaming a 4-bit 70B
takes a self-draft that fits, a target with an MTP head takes the head where it is predicted
faster, and each refusal says why."""

from __future__ import annotations

import dataclasses

import pytest

from engine.decoding.draft_choice import (
    CatalogOption,
    DraftOptions,
    HeadOption,
    SelfOption,
    choose_draft,
    prior_curve,
    project_self_placements,
    projected_self_option,
    self_pass,
    substitute_bytes_estimate,
)
from engine.planning import planner
from engine.planning.calibration import AcceptanceCurve, MeasuredBudget
from engine.planning.profile import LAYER_SHAPES, HardwareProfile, LayerTiming
from engine.planning.reference import reference_profile
from engine.shapes import ModelShape, Placement
from engine.store.catalog import load_catalog

LLAMA_70B = ModelShape("llama-70b", 80, LAYER_SHAPES["llama-70b"], 128256)
LLAMA_1B = load_catalog().find("llama-3.2-1b-instruct").shape()  # type: ignore[union-attr]


def cpu_profile() -> HardwareProfile:
    """Shaped like this 2-core machine's measurement (70B layer, fp32; as tests/engine/planning)."""
    shape = LAYER_SHAPES["llama-70b"]
    timing = LayerTiming(shape, "cpu", "float32", shape.params * 4,
                         ((1, 0.30), (4, 0.31), (16, 0.40), (64, 0.85), (128, 1.38)), 0.0004)
    return dataclasses.replace(reference_profile("rtx4090"), gpus=(), layer_timing=timing, ram_total=25 * 10**9,
                               ram_available=24 * 10**9, disk_read_gbps=1.5, ram_copy_gbps=5.0)


def streamed_70b(profile: HardwareProfile) -> Placement:
    """Llama-70B at 4 bits (NF4) where the loader would put it on `profile`: part on the GPU."""
    placement = planner.estimate_placement(profile, LLAMA_70B, "nf4")
    assert 0 < placement.gpu_layers < placement.num_layers
    return placement


def self_option(placement: Placement, bits: int | None = 3) -> SelfOption:
    return SelfOption(bits, placement.num_layers - placement.gpu_layers, placement.gpu_layers)


def test_a_cpu_decodes_draft_free_and_the_self_draft_says_it_costs_as_much_as_the_target() -> None:
    profile = cpu_profile()
    placement = Placement(80, 0, 80, 0, LLAMA_70B.layer_params * 4, "none", "cpu")
    choice = choose_draft(DraftOptions(LLAMA_70B, placement, self_draft=self_option(placement, 4)), profile)
    assert choice.kind == "none"
    rejected = {c.kind: c for c in choice.rejected}
    assert "CPU" in rejected["self"].reason and "as costly as the target" in rejected["self"].reason
    assert rejected["self"].tokens_per_second is None
    assert choice.tokens_per_second == pytest.approx(planner.autoregressive_tokens_per_second(profile, LLAMA_70B,
                                                                                              placement))


def test_a_gpu_streaming_a_4bit_70b_takes_a_self_draft_that_fits() -> None:
    profile = reference_profile("rtx4090")
    placement = streamed_70b(profile)
    choice = choose_draft(DraftOptions(LLAMA_70B, placement, self_draft=self_option(placement, 3)), profile)
    assert choice.kind == "self" and choice.bits == 3
    assert choice.label == f"self-draft, 3-bit ({80 - placement.gpu_layers} of 80 layers)"
    ar = planner.autoregressive_tokens_per_second(profile, LLAMA_70B, placement)
    assert choice.tokens_per_second is not None and choice.tokens_per_second > 1.5 * ar
    assert "SubSpec" in choice.reason
    assert [c.kind for c in choice.rejected] == ["catalog", "none"]


def test_the_self_draft_loses_when_nothing_is_offloaded_or_it_does_not_fit() -> None:
    profile = reference_profile("rtx4090")
    resident = Placement(80, 80, 0, 0, int(LLAMA_70B.layer_params * 0.5625), "nf4", "cuda:0")
    choice = choose_draft(DraftOptions(LLAMA_70B, resident, self_draft=self_option(resident, 4)), profile)
    assert choice.kind == "none"
    assert "would be the target itself" in next(c for c in choice.rejected if c.kind == "self").reason
    placement = streamed_70b(profile)
    choice = choose_draft(DraftOptions(LLAMA_70B, placement, self_draft=self_option(placement, None)), profile)
    assert choice.kind == "none"
    assert "do not fit" in next(c for c in choice.rejected if c.kind == "self").reason


def test_the_planner_prices_the_self_draft_by_its_cost_not_only_its_acceptance() -> None:
    """The same self-draft beside a 1B catalog draft: the 1B draft's passes are much cheaper than
    the self-draft's (resident 4-bit layers and substitutes de-quantised each pass), so it wins;
    with a measured self-draft acceptance far above the prior the choice flips back."""
    profile = reference_profile("rtx4090")
    placement = streamed_70b(profile)
    options = DraftOptions(LLAMA_70B, placement, self_draft=self_option(placement, 3),
                           catalog=CatalogOption("llama-3.2-1b-instruct", LLAMA_1B))
    assert choose_draft(options, profile).kind == "catalog"
    great = AcceptanceCurve(measured=tuple(MeasuredBudget(b, 50, min(40.0, 1 + b / 4), 6.0)
                                           for b in planner.DEFAULT_BUDGETS))
    flipped = choose_draft(dataclasses.replace(options, measured={"self": great}), profile)
    assert flipped.kind == "self" and "measured acceptance" in flipped.reason


def test_an_mtp_head_wins_where_it_is_predicted_faster_and_loses_where_it_measures_poorly() -> None:
    profile = reference_profile("rtx3060-12gb")
    target = load_catalog().find("qwen3.6-27b").shape()  # type: ignore[union-attr]
    placement = planner.estimate_placement(profile, target, "nf4")
    mtp = HeadOption("mtp", "MTP head (1 layer)")
    options = DraftOptions(target, placement, heads=(mtp,), self_draft=self_option(placement, 4))
    choice = choose_draft(options, profile)
    assert choice.kind == "mtp" and choice.label == "MTP head (1 layer)"
    assert "llama.cpp" in choice.reason
    assert {c.kind for c in choice.rejected} == {"self", "catalog", "none"}
    poor = AcceptanceCurve(measured=tuple(MeasuredBudget(b, 50, 1.05, 3.0) for b in planner.DEFAULT_BUDGETS))
    assert choose_draft(dataclasses.replace(options, measured={"mtp": poor}), profile).kind == "self"


def test_a_head_pass_costs_one_layer_and_the_head_and_a_self_pass_no_pcie_copy() -> None:
    profile = reference_profile("rtx4090")
    placement = streamed_70b(profile)
    one_layer = planner.compute_seconds(profile, LLAMA_70B.layer_params, 8)
    head = planner.head_seconds(profile, LLAMA_70B, 8)
    from engine.decoding.draft_choice import head_pass

    assert head_pass(profile, LLAMA_70B, 1)(8) == pytest.approx(one_layer + head)
    substituted = 80 - placement.gpu_layers
    t = self_pass(profile, LLAMA_70B, placement, 3, substituted)(8)
    copy = placement.layer_bytes / (profile.gpu.pinned_h2d_gbps * 1e9)  # type: ignore[union-attr]
    assert t < planner.target_pass_seconds(profile, LLAMA_70B, placement, 8)  # no link in it
    assert t > 80 * one_layer  # every layer runs, de-quantisation on top
    assert t < 80 * (one_layer + copy)


def test_without_a_profile_the_fallback_takes_the_first_that_can_run_and_says_so() -> None:
    placement = Placement(80, 20, 60, 0, int(LLAMA_70B.layer_params * 0.5625), "nf4", "cuda:0")
    options = DraftOptions(LLAMA_70B, placement, self_draft=self_option(placement, 2),
                           catalog=CatalogOption("llama-3.2-1b-instruct", LLAMA_1B))
    choice = choose_draft(options, None)
    assert choice.kind == "self" and choice.tokens_per_second is None
    assert "no hardware profile" in choice.reason
    cpu = Placement(80, 80, 0, 0, LLAMA_70B.layer_params * 4, "none", "cpu")
    assert choose_draft(DraftOptions(LLAMA_70B, cpu, self_draft=self_option(cpu, 2)), None).kind == "none"
    # a GPU profile does not price a CPU placement: the fallback again, saying why
    on_cpu = choose_draft(DraftOptions(LLAMA_70B, cpu, catalog=CatalogOption("1b", LLAMA_1B)),
                          reference_profile("rtx4090"))
    assert on_cpu.kind == "catalog" and "another kind of device" in on_cpu.reason


def test_the_priors_rank_as_their_sources_say() -> None:
    a = {k: prior_curve(k).tokens_per_pass(256, 32) for k in ("catalog", "self", "mtp", "assistant")}
    assert a["self"] > a["catalog"]
    assert prior_curve("mtp").tokens_per_pass(3, 3) == pytest.approx(3.25, abs=0.01)  # 75 % of 3 drafted
    assert prior_curve("mtp").tokens_per_pass(1024, 32) < 4.0  # no path deeper than 3 is credited
    assert prior_curve("assistant").tokens_per_pass(7, 7) == pytest.approx(4.8, abs=0.05)  # EAGLE-3, 7 drafted
    bits = [prior_curve("self", b).tokens_per_pass(256, 32) for b in (2, 3, 4)]
    assert bits == sorted(bits) and bits[0] < bits[2]


def test_a_self_draft_of_a_70b_does_not_fit_a_24gb_card_but_fits_an_80gb_one_beside_fewer_layers() -> None:
    small = reference_profile("rtx4090")
    placement = streamed_70b(small)
    assert projected_self_option(small, LLAMA_70B, placement).bits is None
    assert project_self_placements(small, LLAMA_70B, placement) == []
    assert substitute_bytes_estimate(LLAMA_70B, 80, 2) > 14e9  # 80 layers at 2 bits (+ scales)
    big = dataclasses.replace(small, gpus=(dataclasses.replace(small.gpus[0], vram_free=40 * 10**9),))
    found = project_self_placements(big, LLAMA_70B, streamed_70b(big))
    assert found and all(opt.bits is not None for _, opt in found)
