"""Float weights that are exactly de-quantised Q4_0 / Q4_1 / Q8_0 blocks are packed back for the
CPU kernel (engine.loading.exact_pack), and nothing else is.

Weights are built the way a GGUF de-quantiser writes them (fp16 scales and minimums, codes of
the format, value = scale * code + minimum in fp32); the packed weight must de-quantise to the
same bits. Weights that are not such (random fp32, bf16 values, one value off by an ulp, a NaN)
must come back None. On the real starter: its FP32 folder loads packed, every matrix."""

from __future__ import annotations

from typing import cast

import pytest
import torch
from torch import nn

from engine.kernels.build import kernels
from engine.kernels.linear import PackedLinear, dequantize
from engine.loading.exact_pack import exact_weight, pack_exact
from engine.loading.load import LoadedModel


def gguf_like(form: str, n: int = 48, k: int = 256, seed: int = 0) -> torch.Tensor:
    """An (n, k) fp32 weight as a GGUF de-quantiser writes blocks of `form`, with a group of
    zeros and a constant group among them."""
    g = torch.Generator().manual_seed(seed)
    groups = k // 32
    d = (torch.rand(n, groups, generator=g) * 0.02 + 1e-4).half().float()
    if form == "q8_0":
        q = torch.randint(-127, 128, (n, groups, 32), generator=g).float()
        q[..., 0] = 127  # the largest magnitude is d * 127, as the quantiser chose d
        w = q * d[..., None]
    elif form == "q4_0":
        sign = torch.where(torch.rand(n, groups, generator=g) < 0.5, -1.0, 1.0)
        d = d * sign
        q = torch.randint(0, 16, (n, groups, 32), generator=g).float()
        q[..., 0] = 0  # code 0 (-8 d) is the value of largest magnitude
        w = q * d[..., None] + (-8 * d)[..., None]
    else:
        m = (torch.randn(n, groups, generator=g) * 0.05).half().float()
        q = torch.randint(0, 16, (n, groups, 32), generator=g).float()
        q[..., 0], q[..., 1] = 0, 15
        w = q * d[..., None] + m[..., None]
    w[0, 0] = 0.0
    w[1, 1] = w[1, 1, 0]
    return w.reshape(n, k)


@pytest.mark.parametrize("form, kind", [("q4_1", "q4"), ("q4_0", "q4"), ("q8_0", "q8")])
def test_de_quantised_blocks_pack_back_bit_for_bit(form: str, kind: str) -> None:
    w = gguf_like(form)
    packed = exact_weight(w)
    assert packed is not None and packed.kind == kind and packed.group == 32
    assert packed.scales.dtype == torch.float16  # two bytes a scale, as in the file
    assert torch.equal(dequantize(packed), w)


def test_weights_that_are_not_blocks_stay_as_they_are() -> None:
    w = gguf_like("q4_1")
    off = w.clone()
    off[5, 77] = torch.nextafter(off[5, 77], torch.tensor(1.0))  # one value an ulp away
    noisy = torch.randn(64, 256)
    nan = w.clone()
    nan[3, 3] = float("nan")
    for bad in (off, noisy, noisy.bfloat16().float(), nan, torch.randn(8, 48), w.double(), w[0]):
        assert exact_weight(bad) is None


def test_only_exact_linears_of_a_model_are_replaced() -> None:
    class Layer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.exact = nn.Linear(256, 48, bias=True)
            self.other = nn.Linear(256, 64, bias=False)

    class Inner(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList([Layer(), Layer()])

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = Inner()
            self.lm_head = nn.Linear(256, 48, bias=False)

    model = Model()
    with torch.no_grad():
        for i, layer in enumerate(model.model.layers):
            cast(Layer, layer).exact.weight.copy_(gguf_like("q4_1", seed=i))
        model.lm_head.weight.copy_(gguf_like("q8_0"))
    x = torch.randn(3, 256)
    layers = [cast(Layer, layer) for layer in model.model.layers]
    want = [layer.exact(x) for layer in layers]
    assert pack_exact(model, head=True) == (3, 5)
    for layer, y in zip(layers, want):
        assert isinstance(layer.exact, PackedLinear) and type(layer.other) is nn.Linear
        assert layer.exact.bias is not None
        assert torch.allclose(layer.exact(x), y, rtol=1e-5, atol=1e-5)  # the bias came along
    assert isinstance(model.lm_head, PackedLinear)


@pytest.mark.skipif(kernels() is None, reason="no C compiler for the packed kernel")
def test_the_starter_folder_loads_packed(starter_pair: tuple[LoadedModel, LoadedModel]) -> None:
    """The FP32 folder converted from the starter's Q4_1 GGUF: every decoder matrix and the
    head run packed (and so the fused C layers), while its FP4 proxy draft (not a GGUF's
    blocks) keeps its dense layers (its head, the target's Q8_0 embedding, is packed)."""
    target, draft = starter_pair
    hf = target.model.hf_model
    linears = [m for layer in hf.model.layers for m in layer.modules() if isinstance(m, (nn.Linear, PackedLinear))]
    assert linears and all(isinstance(m, PackedLinear) for m in linears)
    assert isinstance(hf.lm_head, PackedLinear) and target.model.fused is not None
    assert not any(isinstance(m, PackedLinear) for m in draft.model.hf_model.model.layers.modules())
    assert isinstance(draft.model.hf_model.lm_head, PackedLinear)
