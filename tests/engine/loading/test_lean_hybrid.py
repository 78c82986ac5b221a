"""The lean step (engine.model.lean_step) on GGUFs whose routed experts are packed for the CPU
kernel, run eagerly on the CPU as a GPU replays it: the projection's model type (`bench plan
--moe`, Qwen3.6-35B-A3B's architecture: a tiny Qwen3.5-MoE GGUF as llama.cpp's converter writes
it, Gated DeltaNet layers, gated attention, a shared expert), the general path's states step after
step; and a Qwen3-MoE GGUF's passes in buckets, whose pads never reach the experts."""

from __future__ import annotations

from pathlib import Path

import pytest
from lean_checks import assert_twin_steps, forced, twin_passes
from test_gguf_families2 import hybrid, vocab  # noqa: F401 - vocab: the session fixture hybrid() reads

from engine.loading.load import load_model
from engine.testing.random_gguf import SYNTHETIC_MOE_SMALL, synthetic_moe_gguf


def test_the_qwen35_moe_gguf_with_packed_experts_steps_as_the_general_path(
        vocab: tuple, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    """The projection's model type (bench plan --moe): Gated DeltaNet layers, gated attention,
    routed experts packed for the CPU kernel beside a shared expert."""
    path = tmp_path / "qwen35moe.gguf"
    hybrid(vocab[1], vocab[0], path, "qwen35moe")
    monkeypatch.setenv("SPECCHAT_NO_FUSED", "1")  # the general path (on a GPU there is no fused C step)
    model = load_model(path, offload="none").model
    assert model.config.model_type == "qwen3_5_moe_text" and any(model.linear)
    assert type(model.layers[1].mlp.experts).__name__ == "PackedExperts"
    # (the packed kernels round each product's input to 22 bits: the shared and routed experts'
    # sum taken in another order moves a last digit now and then, ~2e-5 of the largest value)
    assert_twin_steps(model, within=1e-4)


def test_passes_route_only_their_own_tokens(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = synthetic_moe_gguf(tmp_path / "moe.gguf", **SYNTHETIC_MOE_SMALL)  # type: ignore[arg-type]
    monkeypatch.setenv("SPECCHAT_NO_FUSED", "1")
    model = load_model(path, offload="none").model
    experts = [layer.mlp.experts for layer in model.layers]
    assert all(type(e).__name__ == "PackedExperts" for e in experts)
    sizes = [3, 6, 1, 11, 30]
    worst = twin_passes(model, forced(model), sizes)
    assert worst < 1e-4, worst
    top_k = SYNTHETIC_MOE_SMALL["top_k"]
    # the prompt (7 tokens) on both caches, then each pass's tokens on both paths: no pad routed
    assert all(int(e.hits.sum()) == 2 * top_k * (7 + sum(sizes)) for e in experts)
