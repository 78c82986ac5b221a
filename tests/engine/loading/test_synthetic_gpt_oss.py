"""The random gpt-oss GGUF `specchat bench peer --gpt-oss` writes (engine.testing.random_gguf), at a
small size: SpecChat reads it as a gpt-oss (its MXFP4 experts packed, a decode step's experts in
one kernel call), and the packed experts give what the same layers streamed and de-quantised give."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.kernels import build
from engine.kernels.experts import PackedExperts
from engine.loading.load import load_model
from engine.testing.random_gguf import MoEShape, synthetic_gpt_oss_gguf

SMALL: MoEShape = dict(hidden=256, layers=2, vocab=4096, heads=4, kv_heads=2, head_dim=64, experts=8, top_k=2, expert_width=256)


@pytest.mark.skipif(build.kernels() is None, reason="no C compiler here")
def test_the_synthetic_gpt_oss_runs_packed_as_it_runs_streamed(tmp_path: Path) -> None:
    path = synthetic_gpt_oss_gguf(tmp_path / "gpt-oss.gguf", **SMALL)
    assert synthetic_gpt_oss_gguf(path, **SMALL) == path  # idempotent
    resident, streamed = load_model(path), load_model(path, offload="all")
    assert resident.model.hf_model.config.model_type == "gpt_oss"
    experts = [m for m in resident.model.hf_model.modules() if isinstance(m, PackedExperts)]
    assert len(experts) == SMALL["layers"] and all(e._fused is not None and e._fused[2] is not None for e in experts)
    ids = torch.arange(3, 40)

    def logits(m: object) -> torch.Tensor:
        cache = m.model.new_cache(len(ids))  # type: ignore[attr-defined]
        return m.model.logits(m.model.forward(ids, torch.arange(len(ids)), cache, None))  # type: ignore[attr-defined]

    a, b = logits(resident), logits(streamed)
    assert (a - b).abs().max() <= 1e-4 * b.abs().max()
