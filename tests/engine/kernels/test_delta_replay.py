"""An accepted path replayed through a Gated DeltaNet state in C (engine/kernels/delta_replay.py):
the state transformers' recurrent rule reaches reading the path one token at a time, for
grouped and tiled value heads and paths of one to many tokens; anything the kernel does not
take (no library, bf16 or non-contiguous states) is left to the PyTorch block form, unchanged."""

from __future__ import annotations

import pytest
import torch

from engine.kernels import build
from engine.kernels.delta_replay import replay
from engine.model.linear_attention import advance
from engine.model.linear_state import LinearLayerState, LinearPending, NodeInputs

KH, VH, DK, DV = 2, 6, 16, 8
pytestmark = pytest.mark.skipif(build.kernels() is None, reason="no C compiler here")


def reference(state: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor, g: torch.Tensor,
              tiled: bool) -> torch.Tensor:
    """transformers' torch_recurrent_gated_delta_rule, written out: one token at a time, in fp64."""
    s = state[0].double().clone()
    heads = torch.arange(VH)
    key = heads % KH if tiled else heads // (VH // KH)
    for j in range(k.shape[0]):
        kj = k[j].double() * torch.rsqrt((k[j].double() ** 2).sum(-1, keepdim=True) + 1e-6)
        kv = kj[key]  # (VH, DK)
        s = s * g[j].double().exp()[:, None, None]
        mem = (s * kv[:, :, None]).sum(1)  # (VH, DV)
        delta = (v[j].double() - mem) * beta[j].double()[:, None]
        s = s + kv[:, :, None] * delta[:, None, :]
    return s[None].float()


def inputs(steps: int, seed: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    state = torch.randn(1, VH, DK, DV, generator=gen)
    k = torch.randn(steps, KH, DK, generator=gen)
    v = torch.randn(steps, VH, DV, generator=gen)
    beta = torch.rand(steps, VH, generator=gen)
    g = -torch.rand(steps, VH, generator=gen) * 2
    return state, k, v, beta, g


@pytest.mark.parametrize("tiled", [False, True])
@pytest.mark.parametrize("steps", [1, 3, 70])
def test_the_replayed_state_is_the_recurrent_rule_s(tiled: bool, steps: int) -> None:
    state, k, v, beta, g = inputs(steps, seed=steps + 10 * tiled)
    want = reference(state, k, v, beta, g, tiled)
    got = state.clone()
    assert replay(got, k, v, beta, g, tiled)
    assert torch.allclose(got, want, rtol=1e-4, atol=1e-5)
    other = state.clone()  # the other head order gives another state: the flag is read
    assert replay(other, k, v, beta, g, not tiled) and not torch.allclose(other, want, atol=1e-3)


def test_what_the_kernel_does_not_take_is_left_alone() -> None:
    state, k, v, beta, g = inputs(2, seed=1)
    half = state.to(torch.bfloat16)
    assert not replay(half, k, v, beta, g, False) and torch.equal(half, state.to(torch.bfloat16))
    strided = state.transpose(2, 3)
    assert not replay(strided, k, v, beta, g, False) and torch.equal(strided, state.transpose(2, 3))
    assert not replay(state, torch.randn(2, 4, DK), v, beta, g, False)  # 6 value heads over 4 key heads


def test_advance_replays_the_path_s_nodes_on_the_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """HybridCache.keep's replay (linear_attention.advance) through the C rule and through the
    block form it replaced: the same conv and recurrent states, the path's nodes alone read."""
    n, conv = 5, 2 * KH * DK + VH * DV
    state, k, v, beta, g = inputs(n, seed=3)
    x = torch.randn(n, conv, generator=torch.Generator().manual_seed(4))
    layer = LinearLayerState(torch.randn(1, conv, 3), state)
    nodes = LinearPending(n, NodeInputs(x, k, v, beta, g), None)
    fast, slow = layer.clone(), layer.clone()
    path = [0, 2, 4]
    advance(fast, nodes, path)
    monkeypatch.setattr("engine.kernels.delta_replay.replay", lambda *a: False)
    advance(slow, nodes, path)
    assert torch.equal(fast.conv, slow.conv)
    assert torch.equal(fast.conv[0, :, 1:], x[[2, 4]].T) and torch.equal(fast.conv[0, :, 0], x[0])
    assert torch.allclose(fast.recurrent, slow.recurrent, rtol=1e-4, atol=1e-5)
    want = reference(state, k[path], v[path], beta[path], g[path], False)
    assert torch.allclose(fast.recurrent, want, rtol=1e-4, atol=1e-5)
