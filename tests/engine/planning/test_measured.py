"""Measured speeds: recorded from real GenerationStats into a real file, read back by model,
format, draft and device; damaged, hostile and special files read as empty, never crash."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import pytest

from engine.planning.measured import (
    MIN_TOKENS,
    RECENT_ANSWERS,
    SpeedKey,
    measured_path,
    measured_speed,
    record_answer,
    run_format,
    speed_key,
)
from engine.shapes import Placement
from engine.types import GenerationStats


def stats(tokens: int, seconds: float, prefill: float = 0.0, mode: str = "context") -> GenerationStats:
    return GenerationStats(prompt_tokens=20, new_tokens=tokens, target_passes=tokens, tokens_per_pass=1.0,
                           draft_passes=0, budget=64, seconds=seconds, ttft_seconds=prefill + 0.1,
                           tokens_per_second=tokens / seconds, peak_rss_bytes=0, prefill_seconds=prefill,
                           mode=mode)  # type: ignore[arg-type]


@pytest.fixture
def model(tmp_path: Path) -> Path:
    folder = tmp_path / "models" / "SmolLM2-135M-Instruct"
    folder.mkdir(parents=True)
    return folder


def test_answers_add_up_to_the_writing_speed_per_model_format_and_device(tmp_path: Path, model: Path) -> None:
    file = tmp_path / "measured.json"
    cpu = Placement(30, 30, quant="none", device="cpu")
    key = speed_key(model, None, cpu)
    assert key == SpeedKey(str(model.resolve()), "FP32", "", "cpu")
    assert measured_speed(model, None, path=file) is None
    for _ in range(10):  # 29 tokens in 10 s, of which 0.5 s read the prompt: 3.05 tok/s writing
        record_answer(key, stats(29, 10.0, prefill=0.5), file)
    got = measured_speed(model, None, "cpu", path=file)
    assert got is not None and got.answers == got.total_answers == 10
    assert got.tokens_per_second == pytest.approx(29 / 9.5)
    assert got.describe() == "measured here: 3.1 tok/s over 10 answers"
    assert got.last_mode == "context"
    # another format, draft or device is another figure; the path may be named another way
    assert measured_speed(model, None, "cuda:0", path=file) is None
    assert measured_speed(model, model, path=file) is None
    assert measured_speed(model, None, fmt="GGUF Q4_1", path=file) is None
    assert measured_speed(model / ".." / model.name, None, path=file) == got


def test_only_recent_answers_count_and_short_ones_are_skipped(tmp_path: Path, model: Path) -> None:
    file = tmp_path / "measured.json"
    key = speed_key(model, None, None)
    assert record_answer(key, stats(MIN_TOKENS - 1, 1.0), file) is None  # mostly fixed costs
    assert not file.exists()
    for _ in range(RECENT_ANSWERS):
        record_answer(key, stats(10, 10.0), file)  # 1 tok/s, then the machine got faster
    for _ in range(RECENT_ANSWERS):
        record_answer(key, stats(40, 10.0), file)
    got = measured_speed(model, None, path=file)
    assert got is not None and got.tokens_per_second == pytest.approx(4.0)
    assert got.answers == RECENT_ANSWERS and got.total_answers == 2 * RECENT_ANSWERS
    assert "over the last 20 answers" in got.describe()


def test_the_newest_format_wins_when_none_is_asked_for(tmp_path: Path, model: Path) -> None:
    file = tmp_path / "measured.json"
    record_answer(SpeedKey(str(model.resolve()), "GGUF Q4_1", "", "cpu"), stats(20, 10.0), file)
    record_answer(SpeedKey(str(model.resolve()), "FP32", "", "cpu"), stats(50, 10.0), file)
    newest = measured_speed(model, None, path=file)
    assert newest is not None and newest.key.fmt == "FP32"
    older = measured_speed(model, None, fmt="GGUF Q4_1", path=file)
    assert older is not None and older.tokens_per_second == pytest.approx(2.0)


def test_the_file_is_in_the_data_folder_and_written_whole(tmp_path: Path, model: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPECCHAT_DATA_DIR", str(tmp_path / "data"))
    assert measured_path() == tmp_path / "data" / "measured_speeds.json"
    key = speed_key(model, None, None)
    threads = [threading.Thread(target=record_answer, args=(key, stats(10, 5.0))) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    data = json.loads(measured_path().read_text())  # never half a file, whatever interleaved
    assert data["version"] == 1 and len(data["entries"]) == 1
    assert not [p for p in measured_path().parent.iterdir() if p.suffix == ".tmp"]


@pytest.mark.parametrize("content", [
    b"{not json", b"[]", b'{"version": 1, "entries": 5}', b'{"version": 2, "entries": []}',
    b"[" * 100_000 + b"]" * 100_000,  # nested deeper than any reader should recurse
    b'{"version": 1, "entries": [{"target": "x", "fmt": "FP32", "draft": "", "device": "cpu", '
    b'"last_mode": "context", "answers": 1, "updated": 0, "recent": [[10, -1]]}]}',  # a negative time
    b'{"version": 1, "entries": [{"target": "x", "recent": [[1' + b"0" * 5000 + b', 1]]}]}',  # a huge number
])
def test_a_damaged_file_reads_as_nothing_measured_and_is_replaced(tmp_path: Path, model: Path, content: bytes) -> None:
    file = tmp_path / "measured.json"
    file.write_bytes(content)
    assert measured_speed(model, None, path=file) is None
    assert measured_speed("x", None, path=file) is None
    record_answer(speed_key(model, None, None), stats(10, 5.0), file)
    assert measured_speed(model, None, path=file) is not None


def test_a_fifo_or_a_folder_in_its_place_never_hangs(tmp_path: Path, model: Path) -> None:
    fifo = tmp_path / "fifo.json"
    os.mkfifo(fifo)
    assert measured_speed(model, None, path=fifo) is None  # no writer: a blocking open would hang here
    folder = tmp_path / "folder.json"
    folder.mkdir()
    assert measured_speed(model, None, path=folder) is None


def test_run_format_names_what_runs(tmp_path: Path) -> None:
    from engine.testing.synthetic import tiny_gguf

    gguf = tiny_gguf("llama", layers=1, layer_types=("Q8_0",), cache_dir=tmp_path)
    assert run_format(gguf, Placement(1, 1, quant="gguf", device="cpu")) == "GGUF Q8_0"
    assert run_format(tmp_path, Placement(2, 2, quant="none", device="cpu")) == "FP32"
    assert run_format(tmp_path, Placement(2, 2, quant="none", device="cuda:0")) == "BF16"
    assert run_format(tmp_path, Placement(2, 0, 2, quant="nf4", device="cuda:0")) == "NF4"
    assert speed_key(gguf, None, Placement(1, 1, quant="gguf", device="cuda:0")).device == "cuda"
