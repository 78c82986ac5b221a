"""load_engine with draft "auto" on real tiny checkpoints: a target whose checkpoint carries an MTP
head drafts with it (no hardware profile: the fallback takes the first candidate that can run,
and says so), decoding the target's own greedy text; a target without one on the CPU runs
draft-free, its self-draft refused for costing as much as the target."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.decoding.generation import Engine
from engine.decoding.pair import draft_choice_of, load_engine
from engine.types import CacheSettings, Completion, GenerationRequest, LoadSettings, SpeculationSettings

heads = pytest.importorskip("engine.model.heads")
CPU = LoadSettings(device="cpu", offload="none", cache=CacheSettings(disk_budget_bytes=0))
PROMPT = "Speculative decoding lets a small draft model propose tokens that a large target model verifies."


def greedy(engine: Engine) -> list[int]:
    request = GenerationRequest(raw_prompt=PROMPT, max_new_tokens=12, speculation=SpeculationSettings(budget=16))
    final = list(engine.generate(request))[-1]
    assert isinstance(final, Completion)
    return list(final.token_ids)


def test_auto_drafts_with_the_checkpoints_mtp_head(model_cache: Path) -> None:
    from head_checkpoints import tiny_with_head

    folder = tiny_with_head("qwen3_5_text", model_cache)
    engine = load_engine(folder, "auto", CPU)
    choice = draft_choice_of(engine)
    assert choice is not None and choice.kind == "mtp", choice
    assert engine.draft is not None
    assert "no hardware profile" in choice.reason
    assert {c.kind for c in choice.rejected} == {"self", "catalog"}
    plain = load_engine(folder, "none", CPU)
    assert draft_choice_of(plain).kind == "none"  # type: ignore[union-attr]
    assert greedy(engine) == greedy(plain)


def test_mtp_by_hand_loads_the_checkpoints_head_and_the_menu_lists_it(model_cache: Path, tmp_path: Path,
                                                                       tiny_target_path: Path) -> None:
    from eagle_checkpoints import write_eagle
    from head_checkpoints import tiny_with_head

    from engine.decoding.draft_menu import head_entries
    from engine.errors import UsageError

    folder = tiny_with_head("qwen3_5_text", model_cache)
    engine = load_engine(folder, "mtp", CPU)
    choice = draft_choice_of(engine)
    assert choice is not None and choice.kind == "mtp" and "by hand" in choice.reason
    assert engine.draft is not None and "MTP" in choice.label
    assert [(e.spec, e.problem) for e in head_entries(folder)] == [("mtp", "")]
    # a model without one: refused with what to do, before any draft loads
    with pytest.raises(UsageError, match="no MTP or NextN draft layers"):
        load_engine(tiny_target_path, "mtp", CPU)
    # an EAGLE-3 head beside a model is listed by its folder (what load_engine takes); a head
    # trained for another model is listed with why it cannot draft
    home = tmp_path / "models"
    target = home / "tiny"
    target.mkdir(parents=True)
    for f in tiny_target_path.iterdir():
        (target / f.name).symlink_to(f)
    write_eagle(home / "tiny-eagle3", target, aux=[0, 1, 1])
    write_eagle(home / "wide-eagle3", target, aux=[0, 1, 1], config_edit={"target_hidden_size": 4096})
    entries = {Path(e.spec).name: e for e in head_entries(target)}
    assert set(entries) == {"tiny-eagle3", "wide-eagle3"}
    assert entries["tiny-eagle3"].problem == "" and "EAGLE-3" in entries["tiny-eagle3"].label
    assert "4096 wide" in entries["wide-eagle3"].problem
    assert head_entries(tmp_path / "missing") == [] and head_entries(home) == []  # not a model: nothing listed


def test_auto_on_a_cpu_without_a_head_runs_draft_free(tiny_target_path: Path) -> None:
    engine = load_engine(tiny_target_path, "auto", CPU)
    choice = draft_choice_of(engine)
    assert choice is not None and choice.kind == "none" and engine.draft is None
    self_draft = next(c for c in choice.rejected if c.kind == "self")
    assert "as costly as the target" in self_draft.reason or "target itself" in self_draft.reason
