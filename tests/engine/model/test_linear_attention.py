"""linear_attention.py: every tree node's output and every advanced state against transformers'
own Gated DeltaNet module reading the node's path one token at a time with its own cache."""

from __future__ import annotations

import copy
import random

import pytest
import torch
from torch import nn
from transformers import DynamicCache, Qwen3_5TextConfig, Qwen3NextConfig
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5DecoderLayer, Qwen3_5GatedDeltaNet
from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextGatedDeltaNet

from engine.model import linear_attention
from engine.model.linear_attention import TreeGatedDeltaNet, advance, install
from engine.model.linear_state import LinearLayerState, LinearPending, PassTree

FAMILIES = ("qwen3_5", "qwen3_next")
HIDDEN = 64
ATOL = 1e-5


def tiny_config(family: str) -> Qwen3_5TextConfig | Qwen3NextConfig:
    # 2 key heads serving 4 value heads (grouping, and qwen3_next's per-key-head interleave);
    # dk != dv so a transposed state cannot pass
    sizes = dict(hidden_size=HIDDEN, num_hidden_layers=1, layer_types=["linear_attention"],
                 linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                 linear_value_head_dim=8, linear_conv_kernel_dim=4, num_attention_heads=2,
                 num_key_value_heads=1, head_dim=16, intermediate_size=64, vocab_size=32)
    if family == "qwen3_5":
        return Qwen3_5TextConfig(**sizes)
    return Qwen3NextConfig(**sizes, num_experts=2, num_experts_per_tok=1, moe_intermediate_size=16,
                           shared_expert_intermediate_size=16)


def tiny_module(family: str, seed: int = 0) -> tuple[nn.Module, Qwen3_5TextConfig | Qwen3NextConfig]:
    torch.manual_seed(seed)
    config = tiny_config(family)
    cls = Qwen3_5GatedDeltaNet if family == "qwen3_5" else Qwen3NextGatedDeltaNet
    module = cls(config, 0).eval()
    with torch.no_grad():  # away from the init's ones so a missed bias or norm weight shows
        module.dt_bias.normal_(0.0, 0.5)
        module.A_log.uniform_(-3.0, 0.0)  # slow decays, so the state carries far along a path
        module.norm.weight.normal_(1.0, 0.2)
    return module, config


class PassCache:
    """The engine cache's linear-layer face, for one layer."""

    def __init__(self, state: LinearLayerState, tree: PassTree) -> None:
        self.state, self.tree = state, tree
        self.pending: LinearPending | None = None

    def pass_tree(self) -> PassTree:
        return self.tree

    def linear_state(self, layer_idx: int) -> LinearLayerState:
        return self.state

    def linear_pending(self, layer_idx: int, pending: LinearPending) -> None:
        self.pending = pending

    def linear_prior(self, layer_idx: int) -> None:
        return None  # earlier passes' tokens: tested through the engine (test_families.py)


class Reference:
    """transformers' module with its own cache: the committed prefix, and paths from it."""

    def __init__(self, module: nn.Module, config: Qwen3_5TextConfig | Qwen3NextConfig) -> None:
        self.module = module
        self.committed = DynamicCache(config=config)

    @torch.inference_mode()
    def chain(self, hidden: torch.Tensor) -> torch.Tensor:
        """Commit a chain read in one call (transformers' chunked form); its outputs (n, D)."""
        out: torch.Tensor = self.module(hidden[None], cache_params=self.committed)
        return out[0]

    @torch.inference_mode()
    def tree(self, hidden: torch.Tensor, parents: list[int]) -> tuple[torch.Tensor, list[DynamicCache]]:
        """Each node read alone after its parent's cache: outputs (n, D) and the cache after each."""
        outs, caches = [], []
        for i, p in enumerate(parents):
            cache = copy.deepcopy(self.committed if p < 0 else caches[p])
            outs.append(self.module(hidden[i][None, None], cache_params=cache)[0, 0])
            caches.append(cache)
        return torch.stack(outs), caches


