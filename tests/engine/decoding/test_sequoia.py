"""Static Sequoia trees: the DP against brute-force enumeration and the best-nodes construction,
and Sequoia-mode decoding against plain greedy decoding (lossless)."""

from __future__ import annotations

import dataclasses
import itertools
import json
from functools import cache
from pathlib import Path

import pytest

from engine.cli.main import main
from engine.decoding.generation import Engine
from engine.decoding.sequoia import best_nodes_tree, build_tree, expected_tokens
from engine.loading.load import LoadedModel
from engine.types import (
    Completion,
    GenerationRequest,
    SamplingSettings,
    SpeculationSettings,
)


def brute_force(accept: tuple[float, ...], budget: int, depth: int) -> float:
    """Best expected tokens over every tree of <= budget draft nodes and depth <= depth whose
    children take ranks 0..c-1, enumerated recursively (no DP, no pruning)."""

    @cache
    def best(nodes: int, d: int) -> float:  # best subtree value (root included) with exactly <= nodes
        if nodes <= 1 or d == 0:
            return 1.0
        top = 1.0
        for c in range(1, min(len(accept), nodes - 1) + 1):  # number of children
            for sizes in itertools.product(range(1, nodes), repeat=c):
                if sum(sizes) > nodes - 1:
                    continue
                top = max(top, 1.0 + sum(accept[r] * best(s, d - 1) for r, s in enumerate(sizes)))
        return top

    return best(budget + 1, depth)


ACCEPTS = [(0.7, 0.2, 0.05), (0.5, 0.3, 0.1), (0.9, 0.05, 0.02), (0.3, 0.6, 0.05), (0.4, 0.4, 0.4)]


@pytest.mark.parametrize("accept", ACCEPTS)
@pytest.mark.parametrize("budget,depth", [(1, 1), (3, 2), (5, 3), (6, 6), (7, 2), (7, 4)])
def test_dp_matches_brute_force(accept: tuple[float, ...], budget: int, depth: int) -> None:
    tree = build_tree(accept, budget, depth)
    assert tree.expected_tokens == pytest.approx(brute_force(accept, budget, depth), abs=1e-9)
    assert tree.budget == budget and tree.max_depth <= depth
    assert tree.expected_tokens == pytest.approx(expected_tokens(tree.parents, tree.ranks, accept))
    assert all(p < i for i, p in enumerate(tree.parents) if i)


@pytest.mark.parametrize("budget", [1, 10, 50, 200])
@pytest.mark.parametrize("depth", [1, 3, 8])
def test_dp_equals_best_nodes_for_non_increasing_acceptance(budget: int, depth: int) -> None:
    accept = (0.73, 0.12, 0.05, 0.025, 0.015, 0.01)
    dp, greedy = build_tree(accept, budget, depth), best_nodes_tree(accept, budget, depth)
    assert dp.expected_tokens == pytest.approx(greedy.expected_tokens, rel=1e-9)
    assert dp.max_depth <= depth


def test_more_budget_or_depth_never_hurts() -> None:
    accept = (0.6, 0.2, 0.1)
    values = [build_tree(accept, b, 6).expected_tokens for b in (1, 2, 4, 8, 16, 32)]
    assert values == sorted(values)
    assert build_tree(accept, 16, 2).expected_tokens <= build_tree(accept, 16, 6).expected_tokens


def test_budget_larger_than_the_shape_can_hold() -> None:
    tree = build_tree((0.5, 0.2), budget=20, max_depth=2)  # 2 ranks, depth 2: at most 6 nodes
    assert tree.budget == 6


@pytest.mark.parametrize("budget,depth", [(1, 1), (8, 4), (48, 8), (200, 12)])
def test_sequoia_greedy_equals_plain_greedy(tiny_target: LoadedModel, tiny_close_draft: LoadedModel,
                                            budget: int, depth: int) -> None:
    engine = Engine(tiny_target.model, tiny_target.tokenizer, tiny_close_draft.model)
    for prompt in ("Paris is the capital of", "def add(a, b):"):
        spec = SpeculationSettings(budget=budget, max_depth=depth, tree_mode="sequoia")
        req = GenerationRequest(raw_prompt=prompt, max_new_tokens=30, speculation=spec)
        ar = dataclasses.replace(req, speculation=SpeculationSettings(mode="autoregressive"))
        got, ref = list(engine.generate(req))[-1], list(engine.generate(ar))[-1]
        assert isinstance(got, Completion) and isinstance(ref, Completion)
        assert got.token_ids == ref.token_ids
        if budget >= 8:
            assert got.stats.tokens_per_pass > 1.5
    assert engine.pass_record[("sequoia", budget)].passes > 0


def test_sequoia_seeded_sampling_matches_autoregressive(tiny_target: LoadedModel,
                                                        tiny_close_draft: LoadedModel) -> None:
    engine = Engine(tiny_target.model, tiny_target.tokenizer, tiny_close_draft.model)
    sampling = SamplingSettings(temperature=0.8, top_p=0.9, seed=4)
    req = GenerationRequest(raw_prompt="Once upon a time there was", max_new_tokens=30, sampling=sampling,
                            speculation=SpeculationSettings(budget=32, max_depth=8, tree_mode="sequoia"))
    ar = dataclasses.replace(req, speculation=SpeculationSettings(mode="autoregressive"))
    a, b = list(engine.generate(req))[-1], list(engine.generate(ar))[-1]
    assert isinstance(a, Completion) and isinstance(b, Completion)
    assert a.token_ids == b.token_ids
    assert a.stats.target_passes < b.stats.target_passes


def test_cli_tree_option_is_lossless(capsys: pytest.CaptureFixture[str], tiny_target_path: Path,
                                     tiny_draft_path: Path) -> None:

    common = ["generate", "--target", str(tiny_target_path), "--draft", str(tiny_draft_path), "--raw-prompt",
              "The quick brown", "--max-new-tokens", "16", "--budget", "16", "--keep-draft", "--json"]
    assert main([*common, "--tree", "sequoia"]) == 0
    sequoia = json.loads(capsys.readouterr().out)
    assert main([*common, "--mode", "autoregressive"]) == 0
    plain = json.loads(capsys.readouterr().out)
    assert sequoia["token_ids"] == plain["token_ids"]
    assert sequoia["stats"]["target_passes"] < plain["stats"]["target_passes"]
