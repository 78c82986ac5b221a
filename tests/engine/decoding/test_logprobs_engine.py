"""Per-token log-probabilities from the engine (engine.decoding.logprobs), checked against the
log-softmax of plain transformers forward logits at every answer position: with a draft's trees,
draft-free trees (context candidates), static Sequoia trees and plain decoding."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from engine.decoding.generation import Engine
from engine.errors import InvalidRequest
from engine.loading.load import LoadedModel
from engine.types import Completion, GenerationRequest, SamplingSettings, SpeculationSettings, TokenEvent

# repeated text: draft-free trees find context candidates in it
PROMPTS = ["one two three one two three one two three one", "def add(a, b):\n    return a + b\n\ndef add("]
MODES = {
    "draft": SpeculationSettings(budget=16, max_depth=6),
    "sequoia": SpeculationSettings(budget=16, max_depth=6, tree_mode="sequoia"),
    "draft-free": SpeculationSettings(budget=16, max_depth=6, draft=False),
    "plain": SpeculationSettings(mode="autoregressive"),
}


def run(engine: Engine, request: GenerationRequest) -> tuple[list[TokenEvent], Completion]:
    events = list(engine.generate(request))
    final = events[-1]
    assert isinstance(final, Completion)
    return [e for e in events if isinstance(e, TokenEvent)], final


def reference(model: LoadedModel, prompt: list[int], answer: list[int]) -> torch.Tensor:
    """(len(answer), V) log-softmax of the target's logits at each answer position (plain forward)."""
    with torch.no_grad():
        logits = model.model.hf_model(torch.tensor([prompt + answer])).logits[0].float()  # (T, V)
    return torch.log_softmax(logits[len(prompt) - 1 : len(prompt) - 1 + len(answer)], dim=-1)


@pytest.mark.parametrize("mode", MODES)
def test_greedy_logprobs_equal_the_target_forward(close_engine: Engine, tiny_target: LoadedModel, mode: str) -> None:
    for text in PROMPTS:
        request = GenerationRequest(raw_prompt=text, max_new_tokens=24, speculation=MODES[mode], logprobs=5)
        events, done = run(close_engine, request)
        answer = list(done.token_ids)
        assert len(done.logprobs) == len(answer) > 0
        assert sum((e.logprobs for e in events), ()) == done.logprobs[: sum(len(e.logprobs) for e in events)]
        ref = reference(tiny_target, close_engine.encode(request), answer)
        for at, (entry, token) in enumerate(zip(done.logprobs, answer, strict=True)):
            assert entry.token.token_id == token
            assert entry.token.logprob == pytest.approx(float(ref[at, token]), abs=1e-4)
            values = [a.logprob for a in entry.top]
            assert len(values) == 5 and values == sorted(values, reverse=True)
            assert entry.top[0].token_id == token, "greedy writes the most likely token"
            best = torch.topk(ref[at], 5).values.tolist()
            assert values == pytest.approx(best, abs=1e-4)
            for alt in entry.top:
                assert alt.logprob == pytest.approx(float(ref[at, alt.token_id]), abs=1e-4)
        if mode == "draft":
            assert done.stats.tokens_per_pass > 1.5, "trees accepted beyond the root"


def test_draft_free_trees_were_used(tiny_target: LoadedModel, monkeypatch: pytest.MonkeyPatch) -> None:
    """The draft-free case above decodes through context-candidate trees, not plain passes only."""
    engine = Engine(tiny_target.model, tiny_target.tokenizer, None)
    # every candidate verified, whatever a loaded machine's timings say a tree costs
    monkeypatch.setattr(engine.costs, "best_size", lambda gains, overhead=1: len(gains))
    request = GenerationRequest(raw_prompt=PROMPTS[0], max_new_tokens=24, logprobs=0,
                                speculation=SpeculationSettings(budget=16, max_depth=6))
    _, done = run(engine, request)
    ref = reference(tiny_target, engine.encode(request), list(done.token_ids))
    got = torch.tensor([e.token.logprob for e in done.logprobs])
    assert torch.allclose(got, ref.gather(1, torch.tensor(done.token_ids)[:, None])[:, 0], atol=1e-4)
    assert all(e.top == () for e in done.logprobs)
    assert done.stats.mode == "context" and done.stats.target_passes < len(done.token_ids)


def test_sampled_tokens_are_unchanged_and_logprobs_are_the_raw_distribution(close_engine: Engine,
                                                                          tiny_target: LoadedModel) -> None:
    """Recording changes no token, and the values are the temperature-1 distribution whatever
    the sampling settings (the module's documented choice)."""
    sampling = SamplingSettings(temperature=0.7, top_p=0.9, seed=4)
    plain = GenerationRequest(raw_prompt=PROMPTS[1], max_new_tokens=20, sampling=sampling,
                              speculation=SpeculationSettings(budget=16, max_depth=6))
    _, without = run(close_engine, plain)
    _, with_ = run(close_engine, dataclasses.replace(plain, logprobs=3))
    assert with_.token_ids == without.token_ids and without.logprobs == ()
    ref = reference(tiny_target, close_engine.encode(plain), list(with_.token_ids))
    for at, entry in enumerate(with_.logprobs):
        assert entry.token.logprob == pytest.approx(float(ref[at, entry.token.token_id]), abs=1e-4)


def test_token_bytes_spell_the_answer(close_engine: Engine, tiny_target: LoadedModel) -> None:
    request = GenerationRequest(raw_prompt="Paris is the capital of", max_new_tokens=30, logprobs=0)
    _, done = run(close_engine, request)
    ids = [t for t in done.token_ids if t not in close_engine.eos_ids]
    data = b"".join(e.token.data for e in done.logprobs[: len(ids)])
    # a random model writes stray bytes too: the tokenizer's text shows them as U+FFFD, as decoding the bytes does
    assert data.decode("utf-8", errors="replace") == tiny_target.tokenizer.decode(ids)
    assert any(e.token.data != e.token.text.encode("utf-8") for e in done.logprobs), "a piece of a character"


@pytest.mark.parametrize("bad", [-1, 21])
def test_out_of_range_alternatives_are_refused(bad: int) -> None:
    with pytest.raises(InvalidRequest, match="from 0 to 20"):
        GenerationRequest(raw_prompt="hi", logprobs=bad)
