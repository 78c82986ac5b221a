"""Sliding-window layers hold their window plus the tree, not the whole history
(engine/model/window_cache.py): equal to a fresh read after every pruning, bounded through a
long answer, cut back to a prompt's end from the window copied aside there, and saved and read
back. Greedy equality with transformers in every mode is in test_families.py."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch
from cache_checks import (
    assert_a_chat_continues_from_its_saved_cache,
    assert_same_entries,
    check_every_keep,
    decode_in_both_modes,
)

from engine.decoding.generation import Engine
from engine.loading.load import load_model
from engine.model.cache import KVCache
from engine.model.cache_files import _rebuild, shape_of
from engine.model.causal_lm import CausalLM
from engine.model.window_cache import WindowedCache, _slack
from engine.testing.synthetic import TINY_WINDOW, tiny_model
from engine.types import CacheSettings, Completion, GenerationRequest, Message, SpeculationSettings

W = TINY_WINDOW
MOST_HELD = W - 1 + _slack(W)  # committed entries a window's layers hold after a step, at most


def paths(arch: str, cache: Path) -> tuple[Path, Path]:
    return (tiny_model(arch, seed=0, layers=4, cache_dir=cache),
            tiny_model(arch, seed=0, noise=0.05, layers=4, cache_dir=cache))


def held(cache: WindowedCache) -> int:
    return cache.length - cache.held_from(W)


@pytest.mark.parametrize("mode", ["draft", "draft-free"])
@pytest.mark.parametrize("arch", ["gemma3_text", "mistral"])  # windowed and full layers; every layer windowed
def test_windowed_caches_equal_a_fresh_read_after_every_step(arch: str, mode: str, model_cache: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    seen = {"dropped": 0}

    def compare(cache: KVCache, fresh: KVCache) -> None:
        assert isinstance(cache, WindowedCache)
        assert_same_entries(cache, fresh, atol=1e-5)
        assert held(cache) <= MOST_HELD, f"{held(cache)} entries held with a window of {W}"
        seen["dropped"] = max(seen["dropped"], cache.held_from(W))

    checked = check_every_keep(monkeypatch, WindowedCache, compare)
    final = decode_in_both_modes(mode, *paths(arch, model_cache), monkeypatch, max_new_tokens=24)
    assert final.stats.tokens_per_pass > 1.3
    assert checked["keeps"] >= 5 and seen["dropped"] > 2 * W, (checked, seen)


def read(model: CausalLM, cache: KVCache, tokens: list[int], chunk: int) -> None:
    """Read `tokens` after what the cache holds, in plain passes of `chunk` tokens."""
    while cache.length < len(tokens):
        part = tokens[cache.length: cache.length + chunk]
        model.forward(torch.tensor(part), torch.arange(cache.length, cache.length + len(part)), cache, None)


@pytest.fixture(scope="module")
def gemma(model_cache: Path) -> CausalLM:
    return load_model(paths("gemma3_text", model_cache)[0]).model


TOKENS = [(i * 37 + 11) % 200 + 5 for i in range(64)]


def fresh_read(model: CausalLM, n: int) -> KVCache:
    fresh = model.new_cache(n + 1)
    model.forward(torch.tensor(TOKENS[:n]), torch.arange(n), fresh, None)
    return fresh


def test_a_long_plain_read_holds_the_window_only(gemma: CausalLM) -> None:
    cache = gemma.new_cache(8)
    assert isinstance(cache, WindowedCache)
    for n in range(1, len(TOKENS) + 1):  # one token a pass, as plain decoding reads
        read(gemma, cache, TOKENS[:n], 1)
        assert held(cache) <= MOST_HELD + 1
    full = [k for (k, _), w in zip(cache.tensors(), cache.windows) if w is None]
    assert all(k.shape[2] == len(TOKENS) for k in full)  # full attention keeps everything
    windowed = [cache.keys[i] for i, w in enumerate(cache.windows) if w is not None]
    assert all(buf.shape[2] < len(TOKENS) for buf in windowed)  # never grown to the history
    assert_same_entries(cache, fresh_read(gemma, len(TOKENS)), atol=1e-5)


def test_a_cut_goes_back_to_the_window_copied_at_the_prompts_end(gemma: CausalLM) -> None:
    cache = gemma.new_cache(8)
    assert isinstance(cache, WindowedCache)
    cache.mark(20)  # a prompt's end, as the engine marks it before reading the prompt
    read(gemma, cache, TOKENS[:50], 8)
    assert cache.held_from(W) > 20 and 20 in cache.snapshots
    near = cache.copy_prefix(49)  # still held: nothing to read again
    assert near.length == 49
    far = cache.copy_prefix(33)  # no longer held: back to the snapshot
    assert far.length == 20 and far.held_from(W) == 20 - (W - 1)
    cache.truncate(40)
    assert cache.length == 20
    for got in (cache, far):
        read(gemma, got, TOKENS[:50], 7)
        assert_same_entries(got, fresh_read(gemma, 50), atol=1e-5)
    bare = gemma.new_cache(8)  # no mark: nothing to go back to but the start
    read(gemma, bare, TOKENS[:50], 8)
    bare.truncate(30)
    assert bare.length == 0 and bare.held_from(W) == 0


def test_a_saved_windowed_cache_reads_back_and_damage_is_refused(gemma: CausalLM) -> None:
    cache = gemma.new_cache(8)
    cache.mark(20)
    read(gemma, cache, TOKENS[:50], 8)
    assert isinstance(cache, WindowedCache) and cache.snapshots
    saved = {f"target.{i}.{n}": t for i, (k, v) in enumerate(cache.tensors()) for n, t in (("k", k), ("v", v))}
    saved |= {f"target.{name}": t for name, t in cache.state_tensors().items()}
    shape = shape_of(cache)
    back = _rebuild(saved, "target", shape, 51, torch.device("cpu"))
    assert isinstance(back, WindowedCache) and back.length == 50 and back.start == cache.start
    assert_same_entries(back, fresh_read(gemma, 50), atol=1e-5)
    back.truncate(30)  # its snapshot came back too
    assert back.length == 20
    start = f"target.win.{W}.start"
    snap = next(name for name in saved if ".wsnap." in name)
    damaged = {
        "a start past the end": {start: torch.tensor([60])},
        "a start of another type": {start: torch.tensor([1.0])},
        "a start that does not fit the entries": {start: saved[start] + 1},
        "a snapshot of the wrong size": {snap: saved[snap][:, :, :2]},
        "a snapshot of a full layer": {"target.wsnap.20.1.k": saved[snap]},
        "an unknown entry": {"target.win.x": torch.tensor([1])},
    }
    for why, change in damaged.items():
        assert _rebuild(saved | change, "target", shape, 51, torch.device("cpu")) is None, why
    no_start = {name: t for name, t in saved.items() if name != start}
    assert _rebuild(no_start, "target", shape, 51, torch.device("cpu")) is None
    assert _rebuild(saved, "target", replace(shape, windows=()), 51, torch.device("cpu")) is None


@pytest.mark.parametrize("arch", ["gemma3_text", "mistral"])
def test_turns_of_a_windowed_chat_reuse_the_prefix(arch: str, model_cache: Path) -> None:
    target_path, draft_path = paths(arch, model_cache)
    target, draft = load_model(target_path), load_model(draft_path)
    spec = SpeculationSettings(budget=16, max_depth=4)
    engine = Engine(target.model, target.tokenizer, draft.model)
    messages: tuple[Message, ...] = ()
    for turn, question in enumerate(["Paris is the capital of", "def add(a, b):", "Once upon a time there was"]):
        messages = (*messages, Message("user", question))
        req = GenerationRequest(messages=messages, max_new_tokens=24, conversation="c", speculation=spec)
        got = list(engine.generate(req))[-1]
        fresh = list(Engine(target.model, target.tokenizer, draft.model,
                            CacheSettings(enabled=False)).generate(req))[-1]
        assert isinstance(got, Completion) and isinstance(fresh, Completion)
        assert got.token_ids == fresh.token_ids, f"turn {turn + 1} differs from a fresh run"
        if turn:
            assert got.stats.cached_tokens > 0, f"turn {turn + 1} read its whole prompt again"
        messages = (*messages, Message("assistant", got.text))


def test_a_windowed_chat_continues_from_its_saved_cache(model_cache: Path, tmp_path: Path) -> None:
    """The windows' starts and the prompt-end windows come back from the file with the K/V."""
    assert_a_chat_continues_from_its_saved_cache(*paths("gemma3_text", model_cache), tmp_path / "kv",
                                                 max_new_tokens=24)
