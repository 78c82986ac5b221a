"""Pass costs and acceptance kept between processes (engine.decoding.learned): a fresh engine of
the same pair starts where the last one ended, prices its first trees from the saved costs,
decodes the same text; a file that is not a valid state for this pair is ignored, and a data
folder that cannot be written never fails an answer."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from engine.decoding.acceptance import RESTORED_SEEN, AcceptanceModels, Calibrator
from engine.decoding.costs import PassCosts
from engine.decoding.generation import Engine
from engine.decoding.learned import KEEP, LearnedFile, learned_file
from engine.kernels import build
from engine.loading.load import LoadedModel
from engine.types import Completion, GenerationRequest, SamplingSettings, SpeculationSettings

PROMPT = "one two three four five one two three four five one two three"


def answer(engine: Engine, n: int = 24, temperature: float = 0.0) -> Completion:
    req = GenerationRequest(raw_prompt=PROMPT, max_new_tokens=n,
                            sampling=SamplingSettings(temperature=temperature, seed=1),
                            speculation=SpeculationSettings(mode="specexec", budget=16, max_depth=6))
    final = list(engine.generate(req))[-1]
    assert isinstance(final, Completion)
    return final


@pytest.fixture
def learned(tmp_path: Path, tiny_target: LoadedModel) -> LearnedFile:
    found = learned_file(tiny_target.model, None, root=tmp_path)
    assert found is not None
    return found


def test_a_fresh_engine_starts_where_the_last_one_ended(tiny_target: LoadedModel, learned: LearnedFile) -> None:
    first = Engine(tiny_target.model, tiny_target.tokenizer, learned=learned)
    text = answer(first).token_ids
    answer(first, temperature=0.7)  # a second regime
    assert learned.path.is_file()
    second = Engine(tiny_target.model, tiny_target.tokenizer, learned=learned)
    assert second.costs.state() == first.costs.state()
    taken_back = AcceptanceModels()  # the saved rates, each bin weighing at most RESTORED_SEEN labels
    taken_back.restore(first.acceptance.state())
    assert json.dumps(second.acceptance.state()) == json.dumps(taken_back.state())
    # the first trees are priced from the saved costs, not the optimistic prior
    assert second.costs.target(17) == first.costs.target(17) != PassCosts().target(17)
    # and the text is the same: what is learned sizes trees, it never changes tokens
    plain = Engine(tiny_target.model, tiny_target.tokenizer)
    assert answer(second).token_ids == text == answer(plain).token_ids


def test_a_taken_back_table_keeps_its_rates_but_yields_to_new_labels() -> None:
    """A saved table weighs as at most RESTORED_SEEN labels a bin in the next process: answers of
    another kind (open chat after edits that copied their prompt) overturn it within an answer."""
    table = Calibrator([0.5, 0.5, 0.5])
    table.restore({"hits": [900.0, 10.0, 0.0], "seen": [1000.0, 12.0, 0.0]})
    assert table.seen == [RESTORED_SEEN, 12.0, 0.0] and table.hits[1] == 10.0
    assert abs(float(table.hits[0]) - 0.9 * RESTORED_SEEN) < 1e-9 and table.table()[0] > 0.8
    for _ in range(2 * int(RESTORED_SEEN)):  # (the whole 1000 labels kept: still 0.87 after these)
        table.observe(torch.tensor([0]), torch.tensor([False]))
    assert table.table()[0] < 0.5


def test_another_pair_or_thread_count_has_its_own_file(tiny_target: LoadedModel, tiny_close_draft: LoadedModel,
                                                       tmp_path: Path) -> None:
    alone = learned_file(tiny_target.model, None, root=tmp_path)
    paired = learned_file(tiny_target.model, tiny_close_draft.model, root=tmp_path)
    assert alone is not None and paired is not None and alone.path != paired.path
    import torch

    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(threads + 1)
        other = learned_file(tiny_target.model, None, root=tmp_path)
    finally:
        torch.set_num_threads(threads)
    assert other is not None and other.path != alone.path


def test_another_kernel_build_has_its_own_file(tiny_target: LoadedModel, tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """Costs measured with one build of the CPU kernels (an older source, other flags) are not
    the next one's: a faster step under old costs prices trees wrongly."""
    before = learned_file(tiny_target.model, None, root=tmp_path)
    monkeypatch.setattr(build, "identity", lambda: "another-build")
    after = learned_file(tiny_target.model, None, root=tmp_path)
    assert before is not None and after is not None and after.path != before.path


def test_the_kernel_identity_names_the_loaded_build() -> None:
    lib = build.kernels()
    if lib is None:
        pytest.skip("no C compiler here")
    assert build.identity() == Path(lib._name).parent.name and len(build.identity()) == 20


def valid_state(learned: LearnedFile) -> dict:
    costs, acceptance = PassCosts(), AcceptanceModels()
    costs.observe_target(1, 0.05)
    costs.observe_target(9, 0.08)
    acceptance[SamplingSettings()]  # the greedy model, at its priors
    learned.save(costs, acceptance)
    return json.loads(learned.path.read_text())


