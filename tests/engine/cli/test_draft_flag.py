"""`--draft auto|none|self[:BITS]|MODEL` (issue 32): without --draft the engine picks the draft
itself and the stats line and --json name it; self:BITS is checked before any model loads; a
self-draft of the tiny target, every layer offloaded, decodes the same greedy text as the
target alone."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from engine.cli.main import main
from engine.decoding.pair import parse_draft_spec
from engine.errors import InvalidRequest
from engine.planning.profile import LAYER_SHAPES, LayerTiming, save_profile
from engine.planning.reference import reference_profile


def cli(capsys: pytest.CaptureFixture[str], *args: object) -> tuple[int, str, str]:
    rc = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return rc, out, err


def generate(capsys: pytest.CaptureFixture[str], target: Path, *extra: object) -> tuple[int, dict, str]:
    rc, out, err = cli(capsys, "generate", "--target", target, "--raw-prompt", "The quick brown",
                       "--max-new-tokens", 12, "--temperature", 0, "--json", *extra)
    return rc, json.loads(out.splitlines()[0]) if rc == 0 else {}, err


def test_parse_draft_spec() -> None:
    assert parse_draft_spec(None) == ("none", None, None)
    assert parse_draft_spec("none") == ("none", None, None)
    assert parse_draft_spec("auto") == ("auto", None, None)
    assert parse_draft_spec("self") == ("self", None, None)
    assert parse_draft_spec("self:3") == ("self", 3, None)
    assert parse_draft_spec("mtp") == ("mtp", None, None)
    assert parse_draft_spec("some/folder") == ("model", None, "some/folder")
    with pytest.raises(InvalidRequest, match="2, 3 or 4 bits"):
        parse_draft_spec("self:8")


@pytest.mark.parametrize("bad", ["self:5", "self:", "self:four"])
def test_self_bits_are_refused_before_a_model_loads(capsys: pytest.CaptureFixture[str], bad: str) -> None:
    rc, _, err = cli(capsys, "generate", "--target", "/nonexistent/model", "--raw-prompt", "x", "--draft", bad)
    assert rc == 2
    assert "2, 3 or 4 bits" in err and "/nonexistent" not in err  # refused before the target is looked at


def test_without_draft_the_engine_picks_and_names_it(capsys: pytest.CaptureFixture[str], tiny_target_path: Path,
                                                       tiny_draft_path: Path) -> None:
    rc, line, _ = generate(capsys, tiny_target_path)
    assert rc == 0
    assert line["draft"]["kind"] == "none" and line["draft"]["label"] == "none (draft-free)"
    # on this CPU no draft can run (no head, no catalog draft; a self-draft would cost the target's own)
    assert "no hardware profile" in line["draft"]["reason"] or "draft-free" in line["draft"]["reason"]
    rc, out, err = cli(capsys, "generate", "--target", tiny_target_path, "--raw-prompt", "The quick brown",
                       "--max-new-tokens", 6, "--temperature", 0)
    assert rc == 0
    [stats] = [x for x in err.splitlines() if "tokens/pass" in x]
    assert "draft-free" in stats and "draft: " not in stats  # no draft ran: the mode says so
    rc, named, _ = generate(capsys, tiny_target_path, "--draft", tiny_draft_path)
    assert rc == 0 and named["draft"] == {"kind": "catalog", "label": tiny_draft_path.name,
                                          "reason": "chosen by hand (a draft model)"}
    assert named["token_ids"] == line["token_ids"]  # greedy: the same text with or without a draft


def test_auto_with_a_cpu_profile_says_the_self_draft_costs_as_much_as_the_target(
        capsys: pytest.CaptureFixture[str], tiny_target_path: Path, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """With a profile measured on a CPU the candidates are priced; the self-draft of a target on
    the CPU is refused, with that as its reason, and draft-free runs."""
    shape = LAYER_SHAPES["llama-70b"]
    timing = LayerTiming(shape, "cpu", "float32", shape.params * 4, ((1, 0.30), (16, 0.40), (128, 1.38)), 0.0004)
    monkeypatch.setenv("SPECCHAT_DATA_DIR", str(tmp_path))
    save_profile(dataclasses.replace(reference_profile("rtx4090"), gpus=(), layer_timing=timing))
    rc, line, _ = generate(capsys, tiny_target_path, "--offload", "all")
    assert rc == 0
    assert line["draft"]["kind"] == "none"
    assert "no hardware profile" not in line["draft"]["reason"]
    assert "predicted faster" in line["draft"]["reason"]


def test_self_draft_by_hand_decodes_the_targets_greedy_text(capsys: pytest.CaptureFixture[str],
                                                             tiny_target_path: Path) -> None:
    pytest.importorskip("engine.loading.self_draft")
    rc, plain, _ = generate(capsys, tiny_target_path, "--draft", "none")
    assert rc == 0 and plain["draft"]["kind"] == "none"
    rc, line, err = generate(capsys, tiny_target_path, "--draft", "self:4", "--offload", "all")
    assert rc == 0, err
    assert line["draft"]["kind"] == "self"
    assert line["draft"]["label"].startswith("self-draft, 4-bit (")
    assert line["token_ids"] == plain["token_ids"]  # verified by the target: lossless
    rc, _, err = cli(capsys, "generate", "--target", tiny_target_path, "--raw-prompt", "The quick brown",
                     "--max-new-tokens", 6, "--temperature", 0, "--draft", "self:4", "--offload", "all")
    [stats] = [x for x in err.splitlines() if "tokens/pass" in x]
    assert f"draft: {line['draft']['label']}" in stats


def test_self_draft_with_nothing_offloaded_is_refused_with_what_to_do(capsys: pytest.CaptureFixture[str],
                                                                      tiny_target_path: Path) -> None:
    pytest.importorskip("engine.loading.self_draft")
    rc, _, err = cli(capsys, "generate", "--target", tiny_target_path, "--raw-prompt", "x", "--draft", "self:3",
                     "--offload", "none")
    assert rc in (1, 2)
    assert "offload" in err and "draft none" in err


def test_bench_drafts_prints_a_labelled_projection(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = cli(capsys, "bench", "drafts", "--target", "qwen3.6-27b", "--gpu", "rtx3060-12gb", "--versus", "4.4")
    assert rc == 0
    assert out.startswith("PROJECTION (planner, priors; not measured)")
    assert "* MTP head (1 layer)" in out and "llama.cpp's MTP prior" in out  # Qwen3.6 checkpoints carry MTP
    assert "versus 4.4 tok/s measured elsewhere" in out and "self-draft what-if" in out
    rc, out, _ = cli(capsys, "bench", "drafts", "--target", "llama-3.3-70b-instruct-bnb-4bit", "--gpu", "rtx4090",
                     "--json")
    assert rc == 0
    data = json.loads(out)
    assert data["projection"] is True and data["candidates"][0]["chosen"]
    kinds = {c["kind"]: c for c in data["candidates"]}
    assert set(kinds) == {"self", "catalog", "none"}  # no head in a Llama checkpoint
    assert [w["bits"] for w in data["self_draft_what_if"]] == [4, 3, 2]
