"""The hand-off between a GPU's MoE layer and the CPU's experts (engine.kernels.handoff): the
states, ids and weights arrive on the CPU as fp32 / int64 / fp32 in their shapes whatever dtype the
router left them in, and each sum sent back arrives whole, even when the next is staged before the
GPU has read the last. Models with their experts on the CPU beside a GPU run through it in
tests/engine/loading/test_gguf_families.py (gpu-marked)."""

from __future__ import annotations

import pytest
import torch

from engine.kernels import handoff


def routed(device: str, tokens: int, dtype: torch.dtype = torch.bfloat16) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, 64, generator=g).to(device, dtype)
    index = torch.randint(0, 16, (tokens, 4), generator=g).to(device, torch.int32)
    weights = torch.rand(tokens, 4, generator=g).to(device, dtype)
    return x, index, weights


def test_on_the_cpu_the_hand_off_is_a_conversion() -> None:
    x, index, weights = routed("cpu", 3)
    hx, hi, hw = handoff.to_host(x, index, weights)
    assert (hx.dtype, hi.dtype, hw.dtype) == (torch.float32, torch.int64, torch.float32)
    assert torch.equal(hx, x.float()) and torch.equal(hi, index.long()) and torch.equal(hw, weights.float())
    out = torch.randn(3, 64)
    assert handoff.to_device(out, torch.device("cpu")) is out


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_a_gpu_the_buffers_are_pinned_reused_grown_and_never_overwritten_early() -> None:
    for tokens in (1, 1, 300, 2):  # a step, another, a prompt chunk (the buffers grow), a step
        x, index, weights = routed("cuda", tokens)
        hx, hi, hw = handoff.to_host(x, index, weights)
        assert hx.is_pinned() and hx.shape == x.shape and hi.shape == index.shape
        assert torch.equal(hx, x.float().cpu()) and torch.equal(hi, index.long().cpu())
        assert torch.equal(hw, weights.float().cpu())
    device = torch.device("cuda", torch.cuda.current_device())
    torch.cuda._sleep(50_000_000)  # the GPU busy: the sums' copies wait behind it
    sums = [torch.full((2, 64), float(i)) for i in range(4)]
    there = [handoff.to_device(s, device) for s in sums]  # each staged while the last may be in flight
    for s, t in zip(sums, there):
        assert t.device.type == "cuda" and torch.equal(t.cpu(), s)