def broken(state: dict) -> list[object]:
    greedy = state["acceptance"]["greedy"]
    cases: list[object] = [None, [], "text", {}, {**state, "version": 99}, {**state, "key": "another pair"},
                           {**state, "costs": {**state["costs"], "t1": -1.0}},
                           {**state, "costs": {k: v for k, v in state["costs"].items() if k != "b4w"}},
                           {**state, "costs": {**state["costs"], "b4w": True}},
                           {**state, "acceptance": {"greedy": {**greedy, "tau_ll": greedy["tau_ll"][:-1]}}},
                           {**state, "acceptance": {"nonsense": greedy}},
                           {**state, "acceptance": {"greedy": {**greedy, "backed": {"hits": [2.0] * 11,
                                                                                     "seen": [1.0] * 11}}}},
                           {**state, "acceptance": {"greedy": {**greedy, "context": {"hits": [0.0], "seen": [0.0]}}}},
                           {**state, "acceptance": {"greedy": {**greedy, "shared": {"hits": [0.0], "seen": [0.0]}}}}]
    return cases


def test_a_state_that_is_not_valid_for_this_pair_is_ignored(learned: LearnedFile) -> None:
    state = valid_state(learned)
    fresh = PassCosts().state()
    for case in broken(state):
        learned.path.write_text(json.dumps(case))
        costs, acceptance = PassCosts(), AcceptanceModels()
        assert not learned.restore(costs, acceptance), str(case)[:80]
        assert costs.state() == fresh and acceptance.state() == {}
    deep = b"[" * 100_000 + b"]" * 100_000
    for raw in (b"\xff\xfe not json", b"{" * 100, b" " * (300 * 1024), deep):  # not UTF-8, cut short, too large, deep
        learned.path.write_bytes(raw)
        assert not learned.restore(PassCosts(), AcceptanceModels())
    learned.path.write_text(json.dumps(state))
    costs = PassCosts()
    assert learned.restore(costs, AcceptanceModels()) and costs.state() == state["costs"]


def test_non_finite_numbers_are_refused(learned: LearnedFile) -> None:
    state = valid_state(learned)
    text = json.dumps(state).replace(json.dumps(state["costs"]["t1"]), "NaN", 1)
    learned.path.write_text(text)
    assert not learned.restore(PassCosts(), AcceptanceModels())


@pytest.mark.skipif(os.name != "posix" or os.geteuid() == 0, reason="root writes anywhere")
def test_a_folder_that_cannot_be_written_never_fails_an_answer(tiny_target: LoadedModel, tmp_path: Path) -> None:
    folder = tmp_path / "ro"
    folder.mkdir()
    folder.chmod(0o500)
    try:
        found = learned_file(tiny_target.model, None, root=folder / "learned")
        engine = Engine(tiny_target.model, tiny_target.tokenizer, learned=found)
        assert answer(engine, n=4).token_ids
        assert found is not None and not found.path.exists()
    finally:
        folder.chmod(0o700)


def test_a_file_in_the_way_of_the_folder_never_fails_an_answer(tiny_target: LoadedModel, tmp_path: Path) -> None:
    (tmp_path / "learned").write_text("a file, not a folder")
    found = learned_file(tiny_target.model, None, root=tmp_path / "learned")
    engine = Engine(tiny_target.model, tiny_target.tokenizer, learned=found)
    assert answer(engine, n=4).token_ids


def test_only_the_newest_files_are_kept(tmp_path: Path) -> None:
    for i in range(KEEP + 5):
        f = LearnedFile(tmp_path / f"{i:03d}.json", f"key{i}")
        f.save(PassCosts(), AcceptanceModels())
        os.utime(f.path, (1000 + i, 1000 + i))
    LearnedFile(tmp_path / "new.json", "new").save(PassCosts(), AcceptanceModels())
    kept = sorted(p.name for p in tmp_path.glob("*.json"))
    assert len(kept) == KEEP and "new.json" in kept and "000.json" not in kept


def test_an_moe_targets_routing_rows_are_checked(learned: LearnedFile) -> None:
    """The experts an MoE's passes woke (engine.kernels.expert_unions.union_totals), per power of two
    of tokens: rows that no pass of their size gives make the whole file ignored."""
    state = valid_state(learned)
    learned.path.write_text(json.dumps({**state, "routing": [[3, 2, 9, 10], [7, 1, 100, 40]]}))
    assert learned.restore(PassCosts(), AcceptanceModels()) and learned.routing == {3: (2, 9, 10), 7: (1, 100, 40)}
    for rows in ([[3, 2, 20, 10]], [[1, 1, 1, 1]], [[3, 0, 0, 0]], [[3, 2, 9]], [[3, 2, 9, -1]], [[3, 2, 9, 0]],
                 [[3, 2, 9, 10], [3, 2, 9, 10]], "x", [[3, 2.5, 9, 10]], [[3, True, 9, 10]], [[99, 1, 2, 1]]):
        learned.path.write_text(json.dumps({**state, "routing": rows}))
        assert not learned.restore(PassCosts(), AcceptanceModels()), rows
