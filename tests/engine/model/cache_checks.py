"""One harness for "the cache after every pruning equals a fresh read of the kept tokens",
shared by the hybrid, Gemma 4 and sliding-window tests: it records which token each cache slot
holds (CausalLM.forward) and, after each `keep` of the cache class under test, reads the kept
tokens into a new cache in one chain and hands both to the test's comparison."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from test_families import PROMPT, candidates_from, reference

from engine.decoding.generation import Engine
from engine.decoding.pair import cache_files
from engine.loading.load import load_model
from engine.model.cache import KVCache
from engine.model.causal_lm import CausalLM
from engine.types import CacheSettings, Completion, GenerationRequest, Message, SpeculationSettings

Compare = Callable[[KVCache, KVCache], None]  # (the pruned cache, a fresh read of its tokens)


def check_every_keep(monkeypatch: pytest.MonkeyPatch, cls: type[KVCache], compare: Compare,
                     before: Callable[[KVCache], None] | None = None) -> dict[str, int]:
    """Patch CausalLM.forward and `cls.keep`; returns the counts, {"keeps": n}, as they grow."""
    tokens: dict[int, dict[int, int]] = {}  # cache -> slot -> token
    owner: dict[int, CausalLM] = {}
    checked = {"keeps": 0}
    real_forward, real_keep = CausalLM.forward, cls.keep

    def forward(self: CausalLM, ids: torch.Tensor, positions: torch.Tensor, cache: KVCache,
                allowed: torch.Tensor | None) -> torch.Tensor:
        slots = tokens.setdefault(id(cache), {})
        slots.update({cache.length + j: t for j, t in enumerate(ids.tolist())})
        owner[id(cache)] = self
        return real_forward(self, ids, positions, cache, allowed)

    def keep(self: KVCache, indices: torch.Tensor) -> None:
        if before is not None:
            before(self)
        real_keep(self, indices)
        kept = [tokens[id(self)][i] for i in indices.tolist()]
        tokens[id(self)] = dict(enumerate(kept))
        model = owner[id(self)]
        fresh = model.new_cache(len(kept) + 1)
        real_forward(model, torch.tensor(kept), torch.arange(len(kept)), fresh, None)
        compare(self, fresh)
        checked["keeps"] += 1

    monkeypatch.setattr(CausalLM, "forward", forward)
    monkeypatch.setattr(cls, "keep", keep)
    return checked


def decode_in_both_modes(mode: str, target_path: Path, draft_path: Path, monkeypatch: pytest.MonkeyPatch,
                         max_new_tokens: int = 20) -> Completion:
    """A greedy answer to PROMPT with a noisy copy as a draft (its own cache, not the target's)
    or with draft-free trees that hold the right continuation, budget 32."""
    target, draft = load_model(target_path), load_model(draft_path)
    if mode == "draft":
        engine = Engine(target.model, target.tokenizer, draft.model)
    else:
        engine = Engine(target.model, target.tokenizer)
        ids = target.tokenizer(PROMPT)["input_ids"]
        candidates_from(reference(target_path, ids, target.tokenizer.pad_token_id), monkeypatch)
    req = GenerationRequest(raw_prompt=PROMPT, max_new_tokens=max_new_tokens,
                            speculation=SpeculationSettings(budget=32, max_depth=6, context_candidates=16,
                                                            share_context=False))
    final = list(engine.generate(req))[-1]
    assert isinstance(final, Completion)
    return final


def assert_same_entries(cache: KVCache, fresh: KVCache, atol: float) -> None:
    """Every layer's K/V in `cache` equal `fresh`'s (a chain read of the same tokens, which drops
    nothing): a sliding layer's held entries against the same entries of the fresh read."""
    assert cache.length == fresh.length
    windows = getattr(cache, "windows", (None,) * cache.num_layers)
    for i, ((k, v), (fk, fv)) in enumerate(zip(cache.tensors(), fresh.tensors())):
        w = windows[i]
        first = cache.held_from(w) if w is not None else 0
        fk, fv = fk[:, :, first:], fv[:, :, first:]
        assert k.shape == fk.shape, f"layer {i}: {tuple(k.shape)} held, {tuple(fk.shape)} expected"
        assert torch.allclose(k, fk, atol=atol) and torch.allclose(v, fv, atol=atol), \
            f"layer {i}: {float((k - fk).abs().max())}"


def assert_a_chat_continues_from_its_saved_cache(target_path: Path, draft_path: Path, disk: Path,
                                                 max_new_tokens: int = 12) -> None:
    """Turn 1 answered and its caches saved to `disk` (no RAM budget: parked prefixes go to disk);
    a new engine, as after a restart, answers turn 2 from the file (what the cache class saves
    besides K/V comes back with it) with `cached_tokens` > 0 and a fresh engine's text."""
    target, draft = load_model(target_path), load_model(draft_path)
    spec = SpeculationSettings(budget=16, max_depth=4)
    settings = CacheSettings(ram_budget_bytes=0, min_saved_tokens=8, disk_dir=str(disk))

    def engine(cache: CacheSettings = settings) -> Engine:
        files = cache_files(cache, target.model, draft.model) if cache.enabled else None
        return Engine(target.model, target.tokenizer, draft.model, cache, files)

    first = engine()
    one = GenerationRequest(messages=(Message("user", "Paris is the capital of"),), max_new_tokens=max_new_tokens,
                            conversation="c", speculation=spec)
    answer = list(first.generate(one))[-1]
    assert isinstance(answer, Completion) and first.persist_caches() >= 1
    assert list(disk.rglob("*.safetensors"))
    two = replace(one, messages=(*one.messages, Message("assistant", answer.text), Message("user", "def add(a, b):")))
    got = list(engine().generate(two))[-1]
    fresh = list(engine(CacheSettings(enabled=False)).generate(two))[-1]
    assert isinstance(got, Completion) and isinstance(fresh, Completion)
    assert got.stats.cached_tokens > 0 and got.token_ids == fresh.token_ids
