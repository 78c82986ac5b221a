"""PackedExperts against transformers' own experts modules over the same (de-quantised) values:
every family's gate, merged and unmerged parts, a dense projection beside packed ones, and the
routing statistics it keeps. The whole-model paths (GGUF files of each family, resident with the
kernel) are in tests/engine/loading/test_gguf_families*.py."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, Gemma4TextConfig
from transformers.models.gemma4.modeling_gemma4 import Gemma4TextExperts
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts
from transformers.models.mixtral.modeling_mixtral import MixtralExperts
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

from engine.kernels import build
from engine.kernels.expert_parts import Part, merged, supports
from engine.kernels.experts import PackedExperts
from engine.kernels.linear import dequantize, from_dense

pytestmark = pytest.mark.skipif(build.kernels() is None, reason="no C compiler here")

E, H, I = 8, 64, 96  # experts, hidden, expert width (I: three groups of 32)


def experts_module(kind: str) -> torch.nn.Module:
    if kind == "mixtral":
        config = AutoConfig.for_model("mixtral", hidden_size=H, intermediate_size=I, num_local_experts=E)
        module = MixtralExperts(config)
    elif kind == "gemma4":  # GELU (tanh) of gate times up
        config = Gemma4TextConfig(hidden_size=H, moe_intermediate_size=I, num_experts=E, top_k_experts=2,
                                  enable_moe_block=True, hidden_size_per_layer_input=0)
        module = Gemma4TextExperts(config)
    else:
        config = AutoConfig.for_model("qwen3_moe", hidden_size=H, moe_intermediate_size=I, num_experts=E)
        module = Qwen3MoeExperts(config)
    config._experts_implementation = "eager"
    torch.manual_seed(0)
    with torch.no_grad():
        module.gate_up_proj.normal_(0, 0.1)
        module.down_proj.normal_(0, 0.1)
    return module.eval()


def routed(tokens: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random states of `tokens` tokens, each routed to 2 distinct experts with random weights."""
    x = torch.randn(tokens, H, generator=g)
    index = torch.stack([torch.randperm(E, generator=g)[:2] for _ in range(tokens)])
    return x, index, torch.rand(tokens, 2, generator=g)


def packed_parts(weight: torch.Tensor, splits: list[tuple[int, int, str]]) -> list[Part]:
    """(E, rows, in) -> parts over row ranges, each "q4", "q8" or "dense"; the module's weight is
    then set to the values the parts hold (what the file's values are)."""
    parts = []
    for a, b, kind in splits:
        rows = weight[:, a:b]
        if kind == "dense":
            parts.append(Part(a, b, dense=rows.clone()))
            continue
        ws = tuple(from_dense(rows[e], kind, 32) for e in range(weight.shape[0]))  # type: ignore[arg-type]
        with torch.no_grad():
            weight[:, a:b] = torch.stack([dequantize(w) for w in ws])
        parts.append(Part(a, b, packed=ws))
    return parts


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
@pytest.mark.parametrize("layout", ["merged", "apart", "dense down"])
def test_packed_experts_compute_what_the_module_computes(family: str, layout: str) -> None:
    module = experts_module(family)
    if layout == "merged":  # gate and up of one type: one matrix per expert
        gu = packed_parts(module.gate_up_proj.data, [(0, I, "q4"), (I, 2 * I, "q4")])
        down = packed_parts(module.down_proj.data, [(0, H, "q8")])
    elif layout == "apart":  # gate q8, up q4: two kernel calls, outputs side by side
        gu = packed_parts(module.gate_up_proj.data, [(0, I, "q8"), (I, 2 * I, "q4")])
        down = packed_parts(module.down_proj.data, [(0, H, "q4")])
    else:
        gu = packed_parts(module.gate_up_proj.data, [(0, I, "q8"), (I, 2 * I, "q8")])
        down = packed_parts(module.down_proj.data, [(0, H, "dense")])
    ours = PackedExperts(module, gu, down)
    assert len(ours.gate_up) == (1 if layout != "apart" else 2)
    g = torch.Generator().manual_seed(1)
    for tokens in (1, 5, 33):
        x, index, weights = routed(tokens, g)
        with torch.no_grad():
            want = module(x, index, weights)
        got = ours(x, index, weights)
        assert got.shape == want.shape and got.dtype == want.dtype
        assert (got - want).abs().max() <= 1e-5 * want.abs().max()
        assert ours.last_tokens == tokens and ours.last_union == len(set(index.flatten().tolist()))
    assert ours.calls == 3 and int(ours.hits.sum()) == 2 * (1 + 5 + 33)


