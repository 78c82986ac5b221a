"""The GPU proof (`python scripts/gpu_proof.py` = the gpu-marked tests + the installer's check +
`specchat bench gpu`): the CPU dry run end to end (every section, a real pytest subprocess on
gpu-marked tests written here, the real installer check, tiny random models streamed through
the real executor), the report's fail-soft behaviour, and, on a GPU, the model sections on tiny
shapes with real VRAM caps."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch

from engine.cli.bench_gpu import Deadline, Report
from engine.cli.bench_gpu_passes import CPU_TOKENS_PER_PASS, cpu_tokens_per_pass
from engine.cli.main import main

REPO = Path(__file__).resolve().parents[3]


def gpu_proof():  # scripts/ is not a package: load the script as a module
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_proof", REPO / "scripts" / "gpu_proof.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module

GPU_TESTS = """
import pytest

@pytest.mark.gpu
def test_passes():
    assert True

@pytest.mark.gpu
def test_fails():
    assert 1 == 2

def test_not_gpu():
    pass
"""


def test_the_cpu_dry_run_runs_every_section_and_says_gpu_figures_need_a_gpu(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    tests = tmp_path / "gpu-tests"
    tests.mkdir()
    (tests / "test_sample.py").write_text(GPU_TESTS)
    (tests / "test_other.py").write_text("def test_plain():\n    pass\n")  # no gpu mark: not collected
    out = tmp_path / "out"
    rc = gpu_proof().main(["--device", "cpu", "--out", str(out), "--tests", str(tests), "--layers", "4"])
    printed = capsys.readouterr()
    assert rc == 1  # a gpu-marked test failed, and the command says so
    assert "CPU DRY RUN" in printed.out and "GPU figures need a GPU" in printed.out
    data = json.loads((out / "gpu_bench.json").read_text())
    sections = data["sections"]
    assert list(sections) == ["environment", "tests", "installer", "lean", "profile", "build", "streaming",
                              "cap 24 GiB", "cap 12 GiB"]
    assert all(s["status"] == "ok" for s in sections.values()), {k: s.get("error") for k, s in sections.items()}
    lean = sections["lean"]["result"]["rows"]  # both paths ran, eagerly here, and agree
    assert [(r["segments"], r["graphs"], r["why_eager"]) for r in lean] == [(1, False, "not on a GPU"),
                                                                          (9, False, "not on a GPU"),
                                                                          (9, False, "not on a GPU")]
    assert all(r["max_diff"] < 1e-4 and r["general_ms"] > 0 and r["lean_ms"] > 0 and r["general_pass_layer_ms"] > 0
               for r in lean)
    assert all(r["lean_pass_layer_ms"] > 0 for r in lean)  # a hybrid's tree passes too
    assert "lean step (CPU dry run" in printed.out
    assert data["mode"] == "cpu dry run" and data["finished"]

    tests_run = sections["tests"]["result"]
    assert tests_run["files"] == [str(tests / "test_sample.py")]
    assert {k: tests_run["counts"][k] for k in ("passed", "failed", "deselected")} == \
        {"passed": 1, "failed": 1, "deselected": 1}
    assert any(line.startswith("FAILED") and "test_fails" in line for line in tests_run["tests"])
    assert "test_fails" in (out / "gpu_tests.log").read_text() and "1 gpu test(s) FAILED" in printed.out
    assert sections["installer"]["result"]["torch_build"].startswith("PyTorch")

    build = sections["build"]["result"]
    assert (build["layers_built"], build["layers_full"]) == (4, 6) and build["pinned"] is False
    stream = sections["streaming"]["result"]
    assert stream["bytes_per_pass"] == 4 * build["layer_bytes"]
    for row in stream["rows"]:
        assert row["pass_gbps"] == pytest.approx(stream["bytes_per_pass"] / row["pass_s"] / 1e9)
        assert 0.0 <= row["overlap"] <= 1.0 and row["streamed_layer_s"] > 0

    for name, resident in (("cap 24 GiB", 2), ("cap 12 GiB", 1)):  # the dry run scales the share from the cap
        cap = sections[name]["result"]
        assert (cap["gpu_layers"], cap["ram_layers"]) == (resident, 4 - resident)
        rows = cap["rows"]
        assert [(r["mode"], r["budget"]) for r in rows] == [("autoregressive", 0), ("specexec", 4), ("specexec", 16)]
        for r in rows:
            assert r["step_s"] == pytest.approx(r["draft_s"] + r["target_s"] + r["other_s"])
            assert r["tok_s"] == pytest.approx(r["tokens_per_pass"] / r["step_s"])
            assert r["pred_target_s"] > 0 and r["target_ratio"] == pytest.approx(r["target_s"] / r["pred_target_s"])
            assert r["scaled_step_s"] == pytest.approx(r["step_s"] + 2 * r["streamed_layer_s"])  # 2 layers not built
            if r["budget"]:  # a real draft pass grew the tree to the full budget
                assert r["tree_nodes"] == r["budget"] + 1 and r["draft_passes"] >= 2 and r["pred_draft_s"] > 0
                assert r["tokens_per_pass"] == cpu_tokens_per_pass(r["budget"])[0]
    assert (out / "gpu_bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "6L tok/s" in printed.out and "cap 24 GiB: 2 of 4 layers resident" in printed.out


def test_a_failing_section_keeps_its_partial_result_and_the_run_goes_on(tmp_path: Path) -> None:
    report = Report(tmp_path, {"mode": "gpu"}, end=time.monotonic() + 60)

    def broken(deadline: Deadline, partial: object) -> dict:
        partial({"rows": [1, 2]})  # type: ignore[operator]
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    assert report.section("first", 10, broken) is None
    on_disk = json.loads((tmp_path / "gpu_bench.json").read_text())["sections"]["first"]
    assert on_disk["status"] == "error" and "illegal memory access" in on_disk["error"]
    assert on_disk["result"] == {"rows": [1, 2]}  # what it measured before failing
    assert report.section("second", 10, lambda d, p: {"ok": d.left() > 0}) == {"ok": True}
    report.end = time.monotonic() - 1  # the run's time limit is reached: no new section starts
    assert report.section("third", 10, lambda d, p: {}) is None
    assert json.loads((tmp_path / "gpu_bench.json").read_text())["sections"]["third"]["status"] == "skipped"


def test_cpu_tokens_per_pass_are_the_readme_figures_interpolated_and_held() -> None:
    for budget, value in CPU_TOKENS_PER_PASS.items():
        assert cpu_tokens_per_pass(budget) == (value, "CPU bench")
    mid, source = cpu_tokens_per_pass(128)
    assert CPU_TOKENS_PER_PASS[64] < mid < CPU_TOKENS_PER_PASS[256] and "interpolated" in source
    assert cpu_tokens_per_pass(2048)[0] == max(CPU_TOKENS_PER_PASS.values())


def test_help_and_bad_options(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert main(["bench", "gpu", "--help"]) == 0
    assert "--quick" in capsys.readouterr().out
    assert main(["bench", "gpu", "--out", str(tmp_path), "--only", "tests"]) == 2  # the tests are the script's
    assert main(["bench", "gpu", "--out", str(tmp_path), "--only", "streaming,nope"]) == 2
    assert main(["bench", "gpu", "--out", str(tmp_path), "--budgets", "64,0"]) == 2
    assert "error:" in capsys.readouterr().err


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_model_sections_on_cuda_with_tiny_shapes(tmp_path: Path) -> None:
    """The GPU code of the benchmark in seconds, before the big run: pinned random NF4 layers,
    events per layer, and two real caps, one roomy, one that leaves less than the placement's
    1 GiB margin (so every layer streams)."""
    from engine.cli.bench_gpu_passes import RunSettings, Workbench
    from engine.units import GIB, MIB

    dev = torch.device("cuda", torch.cuda.current_device())
    bench = Workbench(RunSettings(device=dev, dtype=torch.bfloat16, tiny=True, quick=True, layers=None,
                                  budgets=(4, 16), tokens=(1, 16), repeats=1))
    far = Deadline(time.monotonic() + 600)
    try:
        bench.measure_profile(far, lambda r: None)
        assert bench.build(far, lambda r: None)["pinned"]
        stream = bench.streaming(far, lambda r: None)
        assert all(r["pass_s"] > 0 and r["streamed_layer_s"] > 0 for r in stream["rows"])
        roomy = bench.cap(24, far, lambda r: None)
        tight = bench.cap((bench.overhead + torch.cuda.memory_reserved(dev) + 512 * MIB) / GIB, far, lambda r: None)
        assert roomy["gpu_layers"] == 6 and tight["gpu_layers"] == 0
        assert 0 < tight["device_free_bytes"] < GIB
        for cap in (roomy, tight):
            assert [r.get("error") for r in cap["rows"]] == [None] * 3
            assert [r["tree_nodes"] for r in cap["rows"]] == [1, 5, 17]
        assert torch.cuda.get_per_process_memory_fraction(dev) == 1.0  # the cap is lifted afterwards
    finally:
        bench.close()


def test_the_gpu_test_files_are_found_without_opening_fifos_or_folders(tmp_path: Path) -> None:
    """--tests DIR is a folder a user names: a FIFO or folder named like a test file is passed
    over, never read (a FIFO would block the run)."""
    import os

    gpu_test_files = gpu_proof().gpu_test_files

    (tmp_path / "test_gpu.py").write_text(GPU_TESTS)
    (tmp_path / "test_cpu.py").write_text("def test_x():\n    pass\n")
    os.mkfifo(tmp_path / "test_pipe.py")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "test_folder.py").mkdir()
    (tmp_path / "test_binary.py").write_bytes(b"\xff\xfe mark.gpu")
    assert gpu_test_files(tmp_path) == [tmp_path / "test_gpu.py"]
