"""Each draft kind's measured passes for a target, kept between processes (engine.decoding.
draft_rates): an engine's answers add to them, the draft choice reads them back as measured
acceptance, and a damaged or foreign file is ignored and replaced."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from engine.decoding.draft_choice import DraftOptions, choose_draft, prior_curve
from engine.decoding.draft_rates import measured_curves, rates_for, read_rates
from engine.decoding.generation import Engine
from engine.decoding.pair import _measured
from engine.loading.load import LoadedModel
from engine.planning import planner
from engine.planning.reference import reference_profile
from engine.types import Completion, GenerationRequest, PassTotals, SpeculationSettings

TARGET: Any = SimpleNamespace(fingerprint="tiny-target@cpu")


def test_answers_add_up_per_kind_and_budget(tmp_path: Path) -> None:
    rates = rates_for(TARGET, "self", root=tmp_path)
    assert rates is not None
    rates.add(64, PassTotals(10, 25, 40, 0.5, 1.0))
    assert measured_curves(TARGET, root=tmp_path) == {}  # one short answer does not count yet
    rates.add(64, PassTotals(10, 35, 40, 0.5, 1.0))
    rates.add(256, PassTotals(4, 16, 20, 0.3, 0.4))
    mtp = rates_for(TARGET, "mtp", root=tmp_path)
    assert mtp is not None
    mtp.add(8, PassTotals(16, 48, 48, 0.1, 1.6))
    curves = measured_curves(TARGET, root=tmp_path)
    assert set(curves) == {"self", "mtp"}
    rows = {m.budget: m for m in curves["self"].measured}
    assert (rows[64].passes, rows[64].tokens_per_pass, rows[64].draft_passes) == (20, 3.0, 4.0)
    assert rows[256].tokens_per_pass == 4.0 and rows[64].draft_seconds == pytest.approx(0.05)
    assert curves["mtp"].depth_cap == prior_curve("mtp").depth_cap == 3  # a head keeps its cap
    assert curves["self"].slope != prior_curve("self", 3).slope  # refitted to what it did
    # another target, and draft-free or an unknown kind, record nothing
    assert measured_curves(SimpleNamespace(fingerprint="other"), root=tmp_path) == {}  # type: ignore[arg-type]
    assert rates_for(TARGET, "none", root=tmp_path) is None
    assert rates_for(SimpleNamespace(fingerprint=""), "self", root=tmp_path) is None  # type: ignore[arg-type]


@pytest.mark.parametrize("content", [
    "{not json",
    json.dumps({"version": 1, "target": "someone else", "kinds": {}}),
    json.dumps({"version": 2, "target": "tiny-target@cpu", "kinds": {}}),
    json.dumps({"version": 1, "target": "tiny-target@cpu", "kinds": {"eagle9": {}}}),
    json.dumps({"version": 1, "target": "tiny-target@cpu", "kinds": {"self": {"64": [1, 2, 3, 4]}}}),
    json.dumps({"version": 1, "target": "tiny-target@cpu", "kinds": {"self": {"64": [1, 2, 3, -4, 5]}}}),
    json.dumps({"version": 1, "target": "tiny-target@cpu", "kinds": {"self": {"64": [1.5, 2, 3, 4, 5]}}}),
    json.dumps({"version": 1, "target": "tiny-target@cpu", "kinds": {"self": {"64": [True, 2, 3, 4, 5]}}}),
    json.dumps({"version": 1, "target": "tiny-target@cpu", "kinds": {"self": {"64": [9, 2, 3, 4, 5]}}}),
    json.dumps({"version": 1, "target": "tiny-target@cpu", "kinds": {"self": {"0": [1, 2, 3, 4, 5]}}}),
    json.dumps({"version": 1, "target": "tiny-target@cpu", "kinds": {"self": {"1e9": [1, 2, 3, 4, 5]}}}),
    json.dumps({"version": 1, "target": "tiny-target@cpu", "kinds": {"self": {str(b): [1, 2, 3, 4, 5]
                                                                               for b in range(1, 70)}}}),
    "[" * 10_000,
])
def test_a_damaged_or_foreign_file_is_ignored_and_replaced(tmp_path: Path, content: str) -> None:
    rates = rates_for(TARGET, "self", root=tmp_path)
    assert rates is not None
    rates.path.parent.mkdir(parents=True, exist_ok=True)
    rates.path.write_text(content)
    assert read_rates(rates.path, TARGET.fingerprint) == {} and measured_curves(TARGET, root=tmp_path) == {}
    rates.add(16, PassTotals(8, 20, 24, 0.2, 0.4))
    assert read_rates(rates.path, TARGET.fingerprint) == {"self": {"16": PassTotals(8, 20, 24, 0.2, 0.4)}}


def test_an_unwritable_folder_never_fails_an_answer(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    rates = rates_for(TARGET, "self", root=blocker / "rates")  # a folder under a file cannot be made
    assert rates is not None
    rates.add(16, PassTotals(8, 20, 24, 0.2, 0.4))
    rates.add(16, PassTotals(8, 20, 24, 0.2, 0.4))
    assert sum("could not save" in r.getMessage() for r in caplog.records) == 1


def test_an_engine_records_its_draft_trees_and_the_choice_reads_them(
        tiny_target: LoadedModel, tiny_close_draft: LoadedModel, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPECCHAT_DATA_DIR", str(tmp_path))
    target = tiny_target.model
    engine = Engine(target, tiny_target.tokenizer, tiny_close_draft.model, rates=rates_for(target, "catalog"))
    done = []
    for budget in (16, 16, 32):
        request = GenerationRequest(raw_prompt="Paris is the capital of", max_new_tokens=24,
                                    speculation=SpeculationSettings(budget=budget, switch_draft=False))
        final = list(engine.generate(request))[-1]
        assert isinstance(final, Completion)
        done.append(final)
    plain = Engine(target, tiny_target.tokenizer, rates=rates_for(target, "catalog"))
    list(plain.generate(GenerationRequest(raw_prompt="Paris", max_new_tokens=8)))  # no draft trees: nothing added
    curves = _measured(target)  # what the draft choice gets, as pair.draft_options passes it
    rows = {m.budget: m for m in curves["catalog"].measured}
    assert set(rows) == {16, 32}
    assert rows[16].passes == done[0].stats.target_passes + done[1].stats.target_passes
    assert rows[16].tokens_per_pass == pytest.approx(
        (len(done[0].token_ids) + len(done[1].token_ids)) / rows[16].passes)
    assert rows[32].draft_passes == pytest.approx(done[2].stats.draft_passes / done[2].stats.target_passes)


def test_a_self_draft_that_measured_poorly_is_passed_over(tmp_path: Path) -> None:
    """The planner's own case (draft_choice's tests): on an RTX 4090 streaming a 4-bit 70B the
    3-bit self-draft wins on SubSpec's prior; once its answers recorded that no drafted token was
    ever accepted, at every budget, the choice reads that back and decodes draft-free instead,
    saying why."""
    from test_draft_choice import LLAMA_70B, self_option, streamed_70b  # noqa: PLC0415

    profile = reference_profile("rtx4090")
    placement = streamed_70b(profile)
    options = DraftOptions(LLAMA_70B, placement, self_draft=self_option(placement, 3))
    assert choose_draft(options, profile).kind == "self"
    rates = rates_for(TARGET, "self", root=tmp_path)
    assert rates is not None
    for budget in planner.DEFAULT_BUDGETS:
        rates.add(budget, PassTotals(40, 40, 40 * 8, 40 * 0.05, 40 * 0.5))
    measured = measured_curves(TARGET, root=tmp_path)
    choice = choose_draft(dataclasses.replace(options, measured=measured), profile)
    assert choice.kind == "none"
    rejected = next(c for c in choice.rejected if c.kind == "self")
    assert "not faster than draft-free" in rejected.reason and "1.0 tokens per pass" in rejected.reason
