"""The families of 2025-26 on a CUDA GPU: each tiny random model (sliding windows, sinks, routed
and shared experts, Gated DeltaNet hybrids) decodes on the device exactly what plain transformers
decoding of the same folder gives on the same device, resident, with every layer streamed from
pinned RAM, as trees from a noisy-copy draft and as draft-free trees. The CPU twin of this test is
test_families.py; these run where a GPU is (`python scripts/gpu_proof.py`)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_families import LAYERS, PROMPT, assert_every_mode

from engine.loading.load import load_model
from engine.testing.synthetic import TINY_FAMILIES, tiny_model

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("arch", sorted(TINY_FAMILIES))
def test_every_family_decodes_on_the_gpu_as_transformers_does(arch: str, model_cache: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    target_path = tiny_model(arch, seed=0, layers=LAYERS, cache_dir=model_cache)
    draft_path = tiny_model(arch, seed=0, noise=0.05, layers=LAYERS, cache_dir=model_cache)
    assert_every_mode(arch, target_path, draft_path, "cuda", monkeypatch)


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen3_next"])
def test_nf4_experts_streamed_to_the_gpu_give_the_resident_logits(arch: str, model_cache: Path) -> None:
    """NF4 expert tensors de-quantised on the device after the copy stream brought them equal the
    same NF4 layers kept on the device."""
    path = tiny_model(arch, seed=0, layers=LAYERS, cache_dir=model_cache)
    resident = load_model(path, "cuda", quant="nf4")
    streamed = load_model(path, "cuda", quant="nf4", offload="all")

    def logits(m: object) -> torch.Tensor:
        ids = torch.tensor(m.tokenizer(PROMPT)["input_ids"])  # type: ignore[attr-defined]
        cache = m.model.new_cache(len(ids))  # type: ignore[attr-defined]
        return m.model.logits(m.model.forward(ids, torch.arange(len(ids)), cache, None))  # type: ignore[attr-defined]

    a, b = logits(resident), logits(streamed)
    assert torch.isfinite(a).all() and torch.equal(a, b)
