"""The lean one-token step (engine.model.lean_step) on the projection's model type (`bench plan
--moe`, Qwen3.6-35B-A3B's architecture): a tiny Qwen3.5-MoE GGUF as llama.cpp's converter writes it,
Gated DeltaNet layers, gated attention, routed experts packed for the CPU kernel beside a shared
expert, run eagerly on the CPU as a GPU replays it: the general path's states, step after step."""

from __future__ import annotations

from pathlib import Path

import pytest
from lean_checks import assert_twin_steps
from test_gguf_families2 import hybrid, vocab  # noqa: F401 - vocab: the session fixture hybrid() reads

from engine.loading.load import load_model


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