def test_experts_no_token_routes_to_are_never_run() -> None:
    module = experts_module("qwen3_moe")
    gu = packed_parts(module.gate_up_proj.data, [(0, 2 * I, "q8")])
    down = packed_parts(module.down_proj.data, [(0, H, "q8")])
    ours = PackedExperts(module, gu, down)
    broken = list(ours.down)
    # expert 5's weights replaced by NaN: a pass that routes nothing to it must not read them
    bad = broken[0].packed[5]  # type: ignore[index]
    bad.scales.fill_(float("nan"))
    x = torch.randn(4, H)
    index = torch.tensor([[0, 1], [1, 2], [2, 3], [3, 0]])
    assert torch.isfinite(ours(x, index, torch.ones(4, 2))).all()
    assert ours.hits.tolist() == [2, 2, 2, 2, 0, 0, 0, 0]
    assert torch.isnan(ours(x[:1], torch.tensor([[5, 0]]), torch.ones(1, 2))).any()


def test_parts_must_tile_the_rows_and_transposed_experts_are_not_taken() -> None:
    module = experts_module("qwen3_moe")
    gu = packed_parts(module.gate_up_proj.data, [(0, I, "q8")])
    with pytest.raises(ValueError, match="do not tile"):
        merged(gu, 2 * I)
    config = AutoConfig.for_model("gpt_oss", hidden_size=H, intermediate_size=I, num_local_experts=E)
    assert supports(module) and not supports(GptOssExperts(config))
    with pytest.raises(ValueError, match="not an experts module"):
        PackedExperts(GptOssExperts(config), gu, gu)


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "gemma4"])
def test_one_token_takes_one_c_call_with_the_loops_result(family: str) -> None:
    """A decode step's token runs all its experts in one C call (qm_experts_one) where the
    module is SiLU (or Gemma 4's GELU, tanh), unbiased and each projection one packed part; it
    gives what the loop over experts gives, to float rounding, and keeps the same routing
    statistics."""
    module = experts_module(family)
    gu = packed_parts(module.gate_up_proj.data, [(0, I, "q4"), (I, 2 * I, "q4")])
    down = packed_parts(module.down_proj.data, [(0, H, "q8")])
    fused, loop = PackedExperts(module, gu, down), PackedExperts(module, gu, down)
    assert fused._fused is not None and (fused._fused[2] is not None) == (family == "gemma4")
    loop._fused = None
    g = torch.Generator().manual_seed(2)
    for _ in range(5):
        x = torch.randn(1, H, generator=g)
        index = torch.randperm(E, generator=g)[:2][None]
        weights = torch.rand(1, 2, generator=g)
        with torch.no_grad():
            want = module(x, index, weights)
        a, b = fused(x, index, weights), loop(x, index, weights)
        assert (a - b).abs().max() <= 1e-5 * b.abs().max() and (a - want).abs().max() <= 1e-5 * want.abs().max()
    assert torch.equal(fused.hits, loop.hits) and fused.last_union == loop.last_union == 2
    unfused = PackedExperts(module, packed_parts(module.gate_up_proj.data, [(0, I, "q8"), (I, 2 * I, "q4")]), down)
    assert unfused._fused is None  # two gate_up parts: the loop


def test_passes_of_several_tokens_log_the_experts_they_woke() -> None:
    """union_log keeps what the planner fits its u(N) to (engine.planning.moe.fit_sharing), per
    power of two of tokens; one-token calls (always top-k) are not logged; the routed_shape the
    budget planner uses takes the fitted sharing."""
    from types import SimpleNamespace

    from engine.decoding.auto_budget import routed_shape
    from engine.kernels.expert_unions import measured_unions
    from engine.shapes import ExpertShape, LayerShape, ModelShape

    module = experts_module("qwen3_moe")
    ours = PackedExperts(module, packed_parts(module.gate_up_proj.data, [(0, 2 * I, "q4")]),
                         packed_parts(module.down_proj.data, [(0, H, "q8")]))
    model = torch.nn.Sequential(ours)
    shape = ModelShape("m", 1, LayerShape("m", H, E * I, 4, 2, 16), 100, experts=ExpertShape(E, 2, I, 1))
    engine = SimpleNamespace(target=SimpleNamespace(shape=shape, hf_model=model))
    assert measured_unions(model.modules()) == {} and routed_shape(engine) == shape  # type: ignore[arg-type]

    def call(routes: list[list[int]]) -> None:
        index = torch.tensor(routes)
        ours(torch.randn(len(routes), H), index, torch.full(index.shape, 0.5))

    call([[0, 1]])  # one token: not logged
    call([[0, 1], [0, 1], [1, 0], [0, 1], [1, 0]])  # 5 tokens sharing 2 experts
    call([[2, 3], [3, 2], [2, 3], [3, 2], [2, 3], [3, 2]])  # 6 tokens, 2 experts
    call([[0, 1], [2, 3]])  # 2 tokens, 4 experts
    assert ours.union_log == {3: (2, 11, 4), 2: (1, 2, 4)}
    assert measured_unions(model.modules()) == {6: (2, 2.0), 2: (1, 4.0)}
    routed = routed_shape(engine)  # type: ignore[arg-type]
    assert routed.experts is not None and routed.experts.sharing < 0.5  # 5-6 tokens woke what one does
    assert routed.union_params(6) < shape.union_params(6)


