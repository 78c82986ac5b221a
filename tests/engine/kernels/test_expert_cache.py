"""The expert cache's choices (engine.kernels.expert_cache): which experts the VRAM left holds,
by routing counts or spread evenly, rebalanced between answers, and the counts file as
untrusted input. The cache's arithmetic against transformers (a whole model, experts cached and
not) is in tests/engine/loading/test_gguf_families.py; here the CPU stands in for the GPU."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from engine.kernels import build
from engine.kernels.expert_cache import (CountsFile, RoutingCounts, choose, current_counts, fill, rebalance,
                                         served, state)
from engine.kernels.experts import PackedExperts
from engine.model.gpt_oss_experts import RowExperts
from tests.engine.kernels.test_experts import E, H, I, experts_module, packed_parts

pytestmark = pytest.mark.skipif(build.kernels() is None, reason="no C compiler here")


def test_slots_go_to_the_most_routed_experts_over_the_whole_model() -> None:
    counts = [[5, 0, 1, 9], [0, 0, 0, 2], [7, 7, 0, 0]]
    assert choose(counts, 3, 4, 4) == [[0, 3], [], [0, 1]]
    assert choose(counts, 3, 4, 5) == [[0, 3], [3], [0, 1]]
    assert choose(counts, 3, 4, 100) == [[0, 1, 2, 3]] * 3  # more slots than experts
    assert choose(None, 3, 4, 7) == [[0, 1, 2], [0, 1], [0, 1]]  # no counts: even, the first layers the rest
    assert choose([[0] * 4] * 3, 3, 4, 2) == [[0], [0], []]
    assert choose(counts, 3, 4, 0) == [[], [], []]
    assert served(counts, [[0, 3], [], [0, 1]]) == pytest.approx(28 / 31)
    assert math.isnan(served([[0, 0]], [[0]]))


def model_of(layers: int) -> torch.nn.Sequential:
    module = experts_module("qwen3_moe")
    gu = packed_parts(module.gate_up_proj.data, [(0, 2 * I, "q4")])
    down = packed_parts(module.down_proj.data, [(0, H, "q8")])
    return torch.nn.Sequential(*[PackedExperts(module, gu, down) for _ in range(layers)])


def route(model: torch.nn.Sequential, experts: list[int], tokens: int = 3) -> None:
    for m in model:
        index = torch.tensor([experts[:2]] * tokens)
        m(torch.randn(tokens, H), index, torch.full(index.shape, 0.5))


def test_fill_takes_what_the_budget_holds_and_rebalance_follows_the_routing() -> None:
    model = model_of(2)
    per = model[0].expert_nbytes  # fp32: 4 bytes a value
    st = fill(model, 3 * per + per // 2, "cpu", torch.float32)  # 3 experts fit: layer 0 two, layer 1 one
    assert (st.cached, st.experts, st.nbytes) == (3, 2 * E, 3 * per) and st.fraction == 3 / (2 * E)
    assert [m.hot_ids for m in model] == [[0, 1], [0]]
    half = fill(model, 3 * per, "cpu", torch.bfloat16)  # half the bytes a value: twice the experts
    assert half.cached == 6 and half.nbytes == 3 * per
    fill(model, 3 * per, "cpu", torch.float32)
    route(model, [5, 6])  # every token to experts 5 and 6
    assert current_counts(model)[0][5] == 3
    copied = rebalance(model)
    assert copied == 3 and [m.hot_ids for m in model] == [[5, 6], [5]]  # each layer keeps its slots
    assert rebalance(model) == 0  # nothing better
    assert state(model, current_counts(model)).served == pytest.approx(0.75)
    route(model, [2, 3], tokens=1)  # too little to gain MIN_GAIN from moving: stays
    assert rebalance(model) == 0
    route(model, [2, 3], tokens=30)
    assert rebalance(model, max_copies=2) == 2 and [m.hot_ids for m in model] == [[2, 3], [5]]
    counted = [[0.0] * E, [0.0] * E]
    counted[1][6] = 5.0  # the saved counts give layer 1 the one slot, layer 0 none
    skewed = model_of(2)
    assert fill(skewed, per, "cpu", torch.float32, counted).cached == 1 and [m.hot_ids for m in skewed] == [[], [6]]
    route(skewed, [1, 2], tokens=20)
    assert rebalance(skewed, counted) == 1 and [m.hot_ids for m in skewed] == [[], [1]]


def test_counts_are_kept_per_model_and_a_bad_file_is_ignored(tmp_path: Path) -> None:
    model = model_of(2)
    fill(model, 2 * model[0].expert_nbytes, "cpu", torch.float32)
    keeper = RoutingCounts(model, "model-a", root=tmp_path)
    assert keeper.active and keeper.seed is None
    route(model, [4, 7], tokens=10)
    assert keeper.after_answer() == 2  # saved, and the cache now holds expert 4 in both layers
    assert [m.hot_ids for m in model] == [[4], [4]]
    assert keeper.file is not None
    saved = json.loads(keeper.file.path.read_text())["counts"]
    assert saved[0][4] == saved[0][7] == 10 and sum(saved[1]) == 20
    fresh = model_of(2)
    fill(fresh, 2 * model[0].expert_nbytes, "cpu", torch.float32)
    again = RoutingCounts(fresh, "model-a", root=tmp_path)
    assert again.seed == [[float(c) for c in row] for row in saved]
    assert RoutingCounts(fresh, "model-b", root=tmp_path).seed is None  # another model: its own file
    assert not RoutingCounts(model_of(1), "model-a", root=tmp_path).active  # nothing cached: nothing kept
    path = keeper.file.path
    for bad in ({"version": 1, "key": "model-a", "counts": [[1] * E]},  # one layer short
                {"version": 1, "key": "model-a", "counts": [[1] * E, [1] * (E - 1)]},
                {"version": 1, "key": "model-a", "counts": [[1] * E, [-1] + [1] * (E - 1)]},
                {"version": 1, "key": "model-a", "counts": [[1] * E, [True] * E]},
                {"version": 1, "key": "other", "counts": [[1] * E] * 2}, [1, 2]):
        path.write_text(json.dumps(bad))
        assert CountsFile.of("model-a", tmp_path).load(2, E) is None  # type: ignore[union-attr]
    path.write_text("{" * 100000)
    assert CountsFile.of("model-a", tmp_path).load(2, E) is None  # type: ignore[union-attr]
    assert CountsFile.of("", tmp_path) is None


def test_experts_with_biases_are_cached_with_them() -> None:
    """gpt-oss's experts (engine.model.gpt_oss_experts.RowExperts: biases, its clamped gate) are
    cached with their biases beside their matrices, counted in the bytes: the sum is the module's
    own, uncached and cached, for a decode step and for a pass of several tokens."""
    g = torch.Generator().manual_seed(9)
    module = RowExperts(E, H, I, alpha=1.702, limit=7.0, interleaved=True)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    gu = packed_parts(module.gate_up_proj.data, [(0, 2 * I, "q4")])  # the module takes the packed values
    down = packed_parts(module.down_proj.data, [(0, H, "q8")])
    model = torch.nn.Sequential(PackedExperts(module, gu, down))
    layer = model[0]
    x = torch.randn(5, H, generator=g)
    index = torch.stack([torch.randperm(E, generator=g)[:2] for _ in range(5)])
    weights = torch.rand(5, 2, generator=g)
    with torch.no_grad():
        want = [module(x[:1], index[:1], weights[:1]), module(x, index, weights)]
    assert layer.gate_up_bias is not None and layer.down_bias is not None
    assert layer._fused is not None and layer._fused[2] is not None  # a decode step: one C call, gpt-oss's gate
    for phase in ("cpu", "cached", "streamed"):  # then passes of 3 tokens or more streamed as well
        if phase == "cached":
            state = fill(model, 3 * layer.expert_nbytes, "cpu", torch.float32)
            assert state.cached == 3 and state.nbytes == 3 * (layer.expert_nbytes + 4 * (2 * I + H))
        elif phase == "streamed":
            layer.stream("cpu", torch.float32, 3)
        got = [layer(x[:1], index[:1], weights[:1]), layer(x, index, weights)]
        for a, b in zip(got, want, strict=True):
            assert (a - b).abs().max() <= 1e-5 * b.abs().max(), phase
    assert layer.hot_hits > 0 and layer.streamed_passes == 1


def test_running_out_of_memory_while_moving_experts_keeps_every_slot_whole(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """A rebalance whose temporaries do not fit stops where it is: each slot holds, whole, the
    expert it says it does, the answer goes on, and the sums stay the module's."""
    model = model_of(1)
    layer = model[0]
    fill(model, 3 * layer.expert_nbytes, "cpu", torch.float32)
    keeper = RoutingCounts(model, "model-oom", root=tmp_path)
    route(model, [5, 6], tokens=40)
    real = PackedExperts.expert_matrix
    made = []

    def short(parts: object, e: int, device: object = "cpu") -> torch.Tensor:
        made.append(e)
        if len(made) > 2:  # the second expert's first matrix: out of memory
            raise torch.OutOfMemoryError("no room")
        return real(parts, e, device)  # type: ignore[arg-type]

    monkeypatch.setattr(PackedExperts, "expert_matrix", staticmethod(short))
    assert keeper.after_answer() == 0  # logged, not raised
    monkeypatch.setattr(PackedExperts, "expert_matrix", staticmethod(real))
    assert layer.hot_ids == [0, 5, 2]  # expert 5 moved in; 6 did not fit, slot 2 still holds expert 2
    assert layer._hot is not None and layer._slot is not None
    for j, e in enumerate(layer.hot_ids):
        assert int(layer._slot[e]) == j
        assert torch.equal(layer._hot[0][j], real(layer.gate_up, e)) and torch.equal(layer._hot[1][j], real(layer.down, e))
    assert sum(int(layer._slot[e] >= 0) for e in range(E)) == 3


def test_a_cache_that_does_not_fit_leaves_every_expert_on_the_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """The loader's fill (layer_plan.cache_experts) running out of GPU memory (its estimate of what
    was free wrong) loads without a cache, saying so, rather than failing the load."""
    from types import SimpleNamespace

    from engine.loading import layer_plan
    from engine.shapes import Placement

    model = model_of(2)
    placement = Placement(2, 2, 0, 0, 1, "gguf", "cuda", resident_form="experts-cpu")
    loaded = SimpleNamespace(placement=placement, hf_model=model, fingerprint="")
    monkeypatch.setattr(layer_plan, "spare_device_bytes", lambda hf, settings: 10 * model[0].expert_nbytes)

    def short(*args: object, **kwargs: object) -> None:
        model[0].cache([0], "cpu", torch.float32)  # part of it done, then no room
        raise torch.OutOfMemoryError("no room")

    monkeypatch.setattr(layer_plan, "fill", short)
    settings = layer_plan.MaterialiseSettings(device="cuda", dtype=torch.float32)
    assert layer_plan.cache_experts(loaded, settings) is None  # type: ignore[arg-type]
    assert all(m.cached_nbytes == 0 and not m.hot_ids for m in model) and loaded.placement.cached_experts == 0
