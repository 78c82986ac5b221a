"""An MoE layer streamed in GGUF blocks de-quantises only the experts its tokens route to
(engine/offload/routed.py), and computes exactly what de-quantising the whole layer computes: a
random Qwen3-MoE GGUF (32 experts, 4 routed, K-quant experts in two parts, gate and up), every
layer streamed, against the same streamer with the routed de-quantisation off."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.loading.load import load_model
from engine.offload import routed
from engine.testing.random_gguf import SYNTHETIC_MOE_SMALL, synthetic_moe_gguf


@pytest.fixture(scope="module")
def moe_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return synthetic_moe_gguf(tmp_path_factory.mktemp("routed") / "moe.gguf", **SYNTHETIC_MOE_SMALL)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")])])
def test_streamed_experts_are_de_quantised_as_routed(moe_gguf: Path, monkeypatch: pytest.MonkeyPatch,
                                                     device: str) -> None:
    """Every layer streamed (on a GPU: copied over the link into the ring, then de-quantised there,
    its slot released after the routed experts ran); the same logits with and without."""
    lazy = load_model(moe_gguf, device, offload="all").model
    streamer = lazy.streamer
    assert streamer is not None
    hooks = [h for h in streamer._routed if h is not None]
    assert len(hooks) == 1 and hooks[0].prefix == "mlp.experts."
    monkeypatch.setattr(routed, "attach", lambda *args: None)
    whole = load_model(moe_gguf, device, offload="all").model
    assert whole.streamer is not None and not any(whole.streamer._routed)
    experts, top_k, layers = SYNTHETIC_MOE_SMALL["experts"], SYNTHETIC_MOE_SMALL["top_k"], SYNTHETIC_MOE_SMALL["layers"]
    caches = [lazy.new_cache(64), whole.new_cache(64)]
    for n, start in ((1, 0), (3, 1), (1, 4)):  # a step, a pass of three, a step
        ids, pos = torch.arange(5 + start, 5 + start + n), torch.arange(start, start + n)
        before = hooks[0].woken
        a, b = (m.logits(m.forward(ids, pos, c, None)) for m, c in zip((lazy, whole), caches))
        assert torch.equal(a, b)  # each routed expert holds what the whole layer's de-quantisation gave it
        woken = hooks[0].woken - before  # experts x parts (gate, up, down) over the layers
        assert 3 * layers * top_k <= woken <= 3 * layers * min(experts, n * top_k)
