"""Context candidates (engine.decoding.context) and the trees they enter.

The index is checked against a brute-force scan of the sequence; the trie against the
continuations it merges; grow_tree for merging a candidate the draft also proposes into one
node; and draft-free speculation end to end on the starter model: on a prompt that asks it to
copy text, greedy output identical to plain transformers decoding with several tokens per pass.
Sampling with candidates in the tree is in test_lossless_sampling.py.
"""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest
import torch

from engine.decoding.acceptance import AcceptanceModel
from engine.decoding.context import (
    MAX_MATCH,
    MAX_NGRAM,
    ContextIndex,
    Continuation,
    trie,
)
from engine.decoding.context_tree import context_tree, seed_gains, seed_siblings, teach_context
from engine.decoding.drafting import grow_tree, teach, top_nodes
from engine.decoding.generation import Engine
from engine.decoding.prefill import prefill
from engine.loading.load import LoadedModel
from engine.types import (
    Completion,
    GenerationRequest,
    Message,
    SamplingSettings,
    SpeculationSettings,
)


def brute_continuations(seq: list[int], depth: int) -> dict[tuple[int, ...], int]:
    """Every continuation of an earlier occurrence of the end's last 1..MAX_NGRAM tokens -> the
    longest match (tokens before it agreeing with the end, capped at MAX_MATCH)."""
    end = len(seq)
    found: dict[tuple[int, ...], int] = {}
    for pos in range(1, end):  # an occurrence ending at pos (exclusive), followed by seq[pos:]
        k = 0
        while k < min(MAX_MATCH, pos) and seq[pos - 1 - k] == seq[end - 1 - k]:
            k += 1
        if k == 0:
            continue
        cont = tuple(seq[pos : pos + depth])
        found[cont] = max(found.get(cont, 0), k)
    return found


