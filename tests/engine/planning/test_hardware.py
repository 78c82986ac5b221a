"""The hardware profile: a quick real measurement (tiny layer, small buffers), JSON round trip,
versioning, cancel, progress, warnings, and the `bench hardware` / `bench plan` commands."""

from __future__ import annotations

import dataclasses
import json
import threading
from pathlib import Path

import pytest

from engine.cli.main import main
from engine.errors import Cancelled
from engine.planning.measure import measure_hardware
from engine.planning.profile import (
    PROFILE_VERSION,
    HardwareProfile,
    load_profile,
    profile_path,
    profile_warnings,
    save_profile,
)
from engine.planning.reference import reference_profile


@pytest.fixture(scope="module")
def quick_profile(tmp_path_factory: pytest.TempPathFactory) -> HardwareProfile:
    return measure_hardware(quick=True, models_dir=tmp_path_factory.mktemp("models"))


def test_quick_profile_has_figures(quick_profile: HardwareProfile) -> None:
    p = quick_profile
    assert p.version == PROFILE_VERSION and p.quick
    assert p.cpu_cores >= 1 and p.cpu_threads >= p.cpu_cores and p.cpu_model
    assert p.ram_total >= p.ram_available > 0
    assert p.ram_copy_gbps > 0 and p.disk_read_gbps > 0
    lt = p.layer_timing
    assert lt.shape.name == "tiny" and [n for n, _ in lt.points] == [1, 4, 16, 64]
    assert all(s > 0 for _, s in lt.points) and lt.overhead_s > 0
    assert lt.seconds(2048) >= lt.seconds(64)  # extrapolated past the last measured point, never down
    lines = p.summary_lines()
    assert any(line.startswith("CPU:") for line in lines) and any("layer" in line for line in lines)


def test_json_round_trip_and_versioning(quick_profile: HardwareProfile, tmp_path: Path) -> None:
    path = save_profile(quick_profile, tmp_path / "profile.json")
    assert load_profile(path) == quick_profile
    assert HardwareProfile.from_json(json.loads(json.dumps(quick_profile.to_json()))) == quick_profile
    raw = json.loads(path.read_text())
    raw["version"] = PROFILE_VERSION - 1
    path.write_text(json.dumps(raw))
    assert load_profile(path) is None  # old version: measure again
    assert load_profile(tmp_path / "missing.json") is None
    (tmp_path / "broken.json").write_text("{not json")
    assert load_profile(tmp_path / "broken.json") is None
    gpu = reference_profile("rtx4090")
    assert load_profile(save_profile(gpu, tmp_path / "gpu.json")) == gpu


def test_default_path_is_in_the_data_dir(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("SPECCHAT_DATA_DIR", str(tmp_path))
    assert profile_path().parent == tmp_path
    save_profile(reference_profile("rtx3090"))
    assert load_profile() == reference_profile("rtx3090")


def test_progress_is_monotonic_and_cancel_raises(tmp_path: Path) -> None:
    seen: list[float] = []
    measure_hardware(lambda f, _: seen.append(f), quick=True, models_dir=tmp_path)
    assert seen == sorted(seen) and seen[-1] == 1.0 and len(seen) > 5
    cancel = threading.Event()

    def stop_midway(fraction: float, _: str) -> None:
        if fraction > 0.2:
            cancel.set()

    with pytest.raises(Cancelled):
        measure_hardware(stop_midway, cancel, quick=True, models_dir=tmp_path)
    assert not list(tmp_path.glob(".specchat-disk-test-*"))  # the disk test file is gone


def test_warnings_a_user_can_act_on() -> None:
    good = reference_profile("rtx4090", ram_gb=128)
    assert profile_warnings(good) == []
    card = good.gpus[0]
    x8_gen3 = dataclasses.replace(good, gpus=(dataclasses.replace(card, pcie_gen_loaded=3, pcie_width_loaded=8,
                                                                  pinned_h2d_gbps=6.0),))
    text = " ".join(profile_warnings(x8_gen3))
    assert "x8" in text and "Gen3" in text and "slow link" in text
    assert "RAM" in " ".join(profile_warnings(good, need_ram_bytes=200 * 10**9))
    assert "No CUDA GPU" in " ".join(profile_warnings(dataclasses.replace(good, gpus=())))


def test_bench_hardware_and_plan_commands(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    out_file = tmp_path / "p.json"
    assert main(["bench", "hardware", "--quick", "--output", str(out_file), "--threads", "1"]) == 0
    out = capsys.readouterr().out
    assert "RAM:" in out and str(out_file) in out
    assert load_profile(out_file) is not None
    assert main(["bench", "plan", "--gpu", "rtx4090", "--pcie-gbps", "25", "--target", "llama-3.1-70b-instruct",
                 "--draft", "llama-3.2-1b-instruct"]) == 0
    out = capsys.readouterr().out
    assert "<- chosen" in out and "choice: specexec" in out and "2048" in out
    assert main(["bench", "plan", "--gpu", "rtx4090", "--target", "llama-3.1-70b-instruct",
                 "--draft", "llama-3.2-1b-instruct", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["mode"] == "specexec" and len(plan["curve"]) == 12
    assert main(["bench", "plan", "--gpu", "rtx4090", "--target", "no-such-model"]) == 1  # a runtime error
    assert "not in the catalog" in capsys.readouterr().err
