"""grow_tree against its docstring's claim: the tree is the B nodes most likely to be accepted.

The reference enumerates the draft's whole top-k tree to the depth limit with plain Hugging Face
forwards (no cache, no tree mask), scores every node by its cumulative log acceptance (the
acceptance model applied to the draft's probability of each token on its path, under the same
processed distribution), and keeps the B best. Reading every unread node in each pass
(expand_per_pass >= budget) and never stopping early (min_pass_gain 0) makes the growth exact;
with the default batches it is a best-first approximation that must stay close to the optimum.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from engine.decoding.acceptance import AcceptanceModel
from engine.decoding.drafting import grow_tree, scoring_distribution
from engine.decoding.generation import prefill
from engine.decoding.sampling import process_logits
from engine.loading.load import LoadedModel
from engine.types import SamplingSettings, SpeculationSettings

PROMPT = "Once upon a time there was"


def all_paths(draft: LoadedModel, prompt: list[int], spec: SpeculationSettings, sampling: SamplingSettings,
              vocab_limit: int, model: AcceptanceModel) -> dict[tuple[int, ...], float]:
    """Every node of the top-k tree below the prompt's last token, to depth max_depth: its token
    path -> cumulative log acceptance under the draft's scoring distribution."""
    scoring = scoring_distribution(sampling)
    out: dict[tuple[int, ...], float] = {}
    frontier: list[tuple[tuple[int, ...], float]] = [((), 0.0)]
    for _ in range(spec.max_depth):
        batch = []
        for path, score in frontier:
            with torch.inference_mode():
                logits = draft.model.hf_model(torch.tensor([prompt + list(path)])).logits[0, -1:, :vocab_limit]
            q = process_logits(logits.float(), scoring)[0]  # (V,)
            lp, tok = torch.topk(q, spec.branching)
            accept = model.log_accept(lp, torch.zeros_like(tok), torch.arange(tok.shape[0]))
            for p, a, t in zip(lp.tolist(), accept.tolist(), tok.tolist()):
                if math.isfinite(p):
                    batch.append((path + (t,), score + a))
        out.update(batch)
        frontier = batch
    return out


def grown_paths(draft: LoadedModel, prompt: list[int], spec: SpeculationSettings, sampling: SamplingSettings,
                vocab_limit: int, model: AcceptanceModel) -> dict[tuple[int, ...], float]:
    cache = draft.model.new_cache()
    prefill(draft.model, cache, prompt[:-1])
    trace = grow_tree(draft.model, cache, torch.tensor(prompt[-1:]), spec, sampling, vocab_limit, model)
    tree = trace.tree
    tree.check()
    paths: dict[int, tuple[int, ...]] = {0: ()}
    out = {}
    for i in range(1, len(tree)):
        paths[i] = paths[int(tree.parents[i])] + (int(tree.tokens[i]),)
        out[paths[i]] = float(tree.logp[i])
    return out


def ranked_model() -> AcceptanceModel:
    """An acceptance model taught that at the same draft probability the draft's first choice is
    accepted far more often than its second or third (as under greedy decoding)."""
    model = AcceptanceModel()
    q = torch.linspace(-4.0, 0.0, 60).repeat(3)
    rank = torch.arange(3).repeat_interleave(60)
    for _ in range(20):
        accepted = torch.rand(180, generator=torch.Generator().manual_seed(_)) < q.exp() * (1.0 - 0.6 * rank.clamp(max=1))
        model.observe(q, torch.zeros(180, dtype=torch.long), rank, accepted)
    return model


def test_acceptance_is_learned_per_rank() -> None:
    model = ranked_model()
    at = torch.full((3,), math.log(0.5))
    first, second, third = model.log_accept(at, torch.zeros(3, dtype=torch.long), torch.arange(3)).exp().tolist()
    assert first > 0.35 and second < 0.3 and third < 0.3 and first > 1.8 * max(second, third)
    # without a rank every scored node counts as a first choice
    assert model.log_accept(at, torch.zeros(3, dtype=torch.long)).exp().tolist() == pytest.approx([first] * 3)


@pytest.mark.parametrize("sampling", [SamplingSettings(), SamplingSettings(temperature=0.8, top_p=0.95, seed=1)],
                         ids=["greedy", "sampled"])
@pytest.mark.parametrize("taught", [False, True], ids=["prior", "by-rank"])
def test_grow_tree_keeps_the_budget_most_likely_nodes(tiny_close_draft: LoadedModel,
                                                      sampling: SamplingSettings, taught: bool) -> None:
    prompt = tiny_close_draft.tokenizer(PROMPT)["input_ids"]
    vocab = len(tiny_close_draft.tokenizer)
    spec = SpeculationSettings(budget=30, max_depth=4, branching=3, expand_per_pass=200, min_pass_gain=0.0)
    model = ranked_model() if taught else AcceptanceModel()
    reference = all_paths(tiny_close_draft, prompt, spec, sampling, vocab, model)
    best = sorted(reference, key=reference.__getitem__, reverse=True)[: spec.budget]
    grown = grown_paths(tiny_close_draft, prompt, spec, sampling, vocab, model)
    assert set(grown) == set(best)
    for path, score in grown.items():
        assert score == pytest.approx(reference[path], abs=1e-4)


def test_batched_growth_stays_near_the_optimum(tiny_close_draft: LoadedModel) -> None:
    """The default batches (budget / 8 nodes per draft pass) read fewer nodes than exact growth;
    the probability mass of the tree they grow stays within 10 % of the best possible tree's."""
    prompt = tiny_close_draft.tokenizer(PROMPT)["input_ids"]
    vocab = len(tiny_close_draft.tokenizer)
    exact = SpeculationSettings(budget=40, max_depth=5, branching=3, expand_per_pass=400, min_pass_gain=0.0)
    model = AcceptanceModel()
    reference = all_paths(tiny_close_draft, prompt, exact, SamplingSettings(), vocab, model)
    optimum = sum(sorted((math.exp(s) for s in reference.values()), reverse=True)[: exact.budget])
    batched = grown_paths(tiny_close_draft, prompt, dataclasses.replace(exact, expand_per_pass=None),
                          SamplingSettings(), vocab, model)
    assert len(batched) == exact.budget
    assert sum(math.exp(s) for s in batched.values()) >= 0.9 * optimum
