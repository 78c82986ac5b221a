"""MoE models in the planner: their shapes count every expert against the published parameter
counts, a pass is priced by the union of the experts its tokens wake (engine.planning.moe), the
CPU's packed-expert timing is measured and kept in the profile, a GGUF too big for the GPU is
placed with its experts on the CPU as the loader does, and `bench plan --moe` prints the
labelled projection."""

from __future__ import annotations

from dataclasses import replace

import dataclasses
import json
from pathlib import Path

import pytest
from transformers import Glm4MoeConfig, GptOssConfig, LlamaConfig, MixtralConfig, Qwen3MoeConfig
from transformers.models.qwen3_5_moe.configuration_qwen3_5_moe import Qwen3_5MoeTextConfig

from engine.cli.main import main
from engine.errors import InvalidRequest
from engine.planning import planner
from engine.planning.calibration import AcceptanceCurve
from engine.planning.measure import expert_timing
from engine.planning.moe import expert_union
from engine.planning.profile import LAYER_SHAPES, ExpertTiming, HardwareProfile, LayerTiming, read_profile, save_profile
from engine.planning.reference import reference_profile
from engine.shapes import ModelShape

B = 1e9


@pytest.mark.parametrize("config,total,active", [
    (Qwen3MoeConfig(num_hidden_layers=48, head_dim=128), 30.5, 3.3),  # Qwen3-30B-A3B's model card
    (MixtralConfig(), 46.7, 12.9),  # Mixtral-8x7B
    (GptOssConfig(num_hidden_layers=24, num_local_experts=32), 20.91, None),  # gpt-oss-20b (the catalog's figure)
    (GptOssConfig(num_hidden_layers=36, num_local_experts=128), 116.83, None),  # gpt-oss-120b
    (Glm4MoeConfig(head_dim=128), 106.0, None),  # GLM-4.5-Air (its config.json sets head_dim 128)
    (Qwen3_5MoeTextConfig(), 35.0, 3.0),  # Qwen3.5-35B-A3B
], ids=["qwen3-30b-a3b", "mixtral-8x7b", "gpt-oss-20b", "gpt-oss-120b", "glm-4.5-air", "qwen3.5-35b-a3b"])
def test_moe_shapes_count_every_expert_and_a_tokens_top_k(config: object, total: float, active: float | None) -> None:
    shape = ModelShape.from_config(config)
    assert shape.experts is not None and shape.experts.top_k < shape.experts.experts
    assert shape.params / B == pytest.approx(total, rel=0.03)
    if active is not None:  # embeddings and head counted, as these cards count them
        assert (shape.num_layers * shape.active_params + 2 * shape.head_params) / B == pytest.approx(active, rel=0.1)
    # one token reads its top-k; a pass over many tokens at most every expert, once
    assert shape.union_params(1) == pytest.approx(shape.active_params, abs=shape.num_layers)
    assert shape.active_params < shape.union_params(4) < shape.union_params(4096) <= shape.layer_params + 1
    assert shape.activation_width < shape.layer.intermediate_size  # activations: top-k experts, not all


def test_dense_layers_beside_moe_layers_and_dense_models() -> None:
    glm = ModelShape.from_config(Glm4MoeConfig(num_hidden_layers=10, first_k_dense_replace=2))
    assert glm.experts is not None and glm.experts.moe_layers == 8 and glm.moe_fraction == 0.8
    qwen = ModelShape.from_config(Qwen3MoeConfig(num_hidden_layers=8, mlp_only_layers=[0, 1]))
    every = ModelShape.from_config(Qwen3MoeConfig(num_hidden_layers=8))
    assert qwen.experts is not None and qwen.experts.moe_layers == 6
    assert qwen.layer_params < every.layer_params  # two layers hold one dense MLP instead of 128 experts
    llama = ModelShape.from_config(LlamaConfig())
    assert llama.experts is None and llama.union_params(64) == llama.active_params == llama.layer_params
    assert llama.activation_width == llama.layer.intermediate_size and llama.always_params == llama.layer_params


def cpu_profile(experts: ExpertTiming | None) -> HardwareProfile:
    """Shaped like this project's 2-core CPU (bench hardware): a 70B fp32 layer at 0.30 s, packed
    experts read at 19 GB/s."""
    shape = LAYER_SHAPES["llama-70b"]
    timing = LayerTiming(shape, "cpu", "float32", shape.params * 4,
                         ((1, 0.30), (4, 0.31), (16, 0.40), (64, 0.85), (128, 1.38)), 0.0004)
    return dataclasses.replace(reference_profile("rtx4090"), gpus=(), layer_timing=timing, ram_total=25 * 10**9,
                               ram_available=24 * 10**9, ram_copy_gbps=5.0, cpu_experts=experts)


