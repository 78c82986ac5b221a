"""KV caches reused across turns: every turn equals decoding the same messages from empty
caches, and every reused cache equals a from-scratch recomputation of its prefix."""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from engine.decoding.generation import Engine
from engine.decoding.pair import cache_files
from engine.loading.load import LoadedModel, load_model
from engine.model.cache import KVCache
from engine.types import (
    CacheSettings,
    Completion,
    GenerationRequest,
    Message,
    SamplingSettings,
    SpeculationSettings,
)

FRESH = CacheSettings(enabled=False)
SYSTEM = Message("system", "You are a helpful robot who loved to read books about the sea.")
TURNS = ("Paris is the capital of", "def add(a, b):", "Once upon a time there was")


def answer(engine: Engine, messages: tuple[Message, ...], conversation: str | None = "c1",
           sampling: SamplingSettings = SamplingSettings(), budget: int = 16) -> Completion:
    request = GenerationRequest(messages=messages, max_new_tokens=12, sampling=sampling, conversation=conversation,
                                speculation=SpeculationSettings(budget=budget, max_depth=6))
    final = list(engine.generate(request))[-1]
    assert isinstance(final, Completion)
    return final


def play(engine: Engine, sampling: SamplingSettings = SamplingSettings()) -> list[Completion]:
    """Three turns, a regenerate, an edit of the last message and a changed system prompt."""
    out, messages = [], (SYSTEM,)
    for i, text in enumerate(TURNS):
        messages += (Message("user", text),)
        done = answer(engine, messages, sampling=replace(sampling, seed=i) if sampling.seed is not None else sampling)
        out.append(done)
        messages += (Message("assistant", done.text),)
    asked = messages[:-1]
    out.append(answer(engine, asked, sampling=sampling))  # regenerate the last answer
    out.append(answer(engine, asked[:-1] + (Message("user", "Water boils at"),), sampling=sampling))  # edit
    out.append(answer(engine, (Message("system", "Be brief."),) + asked[1:], sampling=sampling))  # new system
    return out


