"""sampling.py against hand-computed distributions and Hugging Face's own logits processors."""

from __future__ import annotations

import math

import pytest
import torch
from chi_square import chisquare_pvalue
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from engine.decoding.sampling import (
    choose_token,
    make_generator,
    process_logits,
    sample_from_logprobs,
)
from engine.types import SamplingSettings

KNOWN = torch.tensor([[0.5, 0.25, 0.15, 0.1]]).log()  # logits whose softmax is exactly these probs


def probs(settings: SamplingSettings, logits: torch.Tensor = KNOWN) -> list[float]:
    return [round(p, 6) for p in process_logits(logits, settings)[0].exp().tolist()]


@pytest.mark.parametrize(
    ("top_p", "expected"),
    [
        (0.4, [1.0, 0.0, 0.0, 0.0]),  # the top token alone already holds 0.5 >= 0.4
        (0.7, [2 / 3, 1 / 3, 0.0, 0.0]),  # 0.5 + 0.25 = 0.75 is the smallest set reaching 0.7
        (0.75, [2 / 3, 1 / 3, 0.0, 0.0]),  # exactly reached: the third token is not needed
        (0.8, [0.5 / 0.9, 0.25 / 0.9, 0.15 / 0.9, 0.0]),
        (1.0, [0.5, 0.25, 0.15, 0.1]),
    ],
)
def test_top_p_keeps_smallest_set_reaching_mass(top_p: float, expected: list[float]) -> None:
    got = probs(SamplingSettings(temperature=1.0, top_p=top_p))
    assert got == pytest.approx(expected, abs=1e-5)


def test_top_k_and_min_p_on_known_distribution() -> None:
    assert probs(SamplingSettings(temperature=1.0, top_k=2)) == pytest.approx([2 / 3, 1 / 3, 0, 0], abs=1e-6)
    # min_p 0.4: keep tokens with p >= 0.4 * 0.5 = 0.2
    assert probs(SamplingSettings(temperature=1.0, min_p=0.4)) == pytest.approx([2 / 3, 1 / 3, 0, 0], abs=1e-6)


def test_temperature_sharpens() -> None:
    got = probs(SamplingSettings(temperature=0.5))
    raw = torch.tensor([0.5, 0.25, 0.15, 0.1]) ** 2
    assert got == pytest.approx((raw / raw.sum()).tolist(), abs=1e-6)


@pytest.mark.parametrize("seed", range(5))
def test_matches_huggingface_processor_chain(seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(3, 500, generator=g) * 3
    history = torch.randint(0, 500, (40,), generator=g)
    s = SamplingSettings(temperature=0.7, top_k=50, top_p=0.9, min_p=0.05, repetition_penalty=1.3)
    ours = process_logits(logits, s, history).exp()
    ids = history[None].expand(3, -1)
    x = RepetitionPenaltyLogitsProcessor(1.3)(ids, logits.clone())
    for warper in (TemperatureLogitsWarper(0.7), TopKLogitsWarper(50), TopPLogitsWarper(0.9), MinPLogitsWarper(0.05)):
        x = warper(ids, x)
    ref = torch.softmax(x, dim=-1)
    assert torch.allclose(ours, ref, atol=1e-5)


def test_greedy_is_argmax_of_penalised_logits() -> None:
    logits = torch.tensor([1.0, 3.0, 2.9, -1.0])
    s = SamplingSettings(temperature=0.0)
    assert choose_token(logits, s, None) == 1
    penalised = SamplingSettings(temperature=0.0, repetition_penalty=1.5)
    assert choose_token(logits, penalised, None, history=torch.tensor([1])) == 2


def test_inverse_cdf_sampling_frequencies() -> None:
    p = torch.tensor([0.4, 0.0, 0.3, 0.2, 0.1])
    logp = p.log()
    g = make_generator(123)
    n = 20000
    counts = torch.zeros(5)
    for _ in range(n):
        counts[sample_from_logprobs(logp, g)] += 1
    assert counts[1] == 0, "a zero-probability token was drawn"
    keep = p > 0
    assert chisquare_pvalue(counts[keep], p[keep] * n) > 1e-3


def test_same_seed_same_draws_and_one_draw_per_token() -> None:
    logp = torch.log_softmax(torch.randn(1000), dim=-1)
    a, b = make_generator(7), make_generator(7)
    assert [sample_from_logprobs(logp, a) for _ in range(50)] == [sample_from_logprobs(logp, b) for _ in range(50)]
    c = make_generator(7)
    sample_from_logprobs(logp, c)
    d = make_generator(7)
    torch.rand((), generator=d)
    assert torch.equal(c.get_state(), d.get_state())


def test_filtered_tokens_are_minus_inf() -> None:
    out = process_logits(KNOWN, SamplingSettings(temperature=1.0, top_k=1))[0]
    assert out[0] == 0.0 and all(math.isinf(v) and v < 0 for v in out[1:].tolist())