QWEN3_30B = ModelShape.from_config(Qwen3MoeConfig(num_hidden_layers=48, head_dim=128), "qwen3-30b-a3b")


def dense_like(moe: ModelShape) -> ModelShape:
    """A dense model whose layer has the MoE's active size."""
    return dataclasses.replace(moe, experts=None, layer=dataclasses.replace(moe.layer,
                                                                            intermediate_size=moe.activation_width))


def test_a_tree_on_an_moe_pays_for_the_experts_its_tokens_wake() -> None:
    profile = cpu_profile(ExpertTiming(1, 1, 19.0, 2.3e-11, 2))
    moe, dense = QWEN3_30B, dense_like(QWEN3_30B)
    assert dense.layer_params == pytest.approx(moe.active_params, rel=0.01)
    places = {s.name: planner.estimate_placement(profile, s, "gguf") for s in (moe, dense)}
    assert places[moe.name].resident_form == "kernel"

    def growth(shape: ModelShape, n: int) -> float:
        p = places[shape.name]
        return planner.target_pass_seconds(profile, shape, p, n) / planner.target_pass_seconds(profile, shape, p, 1)

    # 16 tokens wake ~82 of 128 experts (the prior): ~10x a token's bytes; a dense layer reads its once
    assert expert_union(16, 128, 8) == pytest.approx(82.4, abs=0.1)
    assert growth(moe, 16) > 2 * growth(dense, 16)
    # a measured union below the prior (a real router's) prices the same tree lower
    assert planner.expert_seconds(profile, moe, 16, union=24) < planner.expert_seconds(profile, moe, 16)
    draft = ModelShape.from_config(LlamaConfig(hidden_size=512, intermediate_size=1536, num_hidden_layers=4,
                                               num_attention_heads=8, num_key_value_heads=2, vocab_size=151936))
    plans = [planner.choose_budget(profile, s, draft, places[s.name], AcceptanceCurve()) for s in (moe, dense)]
    assert plans[0].budget <= plans[1].budget


def test_a_profile_without_an_expert_timing_prices_experts_from_its_ram() -> None:
    slow, fast = cpu_profile(None), cpu_profile(ExpertTiming(1, 1, 100.0, 1e-12, 16))
    assert planner.expert_seconds(slow, QWEN3_30B, 1) > planner.expert_seconds(fast, QWEN3_30B, 1) > 0
    assert planner.expert_seconds(slow, dense_like(QWEN3_30B), 8) == 0.0


@pytest.mark.parametrize("gpu,ram_gb,form,on_gpu", [
    ("rtx2080-8gb", 64, "experts-cpu", 48),  # too big for 8 GB: experts in RAM, the rest on the GPU
    ("a100-80gb", 128, "", 48),  # fits the GPU packed
    ("rtx2080-8gb", 16, "", None),  # neither: whole layers streamed, as for a dense model
])
def test_an_moe_gguf_too_big_for_the_gpu_keeps_its_experts_on_the_cpu(gpu: str, ram_gb: float, form: str,
                                                                       on_gpu: int | None) -> None:
    profile = reference_profile(gpu, ram_gb=ram_gb)
    placement = planner.estimate_placement(profile, QWEN3_30B, "gguf")
    assert placement.resident_form == form
    if on_gpu is not None:
        assert placement.gpu_layers == on_gpu
    else:
        assert placement.gpu_layers < QWEN3_30B.num_layers
    if form:  # the VRAM left caches a few experts (16-bit: ~4 % of them on 8 GB), priced as their share
        assert 0.01 < placement.cached_experts < 0.1
        assert f"experts: {100 * placement.cached_experts:.0f} % in VRAM, rest on CPU" in placement.describe()
        uncached = replace(placement, cached_experts=0.0)
        assert planner.target_pass_seconds(profile, QWEN3_30B, uncached, 1) > \
            QWEN3_30B.num_layers * planner.expert_seconds(profile, QWEN3_30B, 1)
        passes = [planner.target_pass_seconds(profile, QWEN3_30B, replace(placement, cached_experts=c), 1)
                  for c in (0.0, placement.cached_experts, 0.5, 1.0)]
        assert passes == sorted(passes, reverse=True) and passes[-1] < 0.65 * passes[0]  # (the layers' GPU overhead stays)
        bigger = planner.estimate_placement(reference_profile("rtx4060ti-16gb", ram_gb=ram_gb), QWEN3_30B, "gguf")
        assert bigger.resident_form == "experts-cpu" and bigger.cached_experts > 2 * placement.cached_experts
        streamed = replace(placement, cached_experts=0.0, experts_streamed=True)  # `--experts stream`
        assert streamed.describe() == f"all {QWEN3_30B.num_layers} layers on GPU, experts: in RAM, each pass's " \
                                      "streamed to the GPU (GGUF blocks)"