@pytest.mark.parametrize("seed", range(20))
def test_continuations_are_earlier_occurrences_longest_match_first(seed: int) -> None:
    rng = random.Random(seed)
    seq = [rng.randrange(4) for _ in range(rng.randrange(2, 120))]
    index = ContextIndex(seq[: len(seq) // 2])
    index.extend(seq[len(seq) // 2 :])  # growing in steps indexes the same as all at once
    got = index.continuations(depth=5, count=1000)
    want = brute_continuations(seq, 5)
    assert len({c.tokens for c in got}) == len(got), "continuations are distinct"
    assert {c.tokens for c in got} == set(want)
    for c in got:
        # the match the index reports is at least the n-gram that found it, at most the true one
        assert min(want[c.tokens], MAX_NGRAM) <= c.match <= want[c.tokens]
    assert [c.match for c in got] == sorted((c.match for c in got), reverse=True)
    limited = index.continuations(depth=5, count=3)
    assert len(limited) == min(3, len(got)) and limited[0].match == got[0].match


def test_no_candidates_without_a_repeat() -> None:
    assert ContextIndex(list(range(50))).continuations(8, 8) == []
    assert ContextIndex([]).continuations(8, 8) == [] and ContextIndex([7]).continuations(8, 8) == []


def test_trie_merges_shared_prefixes_and_keeps_the_longest_match() -> None:
    tokens, parents, match = trie([Continuation((5, 6, 7), 2), Continuation((5, 6, 9), 6), Continuation((8,), 1)])
    # nodes 1.. : 5 (root), 6 (under 5), 7 (under 6), 9 (under 6), 8 (root)
    assert tokens == [5, 6, 7, 9, 8] and parents == [0, 1, 2, 2, 0]
    assert match == [6, 6, 2, 6, 1]


def random_seeds(rng: random.Random) -> tuple[list[int], list[int], list[int]]:
    conts = [Continuation(tuple(rng.randrange(6) for _ in range(rng.randint(1, 7))), rng.randint(1, 20))
             for _ in range(rng.randint(1, 8))]
    return trie(conts)


def taught_model(rng: random.Random) -> AcceptanceModel:
    """An acceptance model whose context table has moved off its prior."""
    model = AcceptanceModel()
    for _ in range(30):
        match = [rng.randint(1, 20) for _ in range(5)]
        model.observe_context(match, [rng.random() < 0.5 for _ in match], [rng.random() < 0.5 for _ in match])
    return model


@pytest.mark.parametrize("seed", range(12))
def test_seed_gains_are_the_draft_free_trees_gains(seed: int) -> None:
    """The plain-Python pricing of a draft-free step equals the tree grow_tree builds."""
    rng = random.Random(seed)
    seeds, model = random_seeds(rng), taught_model(rng)
    spec = SpeculationSettings(budget=rng.choice([3, 8, 64]), max_depth=rng.choice([3, 5, 8]))
    trace = grow_tree(None, None, torch.tensor([1]), spec, SamplingSettings(), 100, model, seeds)
    want = sorted(trace.tree.logp[1:].exp().tolist(), reverse=True)
    got = seed_gains(seeds, model.context_chances(seeds[2], seed_siblings(seeds)), spec.max_depth, spec.budget)
    assert got == pytest.approx(want, rel=1e-5)


@pytest.mark.parametrize("seed", range(12))
def test_context_trees_are_the_trees_grow_tree_cuts(seed: int) -> None:
    """context_tree builds, in plain Python, the tree grow_tree grows from the same seeds and
    top_nodes cuts to the same size: the same nodes, order, scores and match lengths."""
    rng = random.Random(seed)
    seeds, model = random_seeds(rng), taught_model(rng)
    spec = SpeculationSettings(budget=rng.choice([3, 8, 64]), max_depth=rng.choice([3, 5, 8]))
    full = grow_tree(None, None, torch.tensor([1]), spec, SamplingSettings(), 100, model, seeds)
    shared = seed_siblings(seeds)
    for size in (1, 2, 5, spec.budget):
        want = top_nodes(full, size)
        got = context_tree(1, seeds, shared, model.context_chances(seeds[2], shared), spec.max_depth, min(size, spec.budget))
        got.tree.check()
        for name in ("tokens", "parents", "depths", "logp"):
            assert torch.equal(getattr(got.tree, name), getattr(want.tree, name)), (size, name)
        assert torch.equal(got.match, want.match) and got.passes == 0
        assert got.shared is not None and len(got.shared) == len(got.tree)


def test_a_verified_context_tree_teaches_what_teach_would() -> None:
    rng = random.Random(5)
    seeds = random_seeds(rng)
    a, b = taught_model(random.Random(6)), taught_model(random.Random(6))
    shared = seed_siblings(seeds)
    trace = context_tree(1, seeds, shared, a.context_chances(seeds[2], shared), 8, 64)  # uncut: the same siblings
    path = [0, *(i for i in range(1, len(trace.tree)) if trace.tree.parents[i] == 0)][:2]
    chosen = [int(trace.tree.tokens[path[1]]) if len(path) > 1 else 0, 3]
    teach(a, trace, path, chosen)
    teach_context(b, trace, path, chosen)
    assert a.state() == b.state()


def test_a_step_cut_to_a_plain_pass_teaches_what_its_tree_would() -> None:
    rng = random.Random(3)
    seeds = random_seeds(rng)
    a, b = taught_model(random.Random(4)), taught_model(random.Random(4))
    trace = grow_tree(None, None, torch.tensor([1]), SpeculationSettings(budget=64), SamplingSettings(), 100, a, seeds)
    chosen = seeds[0][0]
    teach(a, trace, [0], [chosen])
    roots = [i for i, p in enumerate(seeds[1]) if p == 0]
    shared = seed_siblings(seeds)
    assert len(roots) > 1 and all(shared[i] for i in roots)  # siblings: their own table
    b.observe_context([seeds[2][i] for i in roots], [shared[i] for i in roots], [seeds[0][i] == chosen for i in roots])
    assert a.state() == b.state()


def test_a_candidate_the_draft_also_proposes_is_one_node(tiny_close_draft: LoadedModel) -> None:
    draft = tiny_close_draft.model
    prompt = tiny_close_draft.tokenizer("Once upon a time there was")["input_ids"]
    with torch.inference_mode():
        top = torch.topk(draft.hf_model(torch.tensor([prompt])).logits[0, -1], 2).indices.tolist()
    spec = SpeculationSettings(budget=24, max_depth=4, branching=4, min_pass_gain=0.0)
    seeds = trie([Continuation((top[0], 3, 4), 5), Continuation((top[1],), 2), Continuation((11, 12), 3)])
    cache = draft.new_cache()
    prefill(draft, cache, prompt[:-1])
    trace = grow_tree(draft, cache, torch.tensor(prompt[-1:]), spec, SamplingSettings(), draft.config.vocab_size,
                      AcceptanceModel(), seeds)
    tree = trace.tree
    tree.check()
    pairs = list(zip(tree.parents.tolist(), tree.tokens.tolist()))[1:]
    assert len(pairs) == len(set(pairs)), "no node has two children with one token"
    shared = [i for i in range(1, len(tree)) if tree.parents[i] == 0 and int(tree.tokens[i]) in top]
    assert len(shared) == 2
    for i in shared:  # the draft read the root, so it scored both candidates: both kinds of evidence
        assert int(trace.match[i]) > 0 and torch.isfinite(trace.logq[i])
        assert bool(torch.isfinite(trace.logq_t[i]).all())


EDIT_PROMPT = ("Fix the typos in this paragraph and return it unchanged otherwise:\n\n"
               "The quick brown fox jumpd over the lazy dog. It was a sunny afternon, and the dog did not "
               "seem to mind. Later that day, the fox returned to the forrest where its family was waiting.")


def test_draft_free_trees_copy_text_and_keep_greedy_output(starter_pair: tuple[LoadedModel, LoadedModel],
                                                           starter_reference: Callable[[list[int], int], list[int]],
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    target, _ = starter_pair
    engine = Engine(target.model, target.tokenizer, None)
    # pass costs of a memory-bound device (a pass over n tokens: 1 + 0.05 (n - 1) steps), not this
    # machine's timings, which move with its load: which trees pay is then the same on every run
    monkeypatch.setattr(engine.costs, "target", lambda tokens: 1.0 + 0.05 * (max(tokens, 1) - 1))
    req = GenerationRequest(messages=(Message("user", EDIT_PROMPT),), max_new_tokens=40,
                            speculation=SpeculationSettings(budget=32))
    final = list(engine.generate(req))[-1]
    assert isinstance(final, Completion)
    ids = engine.encode(req)
    ref_ids = starter_reference(ids, 40)
    assert list(final.token_ids) == ref_ids[: len(final.token_ids)] and len(final.token_ids) >= 20
    assert final.stats.mode == "context" and final.stats.draft_passes == 0
    assert final.stats.tokens_per_pass > 1.5, "the answer copies the paragraph: candidates are accepted"
    plain = list(engine.generate(GenerationRequest(messages=req.messages, max_new_tokens=40,
                                                   speculation=SpeculationSettings(context=False))))[-1]
    assert isinstance(plain, Completion) and plain.token_ids == final.token_ids
    assert plain.stats.mode == "autoregressive" and plain.stats.target_passes == len(plain.token_ids)


def test_steps_cut_to_a_plain_pass_still_teach_the_candidates_acceptance(
        starter_pair: tuple[LoadedModel, LoadedModel], monkeypatch: pytest.MonkeyPatch) -> None:
    """A candidate whose estimate is too low is cut, so no tree pass ever labels it: the plain
    pass's token labels the first candidates instead (else the estimate could never recover)."""
    target, _ = starter_pair
    engine = Engine(target.model, target.tokenizer, None)
    monkeypatch.setattr(engine.costs, "best_size", lambda gains, overhead=1: 0)  # every tree is cut
    req = GenerationRequest(messages=(Message("user", EDIT_PROMPT),), max_new_tokens=16,
                            speculation=SpeculationSettings(budget=32))
    final = list(engine.generate(req))[-1]
    assert isinstance(final, Completion) and final.stats.target_passes == final.stats.new_tokens
    model = engine.acceptance[req.sampling]
    assert model.context.observations > 0
    assert sum(model.context.hits) > 0  # the answer copies the paragraph: some were right
