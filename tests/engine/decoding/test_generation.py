"""The decode loop on real tiny models, checked against plain transformers decoding."""

from __future__ import annotations

import dataclasses
import threading
from pathlib import Path

import pytest
import torch

from engine.decoding.generation import Engine
from engine.errors import InvalidRequest
from engine.loading.load import LoadedModel, load_model
from engine.testing.synthetic import tiny_model
from engine.types import (
    Completion,
    GenerationRequest,
    Message,
    SamplingSettings,
    SpeculationSettings,
    TokenEvent,
)

PROMPTS = ["Paris is the capital of", "def add(a, b):", "Once upon a time there was"]


def run(engine: Engine, request: GenerationRequest, cancel: threading.Event | None = None) -> Completion:
    events = list(engine.generate(request, cancel))
    final = events[-1]
    assert isinstance(final, Completion)
    streamed = "".join(e.text for e in events[:-1] if isinstance(e, TokenEvent))
    assert streamed == final.text, "streamed text differs from the final text"
    return final


def hf_greedy(model: LoadedModel, ids: list[int], n: int) -> list[int]:
    x = torch.tensor([ids])
    out = model.model.hf_model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, do_sample=False,
                                        pad_token_id=model.tokenizer.pad_token_id)
    return out[0, len(ids) :].tolist()


@pytest.mark.parametrize("draft_name", ["tiny_close_draft", "tiny_random_draft"])
@pytest.mark.parametrize("budget", [1, 8, 64, 256])
def test_greedy_specexec_equals_transformers_generate(
    request: pytest.FixtureRequest, tiny_target: LoadedModel, draft_name: str, budget: int
) -> None:
    draft: LoadedModel = request.getfixturevalue(draft_name)
    engine = Engine(tiny_target.model, tiny_target.tokenizer, draft.model)
    for prompt in PROMPTS:
        req = GenerationRequest(raw_prompt=prompt, max_new_tokens=40,
                                speculation=SpeculationSettings(budget=budget, max_depth=12))
        ids = engine.encode(req)
        got = run(engine, req)
        ref = hf_greedy(tiny_target, ids, 40)
        if got.finish_reason == "eos":
            ref = ref[: len(got.token_ids)]
        assert list(got.token_ids) == ref, f"budget {budget}, prompt {prompt!r}"
        if draft_name == "tiny_close_draft" and budget >= 8:
            assert got.stats.tokens_per_pass > 1.5, "a close draft should be accepted beyond the root"


def test_qwen2_with_padded_draft_vocab(model_cache: Path) -> None:
    target = load_model(tiny_model("qwen2", seed=2, cache_dir=model_cache))
    draft = load_model(tiny_model("qwen2", seed=2, noise=0.05, vocab_pad=64, cache_dir=model_cache))
    assert draft.model.shape.vocab_size != target.model.shape.vocab_size
    engine = Engine(target.model, target.tokenizer, draft.model)
    req = GenerationRequest(raw_prompt=PROMPTS[0], max_new_tokens=30, speculation=SpeculationSettings(budget=32))
    got = run(engine, req)
    assert list(got.token_ids) == hf_greedy(target, engine.encode(req), 30)[: len(got.token_ids)]


def test_autoregressive_mode_and_no_draft_agree(close_engine: Engine, tiny_target: LoadedModel) -> None:
    req = GenerationRequest(raw_prompt=PROMPTS[1], max_new_tokens=25,
                            speculation=SpeculationSettings(mode="autoregressive"))
    a = run(close_engine, req)
    b = run(Engine(tiny_target.model, tiny_target.tokenizer, None), dataclasses.replace(req, speculation=SpeculationSettings()))
    assert a.token_ids == b.token_ids
    assert a.stats.target_passes == len(a.token_ids) and a.stats.draft_passes == 0
    assert a.stats.mode == "autoregressive" and b.stats.mode == "context"  # no draft: draft-free trees
    c = run(Engine(tiny_target.model, tiny_target.tokenizer, None),
            dataclasses.replace(req, speculation=SpeculationSettings(context=False)))
    assert c.token_ids == a.token_ids and c.stats.mode == "autoregressive"
    assert c.stats.target_passes == len(c.token_ids)


@pytest.mark.parametrize("sampling", [SamplingSettings(temperature=1.0, seed=3),
                                      SamplingSettings(temperature=0.6, top_p=0.9, seed=11),
                                      SamplingSettings(temperature=0.8, top_k=20, repetition_penalty=1.2, seed=5)])
def test_seeded_sampling_matches_autoregressive(close_engine: Engine, sampling: SamplingSettings) -> None:
    """Both modes draw one uniform per token from the same distributions in the same order, so
    a seed gives the same tokens; a strong end-to-end check of the stochastic acceptance walk."""
    spec = GenerationRequest(raw_prompt=PROMPTS[2], max_new_tokens=40, sampling=sampling,
                             speculation=SpeculationSettings(budget=32))
    ar = dataclasses.replace(spec, speculation=SpeculationSettings(mode="autoregressive"))
    a, b = run(close_engine, spec), run(close_engine, ar)
    assert a.token_ids == b.token_ids
    assert a.stats.target_passes < b.stats.target_passes