def assert_state_equal(state: LinearLayerState, cache: DynamicCache) -> None:
    layer = cache.layers[0]
    conv = layer.conv_states[0]  # transformers keeps `kernel` columns; the oldest is never read
    km1 = state.conv.shape[-1]
    torch.testing.assert_close(state.conv, conv[..., conv.shape[-1] - km1:], atol=ATOL, rtol=0)
    assert layer.recurrent_states[0].dtype == state.recurrent.dtype == torch.float32
    torch.testing.assert_close(state.recurrent, layer.recurrent_states[0], atol=ATOL, rtol=0)


def random_tree(rng: random.Random, max_depth: int = 6, max_width: int = 5, max_nodes: int = 40) -> list[int]:
    """Parents of a random tree (children of the committed state have -1), in a random
    topological order, not breadth-first."""
    kids: dict[int, list[int]] = {-1: []}
    depth = {-1: 0}
    frontier, count = [-1], 0
    while frontier and count < max_nodes:
        p = frontier.pop(rng.randrange(len(frontier)))
        for _ in range(rng.randint(1 if p < 0 else 0, max_width)):
            if count == max_nodes:
                break
            kids[p].append(count)
            kids[count], depth[count] = [], depth[p] + 1
            if depth[count] < max_depth:
                frontier.append(count)
            count += 1
    parent_of = {c: p for p, cs in kids.items() for c in cs}
    order, ready = [], list(kids[-1])
    while ready:  # Kahn's sort, picking at random
        node = ready.pop(rng.randrange(len(ready)))
        order.append(node)
        ready.extend(kids[node])
    new = {old: i for i, old in enumerate(order)}
    return [-1 if parent_of[old] < 0 else new[parent_of[old]] for old in order]


def path_to(parents: list[int], node: int) -> list[int]:
    path = []
    while node >= 0:
        path.append(node)
        node = parents[node]
    return path[::-1]


def run_pass(wrapped: TreeGatedDeltaNet, state: LinearLayerState, hidden: torch.Tensor,
             tree: PassTree) -> tuple[torch.Tensor, LinearPending]:
    cache = PassCache(state, tree)
    with torch.inference_mode():
        out = wrapped(hidden[None], cache_params=cache)
    assert cache.pending is not None
    return out[0], cache.pending


@pytest.mark.parametrize("family", FAMILIES)
def test_chains_match_transformers_chunked_and_token_by_token(family: str) -> None:
    module, config = tiny_module(family)
    ref = Reference(module, config)
    wrapped = TreeGatedDeltaNet(module)
    state = wrapped.new_state(torch.float32, "cpu")
    g = torch.Generator().manual_seed(1)

    prefill = torch.randn(150, HIDDEN, generator=g)  # three chunks, the last one short
    out, pending = run_pass(wrapped, state, prefill, PassTree.of_chain(150, "cpu", kept_whole=True))
    torch.testing.assert_close(out, ref.chain(prefill), atol=ATOL, rtol=0)
    assert pending.nodes is None  # a prefill keeps no per-token inputs
    advance(state, pending)
    assert_state_equal(state, ref.committed)

    # a drafted chain, not kept whole: token-by-token reference, then a cut
    draft = torch.randn(70, HIDDEN, generator=g)
    parents = list(range(-1, 69))
    out, pending = run_pass(wrapped, state, draft, PassTree.from_parents(parents, "cpu"))
    ref_out, caches = ref.tree(draft, parents)
    torch.testing.assert_close(out, ref_out, atol=ATOL, rtol=0)
    whole = state.clone()
    advance(whole, pending, list(range(70)))
    assert_state_equal(whole, caches[69])
    advance(state, pending, list(range(20)))
    assert_state_equal(state, caches[19])


