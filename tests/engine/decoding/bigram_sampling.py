"""The sampling check the draft-head tests share: a target whose next token depends on the last
token alone (a bigram table, read from transformers' logits after each single token) has exact
marginals for each of the first few sampled tokens, EOS ending a sequence; the engine's samples
with a head drafting must follow them (chi-square), and the check must have the power to reject
a mildly wrong temperature."""

from __future__ import annotations

import torch
from test_lossless_sampling import chi2_pvalue

from engine.decoding.generation import Engine
from engine.types import Completion, GenerationRequest, SamplingSettings, SpeculationSettings


def sampled_like_the_target(engine: Engine, prompt: str, tokens: int, samples: int, temperature: float,
                            speculation: SpeculationSettings) -> list[Completion]:
    """Sample `samples` answers of `tokens` tokens (seeds 0..), assert each position's counts
    follow the target's marginals and that a 1.5x temperature would be rejected; the answers."""
    last = engine.tokenizer(prompt)["input_ids"][-1]
    vocab = engine.target.shape.vocab_size
    with torch.inference_mode():
        table = engine.target.hf_model(torch.arange(vocab)[:, None]).logits[:, -1].double()  # (V, V) next | last
    step = torch.softmax(table / temperature, dim=-1)
    going = torch.tensor([t not in engine.eos_ids for t in range(vocab)]).double()
    marginals = [step[last]]
    for _ in range(tokens - 1):
        nxt = (marginals[-1] * going) @ step
        marginals.append(nxt / nxt.sum())
    counts = torch.zeros(tokens, vocab)
    finals = []
    for seed in range(samples):
        request = GenerationRequest(raw_prompt=prompt, max_new_tokens=tokens,
                                    sampling=SamplingSettings(temperature=temperature, seed=seed),
                                    speculation=speculation)
        final = list(engine.generate(request))[-1]
        assert isinstance(final, Completion)
        for i, token in enumerate(final.token_ids):
            counts[i, token] += 1
        finals.append(final)
    for i in range(tokens):
        assert counts[i].sum() > 0.9 * samples
        assert chi2_pvalue(counts[i], marginals[i]) > 1e-3, i
    hotter = torch.softmax(table[last] / (1.5 * temperature), dim=-1)
    assert chi2_pvalue(counts[0], hotter) < 1e-3  # power: a mildly wrong temperature is rejected
    return finals
