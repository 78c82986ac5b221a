"""The self-draft's low-bit weights (engine.offload.lowbit) on a CUDA GPU: the codes, byte scales
and row factors quantize makes there are those it makes on the CPU, and dequantize_into on the
device writes the CPU's weight, for every width and with column scales. Runs where a GPU is."""

from __future__ import annotations

import pytest
import torch

from engine.offload import lowbit

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("bits", lowbit.BITS)
@pytest.mark.parametrize("scaled", [False, True])
def test_the_device_quantizes_and_dequantizes_as_the_cpu(bits: int, scaled: bool) -> None:
    g = torch.Generator().manual_seed(bits)
    w = torch.randn(96, 256, generator=g) * 0.02
    c = torch.exp(torch.randn(256, generator=g) * 0.3).half() if scaled else None
    here = lowbit.quantize(w, bits, 32, c)
    there = lowbit.quantize(w.cuda(), bits, 32, None if c is None else c.cuda())
    mismatched = [float((a.float() - b.cpu().float()).abs().gt(0).float().mean()) for a, b in zip(here, there)]
    assert max(mismatched) < 0.01, mismatched  # float sums may round a rare tie the other way
    cpu_out = torch.empty(w.shape, dtype=torch.float16)
    lowbit.dequantize_into(*here, bits, cpu_out, c)
    gpu_out = torch.empty(w.shape, dtype=torch.float16, device="cuda")
    lowbit.dequantize_into(*(t.cuda() for t in here), bits, gpu_out, None if c is None else c.cuda())
    torch.testing.assert_close(gpu_out.cpu(), cpu_out, rtol=2e-3, atol=1e-5)