def recomputed_kv(model: LoadedModel, ids: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    with torch.inference_mode():
        cache = model.model.hf_model(torch.tensor([ids]), use_cache=True).past_key_values
    return [(layer.keys, layer.values) for layer in cache.layers]


def assert_cache_is_its_prefix(cache: KVCache, model: LoadedModel, tokens: list[int]) -> None:
    n = cache.length
    assert 0 < n <= len(tokens)
    for (k, v), (rk, rv) in zip(cache.tensors(), recomputed_kv(model, tokens[:n])):
        assert (k - rk).abs().max() <= 1e-5 and (v - rv).abs().max() <= 1e-5


@pytest.mark.parametrize("draft_name", ["tiny_close_draft", "tiny_random_draft", None],
                         ids=["specexec-copy", "specexec-other", "autoregressive"])
def test_every_turn_equals_a_fresh_decode_and_caches_equal_a_recomputation(
        request: pytest.FixtureRequest, tiny_target: LoadedModel, draft_name: str | None) -> None:
    """A draft that is a copy of the target holds the target's K/V between steps
    (drafting.share_context); another draft holds its own."""
    loaded: LoadedModel | None = request.getfixturevalue(draft_name) if draft_name else None
    draft = loaded.model if loaded is not None else None
    reused = play(Engine(tiny_target.model, tiny_target.tokenizer, draft))
    fresh = play(Engine(tiny_target.model, tiny_target.tokenizer, draft, FRESH))
    assert [c.token_ids for c in reused] == [c.token_ids for c in fresh]
    assert all(c.stats.cached_tokens == 0 for c in fresh)
    # from turn 2 on the history is reused (a random model's answers are bytes that do not
    # re-encode to the same tokens, so here the reuse stops at the answer; the starter's test
    # covers answers); regenerate and edit reuse up to the change
    assert all(c.stats.cached_tokens > 0 for c in reused[1:])
    assert reused[1].stats.cached_tokens >= reused[0].stats.prompt_tokens
    assert reused[3].stats.cached_tokens >= reused[2].stats.prompt_tokens - 1
    assert reused[5].stats.cached_tokens < 10  # the system prompt changed at the start
    engine = Engine(tiny_target.model, tiny_target.tokenizer, draft)
    play(engine)
    [prefix] = engine.prefixes._parked
    assert_cache_is_its_prefix(prefix.target, tiny_target, prefix.tokens)
    if loaded is not None:
        assert prefix.draft is not None
        assert engine.copied_draft == (draft_name == "tiny_close_draft")
        assert_cache_is_its_prefix(prefix.draft, tiny_target if engine.copied_draft else loaded, prefix.tokens)


def test_seeded_sampling_is_the_same_with_and_without_reuse(tiny_target: LoadedModel,
                                                           tiny_close_draft: LoadedModel) -> None:
    sampling = SamplingSettings(temperature=0.9, top_p=0.95, seed=7)
    reused = play(Engine(tiny_target.model, tiny_target.tokenizer, tiny_close_draft.model), sampling)
    fresh = play(Engine(tiny_target.model, tiny_target.tokenizer, tiny_close_draft.model, FRESH), sampling)
    assert [c.token_ids for c in reused] == [c.token_ids for c in fresh]


def test_streamed_target_reuses_like_a_resident_one(tiny_target_path: Path, tiny_draft_path: Path) -> None:
    target = load_model(tiny_target_path, offload="all")
    draft = load_model(tiny_draft_path)
    assert target.model.placement.gpu_layers == 0
    reused = play(Engine(target.model, target.tokenizer, draft.model))
    fresh = play(Engine(target.model, target.tokenizer, draft.model, FRESH))
    assert [c.token_ids for c in reused] == [c.token_ids for c in fresh]
    assert reused[1].stats.cached_tokens > 0


def test_a_new_turn_costs_one_weight_pass_before_its_first_token(tiny_target: LoadedModel,
                                                                  tiny_close_draft: LoadedModel,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    engine = Engine(tiny_target.model, tiny_target.tokenizer, tiny_close_draft.model)
    first = answer(engine, (SYSTEM, Message("user", TURNS[0])))
    assert first.stats.prefill_passes == 0  # the prompt fits the first tree pass
    # little free memory: the prompt is read in several chunks first, with the same answer
    monkeypatch.setattr(type(tiny_target.model), "free_memory", lambda self: 100_000)
    squeezed = answer(Engine(tiny_target.model, tiny_target.tokenizer, tiny_close_draft.model, FRESH),
                      (SYSTEM, Message("user", TURNS[0])))
    assert squeezed.stats.prefill_passes >= 2 and squeezed.token_ids == first.token_ids


def test_another_conversation_gets_a_copy_and_the_first_keeps_its_cache(tiny_target: LoadedModel) -> None:
    engine = Engine(tiny_target.model, tiny_target.tokenizer)
    a1 = answer(engine, (SYSTEM, Message("user", TURNS[0])), conversation="a")
    b1 = answer(engine, (SYSTEM, Message("user", TURNS[1])), conversation="b")
    assert b1.stats.cached_tokens > 5  # the shared system prompt, copied
    history = (SYSTEM, Message("user", TURNS[0]), Message("assistant", a1.text), Message("user", TURNS[2]))
    a2 = answer(engine, history, conversation="a")
    assert a2.stats.cached_tokens >= a1.stats.prompt_tokens  # conversation a kept all of its cache
    assert {p.conversation for p in engine.prefixes._parked} == {"a", "b"}


def test_repeated_stateless_requests_keep_a_bounded_pool_and_the_least_recent_go_to_disk(
        tiny_target: LoadedModel, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """API clients repeat one prompt without a conversation key: each request copies the match
    and parks its own prefix, so without a cap on their number every request would scan a longer
    list (and hold more memory) than the last."""
    settings = CacheSettings(min_saved_tokens=8, disk_dir=str(tmp_path / "kv"), max_parked=3)
    engine = Engine(tiny_target.model, tiny_target.tokenizer, None, settings,
                    cache_files(settings, tiny_target.model, None))
    messages = (SYSTEM, Message("user", TURNS[0]))
    answers = [answer(engine, messages, conversation=None, sampling=SamplingSettings(temperature=1.0, seed=i))
               for i in range(6)]
    assert len(engine.prefixes) == 3
    assert tuple(engine.prefixes._parked[-1].tokens[-len(answers[-1].token_ids):]) == tuple(answers[-1].token_ids)
    assert all(a.stats.cached_tokens > 5 for a in answers[1:])  # each still reuses the shared prompt
    assert len(list((tmp_path / "kv").rglob("*.safetensors"))) >= 1  # the evicted ones were long enough to save


def test_over_the_ram_budget_a_conversation_goes_to_disk_and_comes_back(
        tiny_target: LoadedModel, tiny_close_draft: LoadedModel, tmp_path: Path,
        caplog: pytest.LogCaptureFixture) -> None:
    settings = CacheSettings(ram_budget_bytes=0, min_saved_tokens=8, disk_dir=str(tmp_path / "kv"))
    files = cache_files(settings, tiny_target.model, tiny_close_draft.model)
    assert files is not None
    engine = Engine(tiny_target.model, tiny_target.tokenizer, tiny_close_draft.model, settings, files)
    a1 = answer(engine, (SYSTEM, Message("user", TURNS[0])), conversation="a")
    answer(engine, (Message("user", TURNS[1]),), conversation="b")  # evicts a: saved to disk
    assert len(list((tmp_path / "kv").rglob("*.safetensors"))) == 1
    history = (SYSTEM, Message("user", TURNS[0]), Message("assistant", a1.text), Message("user", TURNS[2]))
    fresh = answer(Engine(tiny_target.model, tiny_target.tokenizer, tiny_close_draft.model, FRESH), history)
    # a new engine (an app restart) reads the saved cache instead of the history
    restarted = Engine(tiny_target.model, tiny_target.tokenizer, tiny_close_draft.model, settings,
                       cache_files(settings, tiny_target.model, tiny_close_draft.model))
    again = answer(restarted, history, conversation="a")
    assert again.stats.cached_tokens >= a1.stats.prompt_tokens and again.token_ids == fresh.token_ids
    [prefix] = restarted.prefixes._parked
    assert_cache_is_its_prefix(prefix.target, tiny_target, prefix.tokens)


@pytest.mark.parametrize("damage", ["truncated", "tampered", "other models"])
def test_a_damaged_or_foreign_cache_file_is_ignored(tiny_target: LoadedModel, tiny_close_draft: LoadedModel,
                                                    tiny_random_draft: LoadedModel, tmp_path: Path,
                                                    caplog: pytest.LogCaptureFixture, damage: str) -> None:
    settings = CacheSettings(ram_budget_bytes=0, min_saved_tokens=8, disk_dir=str(tmp_path / "kv"))
    engine = Engine(tiny_target.model, tiny_target.tokenizer, tiny_close_draft.model, settings,
                    cache_files(settings, tiny_target.model, tiny_close_draft.model))
    a1 = answer(engine, (SYSTEM, Message("user", TURNS[0])), conversation="a")
    assert engine.persist_caches() == 1
    [saved] = (tmp_path / "kv").rglob("*.safetensors")
    data = bytearray(saved.read_bytes())
    other_draft = tiny_close_draft.model
    if damage == "truncated":
        saved.write_bytes(bytes(data[: len(data) // 2]))
    elif damage == "tampered":
        data[-100] ^= 0x40  # one bit of one K/V value
        saved.write_bytes(bytes(data))
    else:  # the same file, read by a pair with another draft model
        other_draft = tiny_random_draft.model
        target_dir = saved.parent.parent / Path(cache_files(settings, tiny_target.model, other_draft).dir).name
        target_dir.mkdir(parents=True)
        saved.rename(target_dir / saved.name)
    history = (SYSTEM, Message("user", TURNS[0]), Message("assistant", a1.text), Message("user", TURNS[2]))
    fresh = answer(Engine(tiny_target.model, tiny_target.tokenizer, other_draft, FRESH), history)
    restarted = Engine(tiny_target.model, tiny_target.tokenizer, other_draft, settings,
                       cache_files(settings, tiny_target.model, other_draft))
    with caplog.at_level(logging.WARNING, logger="engine.model.cache_files"):
        again = answer(restarted, history, conversation="a")
    assert again.stats.cached_tokens == 0 and again.token_ids == fresh.token_ids
    assert "ignoring the saved KV cache" in caplog.text
    assert not list((tmp_path / "kv").rglob("*.safetensors"))  # the bad file is gone


@pytest.mark.slow
def test_starter_conversation_reuses_its_history_and_matches_a_fresh_decode(
        starter_pair: tuple[LoadedModel, LoadedModel]) -> None:
    """Real text: an answer re-encodes to the tokens that were generated, so the next turn
    reuses the whole history (the target streamed, --offload all, with the proxy draft; the
    tiny models cover the other combinations)."""
    target, draft = starter_pair
    streamed = load_model(target.path, offload="all")
    runs = []
    for cache in (None, FRESH):
        engine = Engine(streamed.model, target.tokenizer, draft.model, cache)
        first = answer(engine, (SYSTEM, Message("user", TURNS[0])))
        history = (SYSTEM, Message("user", TURNS[0]), Message("assistant", first.text), Message("user", TURNS[1]))
        runs.append([first, answer(engine, history), answer(engine, history)])  # the second turn, regenerated
    reused, fresh = runs
    assert [c.token_ids for c in reused] == [c.token_ids for c in fresh]
    assert reused[1].stats.cached_tokens >= reused[0].stats.prompt_tokens + reused[0].stats.new_tokens - 1
    assert reused[2].stats.cached_tokens == reused[1].stats.prompt_tokens - 1  # regenerate reads one token