@pytest.mark.parametrize("tokens", [1, 7])
def test_experts_cached_on_the_device_give_what_the_cpu_gives(tokens: int) -> None:
    """Experts cached where the model runs (`cache`; here the CPU stands in for the GPU, in fp32)
    run there with dense products and the rest by the kernel: the sum is the module's, to float
    rounding, whichever experts are cached, for a decode step (the one-call path) and a pass of
    several tokens. A new set of as many experts copies only the ones new to it; the routed pairs
    the cache served are counted; uncached, every expert runs on the CPU again."""
    module = experts_module("qwen3_moe")
    gu = packed_parts(module.gate_up_proj.data, [(0, I, "q4"), (I, 2 * I, "q4")])
    down = packed_parts(module.down_proj.data, [(0, H, "q8")])
    ours = PackedExperts(module, gu, down)
    assert ours.cached_nbytes == 0 and ours.width == I
    assert ours.expert_nbytes == 4 * (2 * I * H + H * I)
    g = torch.Generator().manual_seed(3)
    served = 0
    for ids in ([0, 1, 2], [2, 5, 7], [3], list(range(E))):
        copied = ours.cache(ids, "cpu", torch.float32)
        assert ours.cached_nbytes == len(ids) * ours.expert_nbytes and sorted(ours.hot_ids) == ids
        assert copied == (len(ids) if ids != [2, 5, 7] else 2)  # expert 2 stays in its slot
        for _ in range(3):
            x, index, weights = routed(tokens, g)
            with torch.no_grad():
                want = module(x, index, weights)
            got = ours(x, index, weights)
            assert (got - want).abs().max() <= 1e-5 * want.abs().max()
            served += sum(e in ids for e in index.flatten().tolist())
    assert ours.hot_hits == served > 0 and int(ours.hits.sum()) == 4 * 3 * tokens * 2
    ours.uncache()
    x = torch.randn(tokens, H, generator=g)
    index = torch.zeros(tokens, 2, dtype=torch.int64)
    index[:, 1] = 1
    ours(x, index, torch.ones(tokens, 2))
    assert ours.hot_hits == served and ours.cached_nbytes == 0
    with pytest.raises(ValueError, match="expert ids"):
        ours.cache([E], "cpu", torch.float32)


def test_passes_of_many_tokens_stream_their_experts_to_the_device() -> None:
    """`stream`: passes of `from_tokens` tokens or more run every expert they wake where the model
    runs (de-quantised there from the packed bytes; cached ones from the cache), fewer keep the
    CPU: the module's sum either way (the CPU stands in for the GPU, in fp32)."""
    module = experts_module("qwen3_moe")
    gu = packed_parts(module.gate_up_proj.data, [(0, I, "q4"), (I, 2 * I, "q4")])
    down = packed_parts(module.down_proj.data, [(0, H, "q8")])
    ours = PackedExperts(module, gu, down)
    ours.stream("cpu", torch.float32, 4)
    g = torch.Generator().manual_seed(4)
    for cached in ([], [1, 6]):
        ours.cache(cached, "cpu", torch.float32)
        for tokens in (1, 3, 4, 20):
            x, index, weights = routed(tokens, g)
            with torch.no_grad():
                want = module(x, index, weights)
            before = ours.streamed_passes
            got = ours(x, index, weights)
            assert (got - want).abs().max() <= 1e-5 * want.abs().max()
            assert ours.streamed_passes - before == (tokens >= 4)
    assert int(ours.hits.sum()) == 2 * 2 * (1 + 3 + 4 + 20)