@pytest.mark.parametrize("family", FAMILIES)
def test_random_trees_match_each_path_over_steps(family: str) -> None:
    module, config = tiny_module(family, seed=2)
    ref = Reference(module, config)
    wrapped = TreeGatedDeltaNet(module)
    state = wrapped.new_state(torch.float32, "cpu")
    g = torch.Generator().manual_seed(3)
    rng = random.Random(4)

    prefill = torch.randn(10, HIDDEN, generator=g)
    _, pending = run_pass(wrapped, state, prefill, PassTree.of_chain(10, "cpu", kept_whole=True))
    ref.chain(prefill)
    advance(state, pending, None)
    for step in range(5):
        parents = random_tree(rng)
        tree = PassTree.from_parents(torch.tensor(parents), "cpu")
        assert not tree.chain
        hidden = torch.randn(len(parents), HIDDEN, generator=g)
        out, pending = run_pass(wrapped, state, hidden, tree)
        ref_out, caches = ref.tree(hidden, parents)
        torch.testing.assert_close(out, ref_out, atol=ATOL, rtol=0)

        if step == 2:  # nothing accepted: the state stays as it was
            before = state.clone()
            advance(state, pending, [])
            assert torch.equal(state.conv, before.conv) and torch.equal(state.recurrent, before.recurrent)
            continue
        leaf = max(range(len(parents)), key=lambda i: (len(path_to(parents, i)), rng.random()))
        node = leaf if step % 2 else rng.randrange(len(parents))  # deepest, or anywhere
        advance(state, pending, torch.tensor(path_to(parents, node)))
        assert_state_equal(state, caches[node])
        ref.committed = caches[node]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("prefix", [0, 5])
def test_flat_tree_hanging_off_the_committed_state(family: str, prefix: int) -> None:
    module, config = tiny_module(family, seed=5)
    ref = Reference(module, config)
    wrapped = TreeGatedDeltaNet(module)
    state = wrapped.new_state(torch.float32, "cpu")
    g = torch.Generator().manual_seed(6)
    if prefix:
        prefill = torch.randn(prefix, HIDDEN, generator=g)
        _, pending = run_pass(wrapped, state, prefill, PassTree.of_chain(prefix, "cpu", kept_whole=True))
        ref.chain(prefill)
        advance(state, pending)
    parents = [-1] * 7
    hidden = torch.randn(7, HIDDEN, generator=g)
    out, pending = run_pass(wrapped, state, hidden, PassTree.from_parents(parents, "cpu"))
    ref_out, caches = ref.tree(hidden, parents)
    torch.testing.assert_close(out, ref_out, atol=ATOL, rtol=0)
    advance(state, pending, [3])
    assert_state_equal(state, caches[3])


def test_head_groups_give_the_same_outputs(monkeypatch: pytest.MonkeyPatch) -> None:
    module, _ = tiny_module("qwen3_5", seed=7)
    wrapped = TreeGatedDeltaNet(module)
    rng = random.Random(8)
    parents = random_tree(rng)
    tree = PassTree.from_parents(parents, "cpu")
    hidden = torch.randn(len(parents), HIDDEN, generator=torch.Generator().manual_seed(9))
    whole, _ = run_pass(wrapped, wrapped.new_state(torch.float32, "cpu"), hidden, tree)
    monkeypatch.setattr(linear_attention, "BLOCK_ELEMENTS", 1)  # one head at a time
    grouped, _ = run_pass(wrapped, wrapped.new_state(torch.float32, "cpu"), hidden, tree)
    torch.testing.assert_close(grouped, whole, atol=1e-6, rtol=0)


def test_tree_tables_against_parent_walks() -> None:
    rng = random.Random(10)
    for _ in range(5):
        parents = random_tree(rng)
        tree = PassTree.from_parents(parents, "cpu")
        assert tree.ancestors is not None
        g = torch.randn(3, len(parents), dtype=torch.float64)
        sums = tree.path_sums(g)
        windows = tree.conv_windows(4)
        for i in range(len(parents)):
            path = path_to(parents, i)
            assert tree.ancestors[i].nonzero().flatten().tolist() == path
            torch.testing.assert_close(sums[:, i], g[:, path].sum(-1))
            expected = ([0, 1, 2] + [3 + p for p in path])[-4:]  # committed columns, then the path
            assert windows[i].tolist() == expected
    with pytest.raises(ValueError):
        PassTree.from_parents([-1, 2, 0], "cpu")


