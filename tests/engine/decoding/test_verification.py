"""Tree pass numerics and cache pruning, against from-scratch recomputation with the Hugging
Face model's own forward (no cache, no tree mask)."""

from __future__ import annotations

import pytest
import torch

from engine.decoding.acceptance import AcceptanceModel
from engine.decoding.drafting import grow_tree
from engine.decoding.generation import Engine
from engine.decoding.prefill import prefill
from engine.decoding.verification import accept, run_tree
from engine.loading.load import LoadedModel
from engine.types import (
    CacheSettings,
    GenerationRequest,
    SamplingSettings,
    SpeculationSettings,
)


def hf_last_logits(model: LoadedModel, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return model.model.hf_model(torch.tensor([ids])).logits[0, -1].float()


def hf_kv(model: LoadedModel, ids: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    with torch.inference_mode():
        out = model.model.hf_model(torch.tensor([ids]), use_cache=True)
    cache = out.past_key_values
    return [(layer.keys, layer.values) for layer in cache.layers]


def test_every_tree_node_logits_equal_sequential_decoding(
    tiny_target: LoadedModel, tiny_close_draft: LoadedModel
) -> None:
    prompt = tiny_target.tokenizer("Once upon a time there was")["input_ids"]
    tcache, dcache = tiny_target.model.new_cache(), tiny_close_draft.model.new_cache()
    prefill(tiny_target.model, tcache, prompt[:-1])
    prefill(tiny_close_draft.model, dcache, prompt[:-1])
    spec = SpeculationSettings(budget=48, max_depth=6, branching=4, min_pass_gain=0.0)
    trace = grow_tree(tiny_close_draft.model, dcache, torch.tensor(prompt[-1:]), spec, SamplingSettings(), 384,
                      AcceptanceModel())
    tree = trace.tree
    tree.check()
    assert len(tree) == 49 and tree.max_depth >= 3
    hidden = run_tree(tiny_target.model, tcache, tree)
    logits = tiny_target.model.logits(hidden)  # (N, V)
    for node in range(len(tree)):
        path, cur = [], node
        while cur > 0:
            path.append(int(tree.tokens[cur]))
            cur = int(tree.parents[cur])
        ref = hf_last_logits(tiny_target, prompt + path[::-1])
        assert torch.allclose(logits[node], ref, atol=1e-4), f"node {node}"
    # the draft's entry for every node it read equals the draft's own sequential K/V
    for node in range(1, len(tree)):
        slot = int(trace.slots[node])
        if slot < 0:
            continue
        path, cur = [], node
        while cur > 0:
            path.append(int(tree.tokens[cur]))
            cur = int(tree.parents[cur])
        ref_k, _ = hf_kv(tiny_close_draft, prompt + path[::-1])[0]
        assert torch.allclose(dcache.keys[0][0, :, slot], ref_k[0, :, -1], atol=1e-4)


@pytest.mark.parametrize("share", [False, True], ids=["own", "shared"])
def test_caches_after_steps_equal_recomputed_prefix(
    tiny_target: LoadedModel, tiny_close_draft: LoadedModel, share: bool
) -> None:
    """Step by step (draft and context candidates in the trees), both caches stay equal to the
    models' own K/V of the committed prefix they hold; a draft that is a copy of the target,
    sharing its context, holds the target's."""
    engine = Engine(tiny_target.model, tiny_target.tokenizer, tiny_close_draft.model, CacheSettings(enabled=False))
    assert engine.copied_draft
    req = GenerationRequest(raw_prompt="def add(a, b):\n    return a + b\ndef add(a, b):", max_new_tokens=64,
                            speculation=SpeculationSettings(budget=32, max_depth=8, share_context=share))
    run = engine._start(req, engine.encode(req))
    accepted = []
    for _ in range(6):
        step = engine._step(run).tokens
        engine._commit(run, step)
        seq = run.seq
        accepted.append(len(step))
        tcache, dcache = run.tcache, run.dcache
        assert dcache is not None
        assert tcache.length == len(seq) - 1
        assert dcache.length <= len(seq)
        draft_view = tiny_target if share else tiny_close_draft
        for cache, model, n in ((tcache, tiny_target, tcache.length), (dcache, draft_view, dcache.length)):
            ref = hf_kv(model, seq[:n])
            for layer, (k, v) in enumerate(ref):
                assert torch.allclose(cache.keys[layer][:, :, :n], k, atol=1e-4)
                assert torch.allclose(cache.values[layer][:, :, :n], v, atol=1e-4)
    assert max(accepted) > 1, "the close draft should get several tokens accepted in some step"


def test_accept_walk_descends_only_through_matching_children(tiny_target: LoadedModel) -> None:
    """A hand-built tree: the walk follows the chosen tokens while a child carries them."""
    from engine.decoding.tree import Tree

    tree = Tree(tokens=torch.tensor([9, 4, 5, 6, 7]), parents=torch.tensor([-1, 0, 0, 1, 3]),
                depths=torch.tensor([0, 1, 1, 2, 3]), logp=torch.zeros(5))
    choices = iter([4, 6, 8])  # root -> 4 (node 1) -> 6 (node 3) -> 8: not a child, emitted
    hidden = torch.zeros(5, 3)
    result = accept(tree, hidden, lambda h: torch.zeros(1, 10), lambda lg, so_far: next(choices), limit=10)
    assert result.path == [0, 1, 3] and result.tokens == [4, 6, 8]
    stop = accept(tree, hidden, lambda h: torch.zeros(1, 10), lambda lg, so_far: 4, limit=10, stop_ids=frozenset({4}))
    assert stop.path == [0] and stop.tokens == [4]
    capped = accept(tree, hidden, lambda h: torch.zeros(1, 10), lambda lg, so_far: [4, 6, 7][len(so_far)], limit=2)
    assert capped.tokens == [4, 6]
