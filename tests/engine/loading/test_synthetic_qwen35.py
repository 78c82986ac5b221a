"""The random Qwen3.5-MoE GGUF `specchat bench peer --qwen35` writes (engine.testing.random_gguf),
at a small size: SpecChat reads it as a Qwen3.5-MoE hybrid (Gated DeltaNet layers with their
value heads in llama.cpp's tiled order, gated attention every fourth layer, routed and shared
experts), decodes it in the fused CPU step, and those steps give what the same layers streamed
(the general path) give."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.kernels import build
from engine.loading.load import load_model
from engine.testing.random_gguf import HybridShape, synthetic_qwen35_gguf

SMALL: HybridShape = dict(hidden=256, layers=4, vocab=4096, heads=4, kv_heads=2, head_dim=64, linear_k_heads=2,
                          linear_v_heads=4, linear_head_dim=64, experts=8, top_k=2, expert_width=256)


@pytest.mark.skipif(build.kernels() is None, reason="no C compiler here")
@pytest.mark.parametrize("arch", ["qwen35moe", "qwen3next"])
def test_the_synthetic_qwen35_decodes_fused_as_it_runs_streamed(tmp_path: Path, arch: str) -> None:
    path = synthetic_qwen35_gguf(tmp_path / "qwen35.gguf", **SMALL, arch=arch)
    assert synthetic_qwen35_gguf(path, **SMALL, arch=arch) == path  # idempotent
    resident, streamed = load_model(path), load_model(path, offload="all")
    config = resident.model.hf_model.config
    assert config.model_type == "qwen3_5_moe_text" and getattr(config, "linear_value_heads_tiled", False) == (arch == "qwen35moe")
    assert [k.mixer for k in resident.model.kinds] == ["linear", "linear", "linear", "attention"]
    assert resident.model.fused is not None and resident.model.fused.hybrid and streamed.model.fused is None
    ids = torch.arange(3, 30)
    caches = [m.model.new_cache(64) for m in (resident, streamed)]

    def both(tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        a, b = (m.model.logits(m.model.forward(tokens, positions, c, None)) for m, c in zip((resident, streamed), caches))
        assert (a - b).abs().max() <= 1e-4 * b.abs().max()
        return a

    out = both(ids, torch.arange(len(ids)))
    for step in range(4):  # greedy steps: the fused C step on one side
        token = out[-1:].argmax(-1)
        out = both(token, torch.tensor([len(ids) + step]))
