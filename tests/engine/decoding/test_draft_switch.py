"""The engine turns a draft off for a conversation while its trees decode slower than decoding
without them, and measures it again later (engine.decoding.costs.DraftSwitch). Real tiny
models; a slow model is the real one with a sleep in its forward pass, so the clock the switch
reads is the real one."""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable

import pytest
import torch

from engine.decoding import costs
from engine.decoding.generation import Engine
from engine.loading.load import LoadedModel
from engine.model.causal_lm import CausalLM
from engine.types import Completion, GenerationRequest, SpeculationSettings

PROMPT = "Once upon a time there was"
SLEEP_S = 0.03


QUICK = costs.SwitchSettings(evidence_s=0.1, evidence_steps=2)  # verdicts after a few tiny steps


def slowed(monkeypatch: pytest.MonkeyPatch, model: CausalLM) -> None:
    forward: Callable[..., torch.Tensor] = model.forward

    def slow(*args: object, **kwargs: object) -> torch.Tensor:
        time.sleep(SLEEP_S)
        return forward(*args, **kwargs)

    monkeypatch.setattr(model, "forward", slow)


def generate(engine: Engine, switch: bool, tokens: int = 40, conversation: str | None = "c",
             share: bool = True) -> Completion:
    request = GenerationRequest(raw_prompt=PROMPT, max_new_tokens=tokens, conversation=conversation,
                                speculation=SpeculationSettings(budget=16, max_depth=6, switch_draft=switch,
                                                                share_context=share))
    final = list(engine.generate(request))[-1]
    assert isinstance(final, Completion)
    return final


def test_a_slow_draft_goes_off_and_the_text_stays_the_same(tiny_target: LoadedModel, tiny_close_draft: LoadedModel,
                                                          monkeypatch: pytest.MonkeyPatch,
                                                          caplog: pytest.LogCaptureFixture) -> None:
    reference = generate(Engine(tiny_target.model, tiny_target.tokenizer, tiny_close_draft.model), switch=False)
    engine = Engine(tiny_target.model, tiny_target.tokenizer, tiny_close_draft.model, switch=QUICK)
    slowed(monkeypatch, tiny_close_draft.model)
    with caplog.at_level(logging.INFO, logger="engine.decoding.generation"):
        got = generate(engine, switch=True)
    assert got.token_ids == reference.token_ids  # greedy: the switch changes speed, never text
    assert got.stats.mode == "context"
    assert 0 < got.stats.draft_passes < reference.stats.draft_passes / 2
    assert "the draft is off for this conversation" in caplog.text
    # the verdict is the conversation's: its next turn starts without the draft, another one with it
    assert generate(engine, switch=True, tokens=8).stats.draft_passes == 0
    assert generate(engine, switch=True, tokens=8, conversation="other").stats.draft_passes > 0


def test_a_draft_that_pays_stays_on(tiny_target: LoadedModel, tiny_close_draft: LoadedModel,
                                    monkeypatch: pytest.MonkeyPatch) -> None:
    engine = Engine(tiny_target.model, tiny_target.tokenizer, tiny_close_draft.model, switch=QUICK)
    slowed(monkeypatch, tiny_target.model)  # an offloaded target: every pass costs the same long time
    got = generate(engine, switch=True)
    assert got.stats.mode == "specexec"
    assert got.stats.tokens_per_pass > 2  # the close draft's trees: several tokens per slow pass


@pytest.mark.parametrize("share", [True, False], ids=["shared-context", "own-cache"])
def test_an_off_draft_is_measured_again_after_a_while(tiny_target: LoadedModel, tiny_close_draft: LoadedModel,
                                                      monkeypatch: pytest.MonkeyPatch,
                                                      caplog: pytest.LogCaptureFixture, share: bool) -> None:
    retry = dataclasses.replace(QUICK, retry_tokens=8, retry_factor=0.0)  # no time backoff: test_the_switch_judges...
    reference = generate(Engine(tiny_target.model, tiny_target.tokenizer, tiny_close_draft.model), switch=False,
                         tokens=60)
    engine = Engine(tiny_target.model, tiny_target.tokenizer, tiny_close_draft.model, switch=retry)
    slowed(monkeypatch, tiny_close_draft.model)
    with caplog.at_level(logging.INFO, logger="engine.decoding.generation"):
        got = generate(engine, switch=True, tokens=60, share=share)
    assert got.token_ids == reference.token_ids
    # the draft's cache caught up on every return: copied from the target's, or read by the draft
    [prefix] = engine.prefixes._parked
    assert prefix.draft is not None and prefix.draft.length > len(prefix.tokens) - 16  # off for <= 8 + one step
    view = tiny_target if share else tiny_close_draft
    n = prefix.draft.length
    with torch.inference_mode():
        kv = view.model.hf_model(torch.tensor([prefix.tokens[:n]]), use_cache=True).past_key_values
    for layer, ref in enumerate(kv.layers):
        assert torch.allclose(prefix.draft.keys[layer][:, :, :n], ref.keys, atol=1e-4)
    assert caplog.text.count("the draft is off for this conversation") >= 2  # off, tried again, off again


def test_the_bench_row_switched_decodes_as_the_app_does(tiny_target: LoadedModel, tiny_close_draft: LoadedModel,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    from engine.cli.bench import run_engine_row

    engine = Engine(tiny_target.model, tiny_target.tokenizer, tiny_close_draft.model, switch=QUICK)
    slowed(monkeypatch, tiny_close_draft.model)
    prompts = ["Paris is the capital of", "def add(a, b):"]
    trees = run_engine_row(engine, prompts, "specexec", 16, 0.0, 24, max_depth=6)
    switched = run_engine_row(engine, prompts, "switched", 16, 0.0, 24, max_depth=6)
    assert switched.new_tokens == trees.new_tokens
    assert switched.draft_passes < trees.draft_passes / 2  # off after the first few steps, for both prompts


def test_the_switch_judges_a_far_slower_draft_at_once_and_backs_off_in_time() -> None:
    """On the switch alone, with measured seconds given (a fake clock): a draft far behind goes
    off after one step and is measured again only after retry_tokens tokens and ten times
    the seconds its measurement cost; one only a little behind gets the full evidence first."""
    switch = costs.DraftSwitch(QUICK)
    switch.observe(False, 10, 1.0)  # 10 tokens/s without the draft
    assert switch.decide(costs.PassCosts())
    switch.observe(True, 8, 4.0)  # 2 tokens/s: far behind
    assert not switch.decide(costs.PassCosts())
    switch.observe(False, 300, 30.0)  # enough tokens, not yet 10 x 4 s
    assert not switch.decide(costs.PassCosts())
    switch.observe(False, 10, 11.0)
    assert switch.decide(costs.PassCosts()) and switch.on

    close = costs.DraftSwitch(QUICK)
    close.observe(False, 10, 1.0)
    for _ in range(QUICK.evidence_steps - 1):
        close.observe(True, 9, 1.0)  # 9 tokens/s: a little behind
        assert close.decide(costs.PassCosts())
    close.observe(True, 9, 1.0)
    assert not close.decide(costs.PassCosts())