@pytest.mark.parametrize("mode", ["specexec", "autoregressive"])
def test_repetition_penalty_looks_at_a_window_and_spares_end_of_turn(close_engine: Engine, tiny_target: LoadedModel,
                                                                     mode: str) -> None:
    """Greedy decoding with the penalty equals a from-scratch reference: full forward passes,
    HF's penalty over the last `repetition_window` tokens with the end-of-turn ids left out."""
    from transformers import RepetitionPenaltyLogitsProcessor

    sampling = SamplingSettings(temperature=0.0, repetition_penalty=1.8, repetition_window=12)
    req = GenerationRequest(messages=(Message("user", "Say something twice."),), max_new_tokens=30, sampling=sampling,
                            speculation=SpeculationSettings(mode=mode, budget=16))  # type: ignore[arg-type]
    got = run(close_engine, req)
    ids = close_engine.encode(req)
    ref: list[int] = []
    penalty = RepetitionPenaltyLogitsProcessor(1.8)
    for _ in range(len(got.token_ids)):
        seq = ids + ref
        with torch.no_grad():
            logits = tiny_target.model.hf_model(torch.tensor([seq])).logits[0, -1].float()
        window = [t for t in seq[-12:] if t not in close_engine.eos_ids]
        logits = penalty(torch.tensor([window]), logits[None].clone())[0] if window else logits
        ref.append(int(torch.argmax(logits)))
    assert list(got.token_ids) == ref
    plain = run(close_engine, dataclasses.replace(req, sampling=SamplingSettings(temperature=0.0)))
    assert plain.token_ids != got.token_ids  # the penalty changed something to check


def test_continue_writes_on_from_a_cut_answer(close_engine: Engine) -> None:
    """Continue feeds the cut answer back without its end-of-turn: the prompt is the first
    prompt followed by the answer's text (re-tokenised as one string, so ids may merge at the
    seam, as in every engine that continues from text), and the answer goes on from there."""
    ask = (Message("system", "Be brief."), Message("user", "Tell me a story."))
    cut = run(close_engine, GenerationRequest(messages=ask, max_new_tokens=8))
    assert cut.finish_reason == "length" and cut.text
    more = GenerationRequest(messages=(*ask, Message("assistant", cut.text)), max_new_tokens=16, continue_final=True)
    decode = close_engine.tokenizer.decode
    assert decode(close_engine.encode(more)) == decode(close_engine.encode(GenerationRequest(messages=ask))) + cut.text
    assert run(close_engine, more).token_ids
    with pytest.raises(InvalidRequest, match="last message must be the assistant"):
        GenerationRequest(messages=ask, continue_final=True)


def test_same_seed_same_text_other_seed_differs(close_engine: Engine) -> None:
    req = GenerationRequest(raw_prompt=PROMPTS[0], max_new_tokens=30,
                            sampling=SamplingSettings(temperature=1.0, seed=1))
    a, b = run(close_engine, req), run(close_engine, req)
    c = run(close_engine, dataclasses.replace(req, sampling=SamplingSettings(temperature=1.0, seed=2)))
    assert a.token_ids == b.token_ids
    assert a.token_ids != c.token_ids


def test_stop_string_cuts_text(close_engine: Engine) -> None:
    base = run(close_engine, GenerationRequest(raw_prompt=PROMPTS[2], max_new_tokens=30))
    assert len(base.text) > 6
    stop = base.text[3:6]
    got = run(close_engine, GenerationRequest(raw_prompt=PROMPTS[2], max_new_tokens=30, stop=(stop,)))
    assert got.finish_reason == "stop"
    assert got.text == base.text[: base.text.find(stop)]


def test_max_new_tokens_and_chat_template(close_engine: Engine) -> None:
    req = GenerationRequest(messages=(Message("system", "Be brief."), Message("user", "hello there")),
                            max_new_tokens=7, speculation=SpeculationSettings(budget=16))
    got = run(close_engine, req)
    assert len(got.token_ids) <= 7
    ids = close_engine.encode(req)
    assert close_engine.tokenizer.decode(ids).startswith("<|im_start|>system\nBe brief.<|im_end|>")
    if got.finish_reason == "length":
        assert len(got.token_ids) == 7


def test_cancel_stops_between_steps(close_engine: Engine) -> None:
    cancel = threading.Event()
    req = GenerationRequest(raw_prompt=PROMPTS[0], max_new_tokens=200, speculation=SpeculationSettings(budget=4))
    events = []
    for event in close_engine.generate(req, cancel):
        events.append(event)
        cancel.set()
    final = events[-1]
    assert isinstance(final, Completion) and final.finish_reason == "cancelled"
    assert 0 < len(final.token_ids) < 200


