"""The planner prices a model the lean step takes (engine.model.lean_step: CUDA graphs) at the
lean step's measured cost a layer, where the engine would run it that way: steps and passes up to
lean_step.MAX_TOKENS of a model whose layers all live on the GPU (a hybrid draft's later levels
not), nothing windowed.
The figure is measured by the hardware profile on a GPU (engine.planning.lean_timing) and kept in
it; without it (a CPU, an older profile) every price is what it was."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from transformers import Gemma3TextConfig, LlamaConfig, Qwen3MoeConfig
from transformers.models.qwen3_5_moe.configuration_qwen3_5_moe import Qwen3_5MoeTextConfig

from engine.model import lean_step
from engine.planning import lean_timing, planner
from engine.planning.profile import HardwareProfile, check_profile, load_profile, save_profile
from engine.planning.reference import reference_profile
from engine.shapes import ModelShape, Placement

LEAN_S = 5e-5
LLAMA_8B = ModelShape.from_config(LlamaConfig(num_hidden_layers=32, intermediate_size=14336, num_key_value_heads=8))
DRAFT = ModelShape.from_config(LlamaConfig(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                                           num_attention_heads=32, num_key_value_heads=8, vocab_size=128256))


def lean(profile: HardwareProfile, seconds: float | None = LEAN_S) -> HardwareProfile:
    return dataclasses.replace(profile, layer_timing=dataclasses.replace(profile.layer_timing, lean_overhead_s=seconds))


def resident(shape: ModelShape, **kw: object) -> Placement:
    return Placement(shape.num_layers, shape.num_layers, device="cuda:0", **kw)  # type: ignore[arg-type]


def test_steps_and_small_passes_of_a_resident_model_cost_the_lean_figure_a_layer() -> None:
    general = reference_profile("rtx4090")
    fast = lean(general)
    cut = general.layer_timing.overhead_s - LEAN_S
    place = resident(LLAMA_8B)
    for n in (1, 7, lean_step.MAX_TOKENS):
        before = planner.target_pass_seconds(general, LLAMA_8B, place, n)
        assert planner.target_pass_seconds(fast, LLAMA_8B, place, n) == pytest.approx(before - LLAMA_8B.num_layers * cut)
    # a longer pass takes the general path (the MAX_TOKENS of lean_step)
    assert planner.target_pass_seconds(fast, LLAMA_8B, place, lean_step.MAX_TOKENS + 1) == \
        planner.target_pass_seconds(general, LLAMA_8B, place, lean_step.MAX_TOKENS + 1)
    assert planner.autoregressive_tokens_per_second(fast, LLAMA_8B, place) > \
        planner.autoregressive_tokens_per_second(general, LLAMA_8B, place)
    # a resident draft's levels too
    assert planner.draft_pass_seconds(fast, DRAFT, 16) == \
        pytest.approx(planner.draft_pass_seconds(general, DRAFT, 16) - DRAFT.num_layers * cut)
    # unmeasured, or measured at no less than the general path: the general path's price
    assert planner.target_pass_seconds(lean(general, None), LLAMA_8B, place, 1) == \
        planner.target_pass_seconds(general, LLAMA_8B, place, 1)
    assert planner.target_pass_seconds(lean(general, 1.0), LLAMA_8B, place, 1) == \
        planner.target_pass_seconds(general, LLAMA_8B, place, 1)


@pytest.mark.parametrize("case", ["streamed", "from disk", "de-quantised each pass", "cpu"])
def test_no_saving_where_the_engine_streams_or_runs_on_the_cpu(case: str) -> None:
    general = reference_profile("rtx4090")
    n = LLAMA_8B.num_layers
    place = {"streamed": Placement(n, n // 2, ram_layers=n - n // 2, device="cuda:0"),
             "from disk": Placement(n, n // 2, disk_layers=n - n // 2, device="cuda:0"),
             "de-quantised each pass": resident(LLAMA_8B, quant="gguf"),
             "cpu": Placement(n, n, device="cpu")}[case]
    assert lean_timing.saving(lean(general).layer_timing, LLAMA_8B, 1, place) == 0.0
    assert planner.target_pass_seconds(lean(general), LLAMA_8B, place, 1) == \
        planner.target_pass_seconds(general, LLAMA_8B, place, 1)
    cpu = dataclasses.replace(lean(general), gpus=())  # no GPU: no graphs
    assert planner.target_pass_seconds(cpu, LLAMA_8B, place, 1) == \
        planner.target_pass_seconds(dataclasses.replace(general, gpus=()), LLAMA_8B, place, 1)


def test_which_passes_of_which_families_are_lean() -> None:
    timing = lean(reference_profile("rtx4090")).layer_timing
    cut = timing.overhead_s - LEAN_S
    moe = ModelShape.from_config(Qwen3MoeConfig(num_hidden_layers=48, head_dim=128))
    hybrid = ModelShape.from_config(Qwen3_5MoeTextConfig())  # Gated DeltaNet layers: steps, trees
    assert lean_timing.saving(timing, hybrid, 1) == pytest.approx(cut)
    assert lean_timing.saving(timing, hybrid, 16) == pytest.approx(cut)
    assert lean_timing.saving(timing, hybrid, 16, levels=True) == 0.0  # a hybrid draft's later levels
    assert lean_timing.saving(timing, moe, 16, levels=True) == pytest.approx(cut)
    assert lean_timing.saving(timing, moe, 64) == pytest.approx(cut)
    windowed = ModelShape.from_config(Gemma3TextConfig(num_hidden_layers=12))
    assert any(c.window for c in windowed.cache_layers)
    assert lean_timing.saving(timing, windowed, 1) == 0.0
    assert lean_timing.saving(timing, moe, 0) == 0.0


def test_experts_on_the_cpu_keep_their_price_beside_the_lean_layers() -> None:
    """An MoE on an 8 GB card with its experts in RAM: the CPU's experts and the hand-off are
    what they were; only the GPU side's cost a layer changes."""
    general = reference_profile("rtx2080-8gb", pinned_gbps=12.0, ram_gb=64)
    moe = ModelShape.from_config(Qwen3_5MoeTextConfig())
    place = planner.estimate_placement(general, moe, "gguf")
    assert place.resident_form == "experts-cpu" and not place.ram_layers
    step = planner.target_pass_seconds(general, moe, place, 1)
    fast = planner.target_pass_seconds(lean(general), moe, place, 1)
    assert fast == pytest.approx(step - moe.num_layers * (general.layer_timing.overhead_s - LEAN_S))
    assert fast > moe.num_layers * planner.expert_seconds(general, moe, 1)
    tree = planner.target_pass_seconds(general, moe, place, 8)  # a tree of 8: the same cut a layer
    assert planner.target_pass_seconds(lean(general), moe, place, 8) == \
        pytest.approx(tree - moe.num_layers * (general.layer_timing.overhead_s - LEAN_S))