def test_the_cpu_expert_timing_is_measured_and_kept_in_the_profile(tmp_path: Path) -> None:
    timing = expert_timing(experts=16, tokens=4, repeats=1)
    assert timing is not None  # the kernel builds on this machine
    assert timing.read_gbps > 0.1 and timing.row_s_per_param > 0 and timing.expert_bytes < timing.expert_params
    profile = cpu_profile(timing)
    path = save_profile(profile, tmp_path / "p.json")
    assert read_profile(path) == profile
    assert any("MoE experts on the CPU" in line for line in profile.summary_lines())
    raw = json.loads(path.read_text())
    del raw["cpu_experts"]  # a profile measured before experts were timed
    path.write_text(json.dumps(raw))
    assert read_profile(path).cpu_experts is None
    raw["cpu_experts"] = {**dataclasses.asdict(timing), "read_gbps": -1.0}
    path.write_text(json.dumps(raw))
    with pytest.raises(InvalidRequest, match="read_gbps"):
        read_profile(path)


def test_bench_plan_moe_prints_a_labelled_projection(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "plan", "--moe"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("PROJECTION") and "not a measurement" in out and "36.7" in out
    assert main(["bench", "plan", "--moe", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    rows = got["rows"]
    assert got["projection"] and len(rows) == 12
    for row in rows:  # the 16 GB card's VRAM left caches more experts than the 8 GB one's
        assert f"experts: {100 * row['cached']:.0f} % in VRAM, rest on CPU" in row["placement"]
        assert 0 < row["cached"] < (0.05 if "8 GB" in row["machine"] else 0.3)
        assert row["best"] >= row["autoregressive"] > 0
        assert row["stream_from"] is None or row["stream_from"] > 16  # never a decode step
    by = {(r["machine"], r["expert_gbps"], r["experts_at"]): r["autoregressive"] for r in rows}
    for (machine, gbps, at), tok_s in by.items():  # faster expert reads, fewer bytes: never slower
        assert tok_s <= by.get((machine, gbps + 15, at), tok_s)
        assert tok_s <= by[(machine, gbps, "file bytes")]
    assert min(r["cached"] for r in rows if "16 GB" in r["machine"]) > 2 * max(r["cached"] for r in rows if "8 GB" in r["machine"])
    # by the GPU side's cost a layer: the first column is the table's own (the general path's
    # measured overhead), and a cheaper GPU layer is never slower
    best = {(r["machine"], r["expert_gbps"]): r["best"] for r in rows if r["experts_at"] == "kernel bytes"}
    sens = got["by_gpu_layer_overhead"]
    assert len(sens) == 6 and all(s["overhead_s"][0] == 8.6e-4 and s["overhead_s"][-1] == 0.0 for s in sens)
    for s in sens:
        assert s["best_tok_s"][0] == pytest.approx(best[(s["machine"], s["expert_gbps"])])
        assert s["best_tok_s"] == sorted(s["best_tok_s"])
    assert "PROJECTION by the GPU side's cost a layer" in out and "not measured" in out
    assert main(["bench", "plan"]) == 2
    assert "--target" in capsys.readouterr().err


def test_measured_routing_is_fitted_and_prices_trees_by_it() -> None:
    from engine.planning.moe import fit_sharing

    curve = {n: (10, expert_union(n, 128, 8, 0.4)) for n in (2, 8, 64)}
    assert fit_sharing(curve, 128, 8) == pytest.approx(0.4, abs=0.01)
    assert fit_sharing({n: (10, expert_union(n, 128, 8)) for n in (2, 8, 64)}, 128, 8) == 1.0  # the prior
    assert fit_sharing({}, 128, 8) == fit_sharing({1: (50, 8.0)}, 128, 8) == 1.0  # nothing measured
    assert fit_sharing({4: (3, 40.0)}, 128, 8) == 1.0  # above the prior: priced at the prior, no higher
    assert expert_union(1, 128, 8, 0.3) == pytest.approx(8) and expert_union(10**12, 128, 8, 0.3) == pytest.approx(128)
    # the synthetic MoE's routing (`bench offload --moe`, random weights: alike token states)
    synthetic = {2: (3, 9.1), 4: (3, 10.5), 8: (3, 12.9), 16: (3, 14.8), 32: (3, 18.1), 64: (3, 20.8)}
    s = fit_sharing(synthetic, 128, 8)
    assert 0.15 < s < 0.35
    assert all(abs(expert_union(n, 128, 8, s) - u) < 0.1 * u for n, (_, u) in synthetic.items())
    profile = cpu_profile(ExpertTiming(1, 1, 19.0, 2.3e-11, 2))
    shared = dataclasses.replace(QWEN3_30B, experts=dataclasses.replace(QWEN3_30B.experts, sharing=s))
    place = planner.estimate_placement(profile, QWEN3_30B, "gguf")
    assert planner.target_pass_seconds(profile, shared, place, 16) < planner.target_pass_seconds(
        profile, QWEN3_30B, place, 16)
    assert planner.target_pass_seconds(profile, shared, place, 1) == pytest.approx(
        planner.target_pass_seconds(profile, QWEN3_30B, place, 1))


def test_the_catalogs_moe_entries_are_priced_as_moe() -> None:
    """gpt-oss' catalog shape (its config.json's values) gives the cards' parameter counts and a
    token's top-4 experts. Their MXFP4 experts stay in their blocks (engine.loading.weights), so
    gpt-oss-20b is resident on a 24 GB GPU (12.4 GB of blocks, de-quantised as a layer runs),
    reading a token's experts, not all of them: predicted faster than a dense model of its size.
    gpt-oss-120b keeps attention on the GPU and its experts in 128 GB of RAM (the file's nibbles for
    the CPU kernel; the VRAM left caches a few), where 64 GB holds neither: whole layers stream,
    under 1 tok/s."""
    from engine.store.catalog import load_catalog

    catalog = load_catalog()
    for model_id, params in (("gpt-oss-20b", 20.91), ("gpt-oss-120b", 116.83)):
        shape = catalog.find(model_id).shape()  # type: ignore[union-attr]
        assert shape.experts is not None and shape.experts.top_k == 4
        assert shape.params / B == pytest.approx(params, rel=0.002)
    for ram, model_id, fit, form, faster in ((128, "gpt-oss-20b", "fits", "", 1.5),  # "": resident packed
                                             (128, "gpt-oss-120b", "fits", "experts-cpu", 1.5),
                                             (64, "gpt-oss-120b", "slow", "", 1.0)):
        profile = reference_profile("rtx4090", ram_gb=ram)
        entry = catalog.find(model_id)
        assert entry is not None
        moe = planner.predict_pair(profile, entry, None)
        dense = planner.predict_pair(profile, dataclasses.replace(entry, experts=None), None)
        assert (moe.fit, moe.placement.resident_form) == (fit, form), model_id
        assert (moe.placement.cached_experts > 0) == (form == "experts-cpu")
        assert moe.tokens_per_second > faster * dense.tokens_per_second


def test_a_head_the_kernel_holds_packed_is_priced_as_held() -> None:
    """A GGUF run resident by the kernel keeps its head packed (Q6_K: 0.83 bytes a weight): priced
    so, not as an fp32 head (4 bytes), which made the synthetic MoE's prior 0.57x its measured
    speed on this machine (1.25x with the packed head)."""
    profile = cpu_profile(ExpertTiming(1, 1, 19.0, 2.3e-11, 2))
    place = planner.estimate_placement(profile, QWEN3_30B, "gguf")
    assert place.resident_form == "kernel"
    packed, dense = planner.head_seconds(profile, QWEN3_30B, 1, place), planner.head_seconds(profile, QWEN3_30B, 1)
    assert packed < 0.35 * dense
    assert planner.autoregressive_tokens_per_second(profile, QWEN3_30B, place) > 1 / (
        planner.target_pass_seconds(profile, QWEN3_30B, place, 1) + dense)


def test_streaming_a_passs_experts_to_the_gpu_pays_only_for_long_passes() -> None:
    """Copying the union of a pass's experts over the link costs their file bytes; running them on
    the CPU costs reading them from RAM (faster than any PCIe link) plus each further token's
    rows. So one token and a decode tree stay on the CPU; a prompt chunk of a few hundred tokens,
    whose union is every expert and whose rows swamp the CPU, streams."""
    profile = reference_profile("rtx2080-8gb", pinned_gbps=12.0, ram_gb=64,
                                cpu_experts=ExpertTiming(1, 1, 45.0, 5.75e-12, 8))
    moe = ModelShape.from_config(Qwen3_5MoeTextConfig())
    start = planner.stream_pays_from(profile, moe)
    assert start is not None and 32 < start < 1024
    for n in (1, 8, start - 1):
        assert planner.streamed_expert_seconds(profile, moe, n) >= planner.expert_seconds(profile, moe, n)
    for n in (start, 2 * start, 4096):
        assert planner.streamed_expert_seconds(profile, moe, n) < planner.expert_seconds(profile, moe, n)
    assert planner.stream_pays_from(cpu_profile(None), moe) is None  # no GPU to stream to
    assert planner.stream_pays_from(profile, dense_like(moe)) is None
