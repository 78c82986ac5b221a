"""`specchat bench speculation` end to end on the tiny pair: every row kind, the planner column,
the JSON and PNG files; and the acceptance-by-rank measurement."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from engine.cli.bench import DEFAULT_PROMPTS, measure_rank_acceptance, run_engine_row
from engine.cli.main import main
from engine.decoding.generation import Engine
from engine.planning.measure import measure_hardware
from engine.planning.profile import save_profile


def test_rank_acceptance_of_a_close_draft(close_engine: Engine) -> None:
    outputs: list[list[int]] = []
    run_engine_row(close_engine, DEFAULT_PROMPTS[:2], "autoregressive", 1, 0.0, 12, outputs=outputs)
    accept = measure_rank_acceptance(close_engine, DEFAULT_PROMPTS[:2], outputs, ranks=8)
    assert len(accept) == 8 and 0.0 <= sum(accept) <= 1.0 + 1e-6
    assert accept[0] > 0.5 and accept[0] == max(accept)  # a 5%-noise copy mostly agrees on the top token


def test_bench_speculation_writes_table_json_and_plot(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                                      tiny_target_path: Path, tiny_draft_path: Path) -> None:
    profile = save_profile(measure_hardware(quick=True, models_dir=tmp_path), tmp_path / "profile.json")
    rc = main(["bench", "speculation", "--target", str(tiny_target_path), "--draft", str(tiny_draft_path),
               "--budgets", "4,16", "--temperatures", "0", "--max-new-tokens", "10", "--profile", str(profile),
               "--out", str(tmp_path / "out"), "--threads", "1"])
    assert rc == 0
    out = capsys.readouterr().out
    methods = [line.split()[0] for line in out.splitlines() if line.split() and line.split()[0] in
               ("autoregressive", "context", "specexec", "sequoia", "hf-assisted")]
    assert methods == ["autoregressive", "context", "context", "specexec", "specexec", "sequoia", "sequoia",
                       "hf-assisted"]
    assert "pred tok/s" in out and "acceptance by rank" in out and "planner" in out
    result = json.loads((tmp_path / "out" / "speculation.json").read_text())
    assert {r["method"] for r in result["rows"]} == {"autoregressive", "context", "specexec", "sequoia", "hf-assisted"}
    assert all(r["draft_passes"] == 0 for r in result["rows"] if r["method"] == "context")
    assert all(r["tokens_per_pass"] >= 1.0 for r in result["rows"])
    png = (tmp_path / "out" / "speculation.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"


def test_rounds_add_each_rows_measurements_up(capsys: pytest.CaptureFixture[str], tiny_target_path: Path) -> None:
    common = ["bench", "speculation", "--target", str(tiny_target_path), "--budgets", "4", "--temperatures", "0",
              "--max-new-tokens", "6", "--threads", "1", "--json"]
    totals = {}
    for rounds in (1, 2):
        assert main([*common, "--rounds", str(rounds)]) == 0
        out = capsys.readouterr().out
        assert ("x 2 rounds" in out) == (rounds == 2)
        rows = json.loads(out.splitlines()[-1])["rows"]
        assert [r["method"] for r in rows] == ["autoregressive", "context"]  # one row per kind, rounds added up
        totals[rounds] = [(r["new_tokens"], r["target_passes"] if r["method"] == "autoregressive" else 0) for r in rows]
    assert totals[2] == [(2 * n, 2 * p) for n, p in totals[1]]  # greedy: each round decodes the same tokens


def test_without_matplotlib_the_plot_is_skipped_with_a_note(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    from engine.cli.bench import BenchRow, write_plot

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as in an install without the `bench` extra
    row = BenchRow("specexec", 8, 0.0, 10, 4, 8, 0.1, 0.1, 0.0, 0.3)
    assert write_plot([row], tmp_path / "plot.png") is None
    assert not (tmp_path / "plot.png").exists() and "specchat[bench]" in capsys.readouterr().err


def test_bench_conversation_reuses_each_turns_history(capsys: pytest.CaptureFixture[str],
                                                      tiny_target_path: Path) -> None:
    rc = main(["bench", "conversation", "--target", str(tiny_target_path), "--turns", "3", "--max-new-tokens", "4",
               "--offload", "all", "--device", "cpu", "--json"])
    assert rc == 0
    out = capsys.readouterr().out
    assert "passes to 1st token" in out and "turn 3 / turn 1 TTFT" in out
    rows = json.loads(out.strip().splitlines()[-1])["rows"]
    assert [r["turn"] for r in rows] == [1, 2, 3] and all(r["same_answer"] for r in rows)
    assert rows[0]["reused_tokens"] == 0 and all(r["reused_tokens"] > 0 for r in rows[1:])
    # On a CPU the prefill is cut into ~0.3 s chunks (a Stop waits one chunk at most), so a turn
    # may take several passes; reading only the new text never takes more than reading it all.
    assert all(r["passes_before_first_token"] <= r["passes_before_first_token_fresh"] for r in rows)


def test_bench_speculation_without_a_draft_runs_the_draft_free_rows(capsys: pytest.CaptureFixture[str],
                                                                    tmp_path: Path, tiny_target_path: Path) -> None:
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("# two multi-line prompts\n---\nRepeat: a b c\nd e f\n---\nSay hi.\n", encoding="utf-8")
    rc = main(["bench", "speculation", "--target", str(tiny_target_path), "--prompts", str(prompts), "--budgets", "8",
               "--temperatures", "0", "--max-new-tokens", "6", "--json", "--threads", "1"])
    assert rc == 0
    out = capsys.readouterr().out
    assert "2 chat prompts" in out and "draft (none)" in out
    rows = json.loads(out.strip().splitlines()[-1])["rows"]
    assert [r["method"] for r in rows] == ["autoregressive", "context"] and rows[1]["draft_passes"] == 0
    assert main(["bench", "speculation", "--target", str(tiny_target_path), "--methods", "nope"]) == 2
