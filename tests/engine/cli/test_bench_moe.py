"""`specchat bench offload --moe` on the small synthetic MoE (a real GGUF written by the project's
writer, loaded with its experts packed): the table's u(N) is what routing must give, and the
planner's prior is the closed form."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest

from engine.cli.main import main
from engine.kernels import build
from engine.planning.moe import expert_bytes_per_pass, expert_union


def test_the_prior_union_of_experts() -> None:
    assert expert_union(1, 128, 8) == pytest.approx(8)
    assert expert_union(2, 128, 8) == pytest.approx(8 + 8 * 120 / 128)  # the second token misses 8 of 128 each
    assert expert_union(1000, 128, 8) == pytest.approx(128)
    assert expert_union(0, 128, 8) == 0 and expert_union(3, 4, 8) == pytest.approx(4)  # top-k capped at E
    us = [expert_union(n, 64, 4) for n in range(1, 50)]
    assert all(a < b for a, b in zip(us, us[1:]))
    assert expert_bytes_per_pass(4, 128, 8, 1000, 2) == pytest.approx(2000 * expert_union(4, 128, 8))


@pytest.mark.skipif(build.kernels() is None, reason="no C compiler here")
def test_bench_offload_moe_prints_the_union_per_tokens(model_cache: Path, capsys: pytest.CaptureFixture[str],
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPECCHAT_CACHE_DIR", str(model_cache))
    assert main(["bench", "offload", "--moe", "--quick", "--budgets", "1,8,32", "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    assert "2 MoE layers of 32 experts, 4 routed per token" in out
    rows = [line.split() for line in out.splitlines() if re.match(r"\s+\d+\s+\d", line)]
    assert [int(r[0]) for r in rows] == [1, 8, 32]
    unions = [float(r[4]) for r in rows]
    assert unions[0] == 4.0  # one token: exactly its top 4 in every layer
    assert unions[0] < unions[1] <= unions[2] <= 32
    for r in rows:
        n, pass_s, expert_s = int(r[0]), float(r[1]), float(r[2])
        assert 0 < expert_s <= pass_s
        assert float(r[5]) == pytest.approx(32 * (1 - (1 - 4 / 32) ** n), abs=0.06)
        assert float(r[4]) <= min(32, 4 * n)
    assert not math.isnan(float(rows[-1][6]))
    # the cost model's seconds for the experts: with the measured union, and the planner's prior
    for r in rows:
        assert float(r[8]) > 0 and float(r[9]) > 0
    assert float(rows[-1][9]) > float(rows[0][9])  # the prior's union grows with N


def test_experts_placement_is_asked_for_described_and_cpu_only_where_a_gpu_is(model_cache: Path) -> None:
    """`--experts` reaches the load settings; the placement says where the experts run; on a CPU
    device the experts are already on the CPU (the kernel path), so no split is made."""
    import torch

    from engine.cli.common import load_settings
    from engine.cli.parser import build_parser
    from engine.loading.gguf import GGUFWeights
    from engine.loading.layer_plan import MaterialiseSettings, experts_on_cpu
    from engine.loading.materialise import layer_buffers_as_parameters
    from engine.shapes import Placement
    from engine.testing.synthetic import tiny_gguf
    from transformers import AutoModelForCausalLM

    args = build_parser().parse_args(["generate", "--prompt", "hi", "--experts", "cpu"])
    assert load_settings(args, type("S", (), {"device": "cuda"})()).experts == "cpu"  # type: ignore[arg-type]
    assert build_parser().parse_args(["generate", "--prompt", "hi"]).experts == "auto"
    split = Placement(8, 8, 0, 0, 1, "gguf", "cuda", resident_form="experts-cpu")
    assert split.describe() == "all 8 layers on GPU, experts: 0 % in VRAM, rest on CPU (GGUF blocks)"
    weights = GGUFWeights(tiny_gguf("qwen3_moe", layers=2, layer_types=("Q8_0",), cache_dir=model_cache))
    try:
        with torch.device("meta"):
            hf = AutoModelForCausalLM.from_config(weights.config)
        layer_buffers_as_parameters(hf)
        weights.bind(hf)
        layouts = weights.layouts(hf, torch.float32, "none")
        assert not experts_on_cpu(hf, layouts, MaterialiseSettings(device="cpu", experts="cpu"))
    finally:
        weights.close()