def test_stop_during_a_long_prompt_starts_no_further_pass(close_engine: Engine, monkeypatch) -> None:
    """A Stop while the prompt is read takes effect before the next prefill chunk: no target or
    draft pass starts after it (the prefill of a long conversation used to run to its end)."""
    cancel = threading.Event()
    started_after_stop = []
    for model in (close_engine.target, close_engine.draft):
        forward = model.forward

        def counted(*args, _forward=forward, **kwargs):  # type: ignore[no-untyped-def]
            started_after_stop.append(cancel.is_set())
            if len(started_after_stop) == 2:
                cancel.set()  # the user presses Stop while the second chunk is being read
            return _forward(*args, **kwargs)

        monkeypatch.setattr(model, "forward", counted)
    prompt = " ".join(PROMPTS * 60)  # ~1,100 tokens: several prefill chunks
    req = GenerationRequest(raw_prompt=prompt, max_new_tokens=50, speculation=SpeculationSettings(budget=4))
    final = run(close_engine, req, cancel)
    assert final.finish_reason == "cancelled" and final.token_ids == ()
    assert len(started_after_stop) == 2 and not any(started_after_stop)


def test_prefill_chunks_follow_what_a_pass_costs() -> None:
    """Compute-bound passes (a CPU) shrink the chunk to about PREFILL_STEP_S of work; passes that
    cost mostly their weights (twice the tokens, hardly more time) grow it to the largest."""
    from engine.decoding.prefill import PREFILL_MIN_CHUNK, PREFILL_STEP_S, next_prefill_chunk

    MOST = 512  # noqa: N806  (the largest chunk memory allows)
    per_token = 0.04  # the starter on this machine's 2 cores: ~20 s for 512 tokens
    assert next_prefill_chunk(32, 32 * per_token, None, MOST) == max(PREFILL_MIN_CHUNK,
                                                                      int(PREFILL_STEP_S / per_token))
    assert next_prefill_chunk(16, 0.001, None, MOST) == 32  # cheap: grows, doubling
    weights = 5.0  # an offloaded 70B: each pass streams the weights
    assert next_prefill_chunk(64, weights + 0.1, (32, weights), MOST) == MOST
    assert next_prefill_chunk(64, 2 * 64 * per_token, (32, 32 * per_token), MOST) == PREFILL_MIN_CHUNK


def test_eos_finishes_with_eos_token(tiny_target: LoadedModel, tiny_close_draft: LoadedModel) -> None:
    engine = Engine(tiny_target.model, tiny_target.tokenizer, tiny_close_draft.model)
    eos = tiny_target.tokenizer.eos_token_id
    engine.eos_ids = frozenset(engine.eos_ids | {int(t) for t in range(0, 384, 3)})  # make EOS likely
    got = run(engine, GenerationRequest(raw_prompt=PROMPTS[0], max_new_tokens=50))
    assert got.finish_reason == "eos" and got.token_ids[-1] in engine.eos_ids
    assert all(t not in engine.eos_ids for t in got.token_ids[:-1])
    assert eos is not None


@pytest.mark.parametrize("bad", [dict(budget=-1), dict(max_depth=0), dict(branching=0), dict(expand_per_pass=0)])
def test_bad_speculation_settings_are_refused_where_they_are_made(bad: dict[str, int]) -> None:
    with pytest.raises(InvalidRequest) as info:
        SpeculationSettings(**bad)
    assert "at least 1" in info.value.user_message


@pytest.mark.parametrize("bad", [dict(temperature=-1.0), dict(temperature=float("nan")), dict(top_p=0.0),
                                 dict(top_k=-1), dict(min_p=1.5), dict(repetition_penalty=0.0), dict(seed=2**64)])
def test_bad_sampling_settings_are_refused_where_they_are_made(bad: dict[str, float]) -> None:
    with pytest.raises(InvalidRequest):
        SamplingSettings(**bad)


def test_bad_requests_are_refused_where_they_are_made() -> None:
    with pytest.raises(InvalidRequest, match="at least 1"):
        GenerationRequest(raw_prompt="x", max_new_tokens=0)
    with pytest.raises(InvalidRequest, match="not both"):
        GenerationRequest(raw_prompt="x", messages=(Message("user", "y"),))


def test_empty_prompt_is_refused(close_engine: Engine) -> None:
    with pytest.raises(InvalidRequest):
        list(close_engine.generate(GenerationRequest()))


def test_prompt_longer_than_context_is_refused_and_answer_capped(close_engine: Engine) -> None:
    context = close_engine.context_length

    def n_tokens(reps: int) -> int:
        return len(close_engine.encode(GenerationRequest(raw_prompt="water " * reps)))

    per = (n_tokens(200) - n_tokens(100)) // 100
    with pytest.raises(InvalidRequest) as info:
        close_engine.generate(GenerationRequest(raw_prompt="water " * (context // per + 10)))
    assert "reads at most" in info.value.user_message
    reps = (context - 20 - n_tokens(0 + 1)) // per
    room = context - n_tokens(reps)
    assert 0 < room < 40
    got = run(close_engine, GenerationRequest(raw_prompt="water " * reps, max_new_tokens=500,
                                              speculation=SpeculationSettings(budget=16)))
    assert len(got.token_ids) <= room
