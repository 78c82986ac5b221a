"""The starter as an MoE (engine.testing.upcycle, `specchat bench peer --upcycled`): a dense
Llama GGUF rewritten with its MLP as 8 slices in several copies, 8 routed. It must read as a
Mixtral, give the dense model's logits whatever copy each token is routed to, and route
different tokens to different copies (else a tree would wake no more experts than one token)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.kernels.experts import PackedExperts
from engine.loading.load import load_model
from engine.store.gguf_header import read_model
from engine.testing.synthetic import tiny_gguf
from engine.testing.upcycle import moe_from_dense


def _logits(loaded: object, ids: torch.Tensor) -> torch.Tensor:
    model = loaded.model  # type: ignore[attr-defined]
    cache = model.new_cache(len(ids))
    return model.logits(model.forward(ids, torch.arange(len(ids)), cache, None))


def test_the_upcycled_moe_is_the_dense_model_routed(tmp_path: Path) -> None:
    dense = tiny_gguf("llama", layers=2, hidden=128, layer_types=("Q8_0", "Q4_0"), embed_type="Q8_0",
                      head_type="Q8_0", cache_dir=tmp_path)
    moe = moe_from_dense(dense, tmp_path / "moe.gguf", copies=4)
    assert moe_from_dense(dense, moe, copies=4) == moe  # idempotent
    meta = read_model(moe).metadata
    assert (meta["llama.expert_count"], meta["llama.expert_used_count"], meta["llama.feed_forward_length"]) == (32, 8, 32)

    a, b = load_model(dense), load_model(moe)
    assert b.model.hf_model.config.model_type == "mixtral"
    assert sum(isinstance(m, PackedExperts) for m in b.model.hf_model.modules()) == 2
    ids = torch.arange(3, 60)
    want, got = _logits(a, ids), _logits(b, ids)
    assert (got - want).abs().max() <= 1e-4 * want.abs().max()  # each token's 8 slices are its dense MLP

    with torch.no_grad():
        routed = b.model.hf_model(ids[None], output_router_logits=True).router_logits
    for layer in routed:
        top = layer.reshape(len(ids), 32).topk(8, dim=-1).indices
        copies, slices = top // 8, top % 8
        assert (copies == copies[:, :1]).all()  # one copy's eight slices a token
        assert (slices.sort(dim=-1).values == torch.arange(8)).all()
        assert len(copies[:, 0].unique()) > 1  # and tokens differ in the copy they wake


def test_a_source_in_wider_blocks_is_refused(tmp_path: Path) -> None:
    dense = tiny_gguf("llama", layers=1, hidden=256, layer_types=("Q4_K/Q6_K",), cache_dir=tmp_path)
    with pytest.raises(ValueError, match="32-wide blocks"):
        moe_from_dense(dense, tmp_path / "moe.gguf")
    assert not list(tmp_path.glob("moe.gguf*"))  # nor its .part
