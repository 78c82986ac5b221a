"""Logits -> processed distribution -> token. One function serves the draft, the target and the
autoregressive baseline, so all three agree on what "the distribution" is.

Order of processing follows Hugging Face's generate: repetition penalty, temperature, top-k,
top-p, min-p. Temperature 0 means greedy: `choose_token` returns the argmax of the penalised
logits and draws no random number.

Randomness comes only from an explicit `torch.Generator` on the CPU, one uniform draw per token
(inverse-CDF sampling), so a seed gives the same text on any device and in any decoding mode
that samples the same distributions in the same order. Imports nothing else from the engine.
"""

from __future__ import annotations

import math

import torch

from engine.types import SamplingSettings


def apply_repetition_penalty(logits: torch.Tensor, history: torch.Tensor | None, penalty: float) -> torch.Tensor:
    """CTRL-style penalty (as in HF): seen tokens' positive logits divided, negative multiplied."""
    if penalty == 1.0 or history is None or history.numel() == 0:
        return logits
    seen = history.to(logits.device).unique()
    seen = seen[seen < logits.shape[-1]]
    out = logits.clone()
    picked = out[..., seen]
    out[..., seen] = torch.where(picked > 0, picked / penalty, picked * penalty)
    return out


def process_logits(
    logits: torch.Tensor, settings: SamplingSettings, history: torch.Tensor | None = None
) -> torch.Tensor:
    """(k, V) logits -> (k, V) fp32 log-probabilities of the processed distribution (-inf where
    filtered). With temperature 0, returns the log-softmax at temperature 1 of the penalised
    logits (greedy decoding takes its argmax; drafts rank children by it)."""
    x = apply_repetition_penalty(logits.float(), history, settings.repetition_penalty)
    if settings.temperature > 0:
        x = x / settings.temperature
    else:
        return torch.log_softmax(x, dim=-1)
    vocab = x.shape[-1]
    if 0 < settings.top_k < vocab:
        kth = torch.topk(x, settings.top_k, dim=-1).values[..., -1:]  # (k, 1)
        x = x.masked_fill(x < kth, -math.inf)
    logp = torch.log_softmax(x, dim=-1)
    if settings.top_p < 1.0:
        sorted_logp, order = torch.sort(logp, dim=-1, descending=True)
        probs = sorted_logp.exp()
        mass_before = torch.cumsum(probs, dim=-1) - probs
        # keep the smallest top set whose mass reaches top_p; the top token always survives
        drop_sorted = mass_before >= settings.top_p
        drop_sorted[..., 0] = False
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logp = torch.log_softmax(logp.masked_fill(drop, -math.inf), dim=-1)
    if settings.min_p > 0.0:
        top = logp.max(dim=-1, keepdim=True).values
        logp = torch.log_softmax(logp.masked_fill(logp < top + math.log(settings.min_p), -math.inf), dim=-1)
    return logp


def restrict(logits: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """(..., V) logits with the tokens not `allowed` ((..., V) bool, e.g. a grammar's mask) at
    -inf: every processing step after this (penalty, temperature, top-k/p, min-p, argmax)
    renormalises over the allowed tokens alone, which is the constrained distribution."""
    return logits.masked_fill(~allowed.to(logits.device), -math.inf)


def sample_from_logprobs(logp: torch.Tensor, generator: torch.Generator) -> int:
    """Inverse-CDF sample from a (V,) log-distribution with exactly one uniform draw."""
    probs = logp.float().exp()
    cdf = torch.cumsum(probs, dim=-1)
    u = torch.rand((), generator=generator).item()  # [0, 1)
    x = (1.0 - u) * cdf[-1].item()  # (0, total]: never lands on a zero-probability token
    idx = int(torch.searchsorted(cdf, torch.tensor([x], dtype=cdf.dtype, device=cdf.device)).item())
    return min(idx, probs.shape[-1] - 1)


def choose_token(
    logits: torch.Tensor,
    settings: SamplingSettings,
    generator: torch.Generator | None,
    history: torch.Tensor | None = None,
) -> int:
    """One token from (V,) logits: argmax at temperature 0, else a sample of the processed
    distribution."""
    if settings.greedy:
        x = apply_repetition_penalty(logits.float(), history, settings.repetition_penalty)
        return int(torch.argmax(x, dim=-1).item())
    assert generator is not None, "sampling needs a generator"
    logp = process_logits(logits[None], settings, history)[0]
    return sample_from_logprobs(logp, generator)


def make_generator(seed: int | None) -> torch.Generator:
    g = torch.Generator(device="cpu")
    if seed is None:
        g.seed()
    else:
        g.manual_seed(seed)
    return g