def test_state_round_trips_and_clones() -> None:
    module, _ = tiny_module("qwen3_next")
    wrapped = TreeGatedDeltaNet(module)
    state = wrapped.new_state(torch.float32, "cpu")
    assert state.conv.shape == (1, wrapped.conv_dim, 3) and state.recurrent.shape == (1, 4, 16, 8)
    _, pending = run_pass(wrapped, state, torch.randn(6, HIDDEN), PassTree.of_chain(6, "cpu", kept_whole=True))
    advance(state, pending)
    copy_ = state.clone()
    back = LinearLayerState.from_tensors(*state.tensors(), device="cpu")
    assert torch.equal(back.conv, state.conv) and torch.equal(back.recurrent, state.recurrent)
    _, pending = run_pass(wrapped, state, torch.randn(2, HIDDEN), PassTree.of_chain(2, "cpu", kept_whole=True))
    advance(state, pending)
    assert not torch.equal(copy_.recurrent, state.recurrent)
    assert torch.equal(back.recurrent, copy_.recurrent)


def test_installed_in_a_decoder_layer_keeps_names_and_outputs() -> None:
    torch.manual_seed(11)
    config = tiny_config("qwen3_5")
    layer = Qwen3_5DecoderLayer(config, 0).eval()
    reference = copy.deepcopy(layer)
    names = list(layer.state_dict())
    (wrapped,) = install([layer])
    assert layer.linear_attn is wrapped and list(layer.state_dict()) == names
    hidden = torch.randn(1, 9, HIDDEN)
    rope = (torch.ones(1, 9, 16), torch.zeros(1, 9, 16))  # unused by a linear layer
    cache = PassCache(wrapped.new_state(torch.float32, "cpu"), PassTree.of_chain(9, "cpu", kept_whole=True))
    with torch.inference_mode():
        ours = layer(hidden, position_embeddings=rope, past_key_values=cache)
        theirs = reference(hidden, position_embeddings=rope, past_key_values=DynamicCache(config=config))
    torch.testing.assert_close(ours, theirs, atol=ATOL, rtol=0)
    assert install([layer]) == []  # already wrapped


@pytest.mark.parametrize("family", FAMILIES)
def test_bfloat16_tree_rounds_like_transformers(family: str) -> None:
    """In bf16 the fp32 rounding differences mostly vanish in the final rounding, so nearly
    every output element is equal; a dtype taken at a different step (beta, the conv, the
    state) would differ by an ulp or more in many."""
    module, config = tiny_module(family, seed=12)
    module = module.to(torch.bfloat16)
    ref = Reference(module, config)
    wrapped = TreeGatedDeltaNet(module)
    state = wrapped.new_state(torch.bfloat16, "cpu")
    g = torch.Generator().manual_seed(13)
    prefill = torch.randn(12, HIDDEN, generator=g).bfloat16()
    _, pending = run_pass(wrapped, state, prefill, PassTree.of_chain(12, "cpu", kept_whole=True))
    ref.chain(prefill)
    advance(state, pending)
    parents = random_tree(random.Random(14), max_nodes=30)
    hidden = torch.randn(len(parents), HIDDEN, generator=g).bfloat16()
    out, pending = run_pass(wrapped, state, hidden, PassTree.from_parents(parents, "cpu"))
    ref_out, caches = ref.tree(hidden, parents)
    assert out.dtype == torch.bfloat16
    assert (out == ref_out).float().mean() > 0.99
    torch.testing.assert_close(out, ref_out, atol=2e-2, rtol=0)  # at most an ulp or two
    node = len(parents) - 1
    advance(state, pending, path_to(parents, node))
    assert state.conv.dtype == torch.bfloat16
    assert_state_equal(state, caches[node])
