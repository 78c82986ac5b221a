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
from pathlib import Path

import pytest
import torch

from engine.decoding.acceptance import AcceptanceModel, log_z, tempered
from engine.decoding.drafting import grow_tree, scoring_distribution
from engine.decoding.prefill import prefill
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
            accept = model.log_accept(lp, torch.zeros_like(tok), tempered(lp, log_z(q[None]).expand(lp.shape[0], -1)))
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


def taught_model(tau: float = 0.5, seed: int = 0) -> AcceptanceModel:
    """An acceptance model taught by a target that picks its token from the draft's distribution
    at temperature `tau` (as greedy decoding of a close target looks): each pass labels the draft's
    top 4 tokens at 30 random parents."""
    g = torch.Generator().manual_seed(seed)
    model = AcceptanceModel()
    for _ in range(40):
        q = torch.log_softmax(torch.randn(30, 50, generator=g) * 2.0, dim=-1)
        picked = torch.multinomial(torch.softmax(q / tau, dim=-1), 1, generator=g)  # (30, 1)
        lp, tok = torch.topk(q, 4, dim=-1)
        lt = tempered(lp.reshape(-1), log_z(q).repeat_interleave(4, dim=0))
        model.observe(lp.reshape(-1), torch.zeros(120, dtype=torch.long), lt, (tok == picked).reshape(-1))
    return model


@pytest.mark.parametrize("tau", [0.5, 1.0])
def test_the_draft_temperature_is_learned_from_labels(tau: float) -> None:
    model = taught_model(tau)
    assert model.tau == tau
    q = torch.log_softmax(torch.tensor([[2.0, 1.0, 0.0, -1.0]]), dim=-1)[0]
    lt = tempered(q, log_z(q[None]).expand(4, -1))
    got = model.log_accept(q, torch.zeros(4, dtype=torch.long), lt).exp()
    assert torch.allclose(got, torch.softmax(q / tau, dim=-1), atol=1e-5)
    # the draft's own order is kept; a node without tempered values counts at tau = 1
    assert got.argsort(descending=True).tolist() == [0, 1, 2, 3]
    assert torch.allclose(model.log_accept(q, torch.zeros(4, dtype=torch.long)).exp(), q.exp(), atol=1e-6)


@pytest.mark.parametrize("sampling", [SamplingSettings(), SamplingSettings(temperature=0.8, top_p=0.95, seed=1)],
                         ids=["greedy", "sampled"])
@pytest.mark.parametrize("taught", [False, True], ids=["tau=1", "tau=0.5"])
def test_grow_tree_keeps_the_budget_most_likely_nodes(tiny_close_draft: LoadedModel,
                                                      sampling: SamplingSettings, taught: bool) -> None:
    prompt = tiny_close_draft.tokenizer(PROMPT)["input_ids"]
    vocab = len(tiny_close_draft.tokenizer)
    spec = SpeculationSettings(budget=30, max_depth=4, branching=3, expand_per_pass=200, min_pass_gain=0.0)
    model = taught_model() if taught else AcceptanceModel()
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


def test_only_a_compressed_copy_of_the_target_shares_its_context(
        tiny_target: LoadedModel, tiny_close_draft: LoadedModel, tiny_random_draft: LoadedModel,
        model_cache: Path) -> None:
    """A perturbed copy (the FP4 proxy's case) reads the target's K/V; an unrelated model of the
    same shape, or one of another shape, keeps its own."""
    from engine.decoding.drafting import copy_of_target
    from engine.loading.load import load_model
    from engine.testing.synthetic import tiny_model

    assert copy_of_target(tiny_target.model, tiny_close_draft.model)
    assert not copy_of_target(tiny_target.model, tiny_random_draft.model)
    deeper = load_model(tiny_model("llama", seed=0, layers=3, cache_dir=model_cache))
    assert not copy_of_target(tiny_target.model, deeper.model)


def test_a_shared_context_spares_the_draft_its_prefill(tiny_target: LoadedModel, tiny_close_draft: LoadedModel,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """The draft of a copy reads only the prompt's last part (the tail the target's first pass
    reads too, at most PREFILL_ROOM_CPU tokens), never the whole prompt; greedy output is the
    same either way."""
    from engine.decoding.generation import Engine
    from engine.types import CacheSettings, Completion, GenerationRequest

    prompt = "Once upon a time there was a little robot who loved to read books about the sea. " * 10
    out = {}
    read: list[int] = []
    n_prompt = len(tiny_target.tokenizer(prompt)["input_ids"])
    forward = tiny_close_draft.model.forward

    def counted(tokens: torch.Tensor, positions: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        read.append(int((positions < n_prompt - 1).sum()))  # prompt tokens before the first root
        return forward(tokens, positions, *args, **kwargs)

    monkeypatch.setattr(tiny_close_draft.model, "forward", counted)
    for share in (False, True):
        engine = Engine(tiny_target.model, tiny_target.tokenizer, tiny_close_draft.model, CacheSettings(enabled=False))
        read.clear()
        req = GenerationRequest(raw_prompt=prompt, max_new_tokens=16,
                                speculation=SpeculationSettings(budget=16, max_depth=6, share_context=share))
        final = list(engine.generate(req))[-1]
        assert isinstance(final, Completion)
        assert len(engine.encode(req)) == n_prompt
        out[share] = (final.token_ids, sum(read))
    assert out[True][0] == out[False][0]
    assert out[False][1] == n_prompt - 1  # its own prefill reads the whole prompt
    assert out[True][1] < n_prompt / 2  # sharing: only the tail the target's first pass reads too
