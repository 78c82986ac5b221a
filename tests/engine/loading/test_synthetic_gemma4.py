"""The random Gemma 4 GGUFs `specchat bench peer --gemma4` writes (engine.testing.random_gguf), at
a small size: SpecChat reads them as Gemma 4 (five sliding layers, then a full one whose keys are
its values, with wider heads and fewer K/V heads; tied embeddings; routed experts beside each
MLP, or, dense, per-layer inputs and last layers reusing earlier layers' K/V with MLPs twice as
wide), decodes them in the fused CPU step and pass, and those give what the same layers streamed
(the general path: transformers' modules) give, with the window shorter than the text."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.kernels import build
from engine.kernels.linear import PackedLinear
from engine.loading.load import load_model
from engine.model.causal_lm import causal_allowed
from engine.testing.random_gguf import Gemma4Shape, synthetic_gemma4_gguf

SMALL: Gemma4Shape = dict(hidden=256, layers=6, vocab=4096, heads=4, kv_heads=2, head_dim=64, global_head_dim=128,
                          global_kv_heads=1, intermediate=256, experts=8, top_k=2, expert_width=256, window=8)
DENSE = {**SMALL, "layers": 12, "experts": 0, "per_layer": 32, "shared": 2}  # 10 and 11 reuse 9's and 5's K/V


@pytest.mark.skipif(build.kernels() is None, reason="no C compiler here")
@pytest.mark.parametrize("shape", [SMALL, DENSE], ids=["moe", "dense"])
def test_the_synthetic_gemma4_decodes_fused_as_it_runs_streamed(tmp_path: Path, shape: dict) -> None:
    path = synthetic_gemma4_gguf(tmp_path / "gemma4.gguf", **shape)
    assert synthetic_gemma4_gguf(path, **shape) == path  # idempotent
    resident, streamed = load_model(path), load_model(path, offload="all")
    model = resident.model
    config = model.hf_model.config
    assert config.model_type == "gemma4_text" and config.tie_word_embeddings
    assert [k.window for k in model.kinds][:6] == [8] * 5 + [None]
    full = model.layers[5].self_attn
    assert full.v_proj is None and full.head_dim == 128
    if shape is SMALL:
        assert model.kv_shapes == [(2, 64)] * 5 + [(1, 128)] and config.enable_moe_block
    else:  # the sliding layer 10 reads layer 9's K/V, the full layer 11 layer 5's
        assert config.hidden_size_per_layer_input == 32 and config.num_kv_shared_layers == 2
        assert model.kv_shapes == [(2, 64)] * 5 + [(1, 128)] + [(2, 64)] * 4 + [(2, 0), (1, 0)]
        assert isinstance(model.hf_model.model.per_layer_model_projection, PackedLinear)  # read packed, as the head
    fused = model.fused
    assert fused is not None and streamed.model.fused is None
    calls = {"step": 0, "pass_": 0}
    for name in calls:  # counted: the resident side runs in C
        def counted(*args: object, _run: object = getattr(fused, name), _name: str = name, **kw: object) -> torch.Tensor:
            calls[_name] += 1
            return _run(*args, **kw)  # type: ignore[operator]
        setattr(fused, name, counted)
    ids = torch.arange(3, 30)
    # the packed products' rounding against the streamed layers' fp32 ones: the dense model's twelve
    # layers and per-layer inputs carry it further (its tree: 1.9e-4 fused, 1.5e-4 on the resident
    # general path, which runs the same packed products; fused and resident general agree to 7e-5)
    tol = 1e-4 if shape is SMALL else 3e-4
    caches = [m.model.new_cache(64) for m in (resident, streamed)]

    def both(tokens: torch.Tensor, positions: torch.Tensor, allowed: torch.Tensor | None = None) -> torch.Tensor:
        a, b = (m.model.logits(m.model.forward(tokens, positions, c, allowed))
                for m, c in zip((resident, streamed), caches))
        assert (a - b).abs().max() <= tol * b.abs().max()
        return a

    out = both(ids, torch.arange(len(ids)))  # the prompt: one fused pass
    at = len(ids)
    for _ in range(3):  # greedy steps: the fused C step on one side
        out = both(out[-1:].argmax(-1), torch.tensor([at]))
        at += 1
    # a tree of two branches (the fused pass under a mask): 0 -> 1 -> 2 and 0 -> 3
    allowed = causal_allowed(at, 4)
    allowed[3, at + 1: at + 3] = False
    both(torch.tensor([5, 6, 7, 8]), torch.tensor([at, at + 1, at + 2, at + 1]), allowed)
    assert calls == {"step": 3, "pass_": 2}
