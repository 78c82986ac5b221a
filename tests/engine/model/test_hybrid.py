"""Hybrid models (Gated DeltaNet layers around gated attention) in the engine: the cache after
every pruning equals a fresh sequential read of the kept tokens, turns reuse their prefix, and
sampling is lossless. Greedy equality with transformers in every mode is in test_families.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from cache_checks import (
    assert_a_chat_continues_from_its_saved_cache,
    assert_same_entries,
    check_every_keep,
    decode_in_both_modes,
)
from test_families import PROMPT, assert_first_token_is_lossless

from engine.decoding.generation import Engine
from engine.loading.load import load_model
from engine.model.cache import KVCache
from engine.model.hybrid_cache import HybridCache
from engine.testing.synthetic import tiny_model
from engine.types import Completion, GenerationRequest, Message, SpeculationSettings

HYBRIDS = ["qwen3_5_text", "qwen3_next"]


def paths(arch: str, cache: Path) -> tuple[Path, Path]:
    return tiny_model(arch, seed=0, layers=4, cache_dir=cache), tiny_model(arch, seed=0, noise=0.05, layers=4,
                                                                            cache_dir=cache)


@pytest.mark.parametrize("arch", HYBRIDS)
@pytest.mark.parametrize("mode", ["draft", "draft-free"])
def test_caches_equal_a_fresh_read_after_every_step(arch: str, mode: str, model_cache: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Every keep() (target and draft) is checked against a new cache that read the kept
    tokens in one chain: each linear layer's conv and recurrent state, and the attention
    layers' K/V."""
    pending = {"entries": 0}

    def count_pending(cache: KVCache) -> None:
        assert isinstance(cache, HybridCache)
        pending["entries"] += cache.length - cache.committed

    def compare(cache: KVCache, fresh: KVCache) -> None:
        assert isinstance(cache, HybridCache) and isinstance(fresh, HybridCache)
        assert fresh.committed == fresh.length == cache.committed
        for i, state in cache.states.items():
            # above the first layer, inputs carry a tree pass's rounding (see the K/V below)
            assert torch.allclose(state.conv, fresh.states[i].conv, atol=3e-4), f"layer {i} conv"
            assert torch.allclose(state.recurrent, fresh.states[i].recurrent, atol=3e-4), f"layer {i} state"
        # K/V of attention layers above linear ones: a tree pass and a chain round differently
        # (block forms of the delta rule), ~1e-4 after a few layers of this peaked tiny model
        assert_same_entries(cache, fresh, atol=3e-4)

    checked = check_every_keep(monkeypatch, HybridCache, compare, before=count_pending)
    # the draft computes its own states here (a copy sharing the target's is in test_families)
    final = decode_in_both_modes(mode, *paths(arch, model_cache), monkeypatch)
    assert final.stats.tokens_per_pass > 1.3
    assert checked["keeps"] >= 5 and pending["entries"] > 3 * checked["keeps"], (checked, pending)


def test_a_copy_of_a_hybrid_target_reads_its_states(model_cache: Path) -> None:
    """The noisy copy is recognised as a compressed copy of the target and drafts from the
    target's own linear states and K/V (SubSpec), with text equal to the target alone."""
    target_path, draft_path = paths("qwen3_5_text", model_cache)
    target, draft = load_model(target_path), load_model(draft_path)
    engine = Engine(target.model, target.tokenizer, draft.model)
    assert engine.copied_draft
    shared: list[bool] = []
    real = HybridCache.share_states

    def share(self: HybridCache, other: HybridCache) -> None:
        real(self, other)
        shared.append(all(torch.equal(s.recurrent, other.states[i].recurrent) for i, s in self.states.items()))

    req = GenerationRequest(raw_prompt=PROMPT, max_new_tokens=20, speculation=SpeculationSettings(budget=16, max_depth=4))
    with pytest.MonkeyPatch.context() as m:
        m.setattr(HybridCache, "share_states", share)
        got = list(engine.generate(req))[-1]
    plain = list(Engine(target.model, target.tokenizer).generate(
        GenerationRequest(raw_prompt=PROMPT, max_new_tokens=20, speculation=SpeculationSettings(mode="autoregressive"))))[-1]
    assert isinstance(got, Completion) and isinstance(plain, Completion)
    assert shared and all(shared) and got.token_ids == plain.token_ids and got.stats.tokens_per_pass > 1.3


def test_a_hybrid_cache_cut_below_its_committed_tokens_starts_afresh(model_cache: Path) -> None:
    model = load_model(paths("qwen3_5_text", model_cache)[0]).model
    cache = model.new_cache(16)
    assert isinstance(cache, HybridCache)
    model.forward(torch.arange(10), torch.arange(10), cache, None)
    assert cache.committed == 10
    copy = cache.copy_prefix(10)
    assert copy.length == 10 and all(torch.equal(copy.states[i].recurrent, s.recurrent) for i, s in cache.states.items())
    assert cache.copy_prefix(6).length == 0
    cache.truncate(6)
    assert cache.length == 0 and all(not s.recurrent.any() for s in cache.states.values())


def test_turns_of_a_hybrid_chat_reuse_the_prefix(model_cache: Path) -> None:
    """Three turns of one conversation: turns 2 and 3 read only their new tokens, and each
    answer equals a fresh engine's answer to the same messages."""
    target_path, draft_path = paths("qwen3_5_text", model_cache)
    target, draft = load_model(target_path), load_model(draft_path)
    spec = SpeculationSettings(budget=16, max_depth=4)
    engine = Engine(target.model, target.tokenizer, draft.model)
    messages: list[Message] = []
    for turn, question in enumerate(["Paris is the capital of", "def add(a, b):", "Once upon a time there was"]):
        messages.append(Message("user", question))
        req = GenerationRequest(messages=tuple(messages), max_new_tokens=12, conversation="c1", speculation=spec)
        got = list(engine.generate(req))[-1]
        fresh = list(Engine(target.model, target.tokenizer, draft.model).generate(req))[-1]
        assert isinstance(got, Completion) and isinstance(fresh, Completion)
        assert got.token_ids == fresh.token_ids, f"turn {turn + 1}"
        if turn:
            assert got.stats.cached_tokens > 0, f"turn {turn + 1} read its whole prompt again"
        messages.append(Message("assistant", got.text))


def test_a_hybrid_chat_continues_from_its_saved_cache(model_cache: Path, tmp_path: Path) -> None:
    """Turn 1 answered, its cache saved (no RAM budget: parked prefixes go to disk); a new
    engine, as after a restart, answers turn 2 from the file: states, snapshots and K/V come
    back, and the text equals a fresh engine's."""
    assert_a_chat_continues_from_its_saved_cache(*paths("qwen3_5_text", model_cache), tmp_path / "kv")


def test_sampling_from_a_hybrid_model_is_lossless(model_cache: Path) -> None:
    assert_first_token_is_lossless(*paths("qwen3_5_text", model_cache))