def test_the_figure_is_kept_in_the_profile(tmp_path: Path) -> None:
    measured = lean(reference_profile("rtx4090"))
    assert load_profile(save_profile(measured, tmp_path / "p.json")) == measured
    assert any("lean step" in line for line in measured.summary_lines())
    older = json.loads((tmp_path / "p.json").read_text())
    del older["layer_timing"]["lean_overhead_s"]  # a profile saved before the figure existed
    (tmp_path / "old.json").write_text(json.dumps(older))
    old = load_profile(tmp_path / "old.json")
    assert old is not None and old.layer_timing.lean_overhead_s is None
    assert not any("lean step" in line for line in old.summary_lines())
    with pytest.raises(ValueError, match="lean_overhead_s"):
        check_profile(lean(reference_profile("rtx4090"), -1e-5))


def test_the_planner_knows_the_lean_steps_longest_pass() -> None:
    assert lean_timing.MAX_TOKENS == lean_step.MAX_TOKENS


def test_the_figure_is_measured_only_on_a_gpu() -> None:
    assert lean_timing.lean_layer_overhead("cpu", torch.float32) is None
    # the same code on the CPU with the lean step forced (eager): a figure, not a GPU's
    forced = lean_timing.lean_layer_overhead("cpu", torch.float32, anywhere=True)
    assert forced is not None and forced >= 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_lean_figure_is_measured_below_the_general_paths() -> None:
    from engine.planning.measure import _layer_timing
    from engine.planning.profile import LAYER_SHAPES

    timing = _layer_timing(LAYER_SHAPES["tiny"], "cuda:0", (1,), lambda _f, _m: None)
    assert timing.lean_overhead_s is not None and 0 < timing.lean_overhead_s < timing.overhead_s
