"""Helpers of the lean step's tests (tests/engine/model/test_lean_step.py,
tests/engine/loading/test_lean_hybrid.py): its outputs beside the general path's."""

from __future__ import annotations

import torch

from engine.model.cache import KVCache
from engine.model.causal_lm import CausalLM
from engine.model.lean_step import LeanStep, refusal


def forced(model: CausalLM) -> LeanStep:
    lean = LeanStep.of(model, anywhere=True)
    assert lean is not None, refusal(model)
    return lean


PROMPT = torch.arange(3, 10)


def _twin_caches(model: CausalLM, capacity: int) -> tuple[KVCache, KVCache]:
    """Two caches of `capacity`, each holding PROMPT read by the general path."""
    caches = model.new_cache(capacity), model.new_cache(capacity)
    model.lean = None
    for c in caches:
        model.forward(PROMPT, torch.arange(len(PROMPT)), c, None)
    return caches


def _through(model: CausalLM, lean: LeanStep | None, tokens: torch.Tensor, positions: torch.Tensor,
             cache: KVCache, allowed: torch.Tensor | None) -> torch.Tensor:
    """A pass through the general path (`lean` None) or the lean step: its outputs, and beside
    them the layer inputs a draft head reads where the model keeps some."""
    model.lean = lean
    out = model.forward(tokens, positions, cache, allowed)
    model.lean = None
    return torch.cat([out, model.head_states(out)], -1) if model.aux_inputs else out


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().nan_to_num(nan=float("inf")).max() / a.abs().max())  # (NaN counts)


def twin_steps(model: CausalLM, lean: LeanStep, steps: int, capacity: int,
               poison: bool = False) -> tuple[float, KVCache]:
    """The same tokens through the general path and the lean step, each on its own cache of
    `capacity` (grown by the steps): the largest difference of their outputs relative to the
    largest value, and the lean step's cache. `poison`: its unwritten columns hold NaN first."""
    worst = 0.0
    with torch.inference_mode():
        caches = _twin_caches(model, capacity)
        if poison:  # what torch.empty may hold: attention reads the whole capacity under its mask
            for t in (*caches[1].keys, *caches[1].values):
                t[:, :, caches[1].length :] = float("nan")
        for i in range(steps):
            tok, at = torch.tensor([11 + 7 * i % 90]), torch.tensor([len(PROMPT) + i])
            a = _through(model, None, tok, at, caches[0], None)
            worst = max(worst, _relative(a, _through(model, lean, tok, at, caches[1], None)))
    return worst, caches[1]


def assert_twin_steps(model: CausalLM, within: float = 5e-6) -> None:
    """The lean step's outputs within `within` (relative) of the general path's, over 24 steps of
    a cache that grows (8 columns to 32) and 6 of one whose unwritten columns hold NaN, and its
    segments ending at the MoE layers."""
    lean = forced(model)
    worst, cache = twin_steps(model, lean, steps=24, capacity=8)
    assert cache.capacity > 8 and cache.length == 7 + 24
    assert lean.steps == 24 and lean.replays == 0 and lean.why_eager == "not on a GPU"
    assert worst < within, worst
    worst, cache = twin_steps(model, lean, steps=6, capacity=32, poison=True)  # 19 NaN columns
    assert cache.capacity == 32 and worst < within, worst
    # a segment ends at each MoE layer's router; the last one ends in the final norm
    routed = [i for i, layer in enumerate(model.layers) if hasattr(layer.mlp, "experts")]
    assert len(lean.segments) == len(routed) + 1
    assert [b for _, b in lean.segments[:-1]] == [i + 1 for i in routed]
    assert lean.segments[-1][1] == len(model.layers)


def twin_passes(model: CausalLM, lean: LeanStep, sizes: list[int], seed: int = 0, capacity: int = 16) -> float:
    """Passes of each size in `sizes` through the general path and the lean step on twin caches,
    alternately chains and random trees (each node's parent an earlier node or the last committed
    token); after a tree both caches keep the same root-to-leaf path. The largest difference of
    their outputs relative to the largest value. `capacity`: the caches' at first (they grow)."""
    g = torch.Generator().manual_seed(seed)
    worst = 0.0
    with torch.inference_mode():
        caches = _twin_caches(model, capacity)
        for k, n in enumerate(sizes):
            at = caches[0].length
            tokens = torch.randint(3, 90, (n,), generator=g)
            allowed: torch.Tensor | None = None
            positions = torch.arange(at, at + n)
            path: list[int] = []
            if k % 2:  # a tree: parents, depths, each node's ancestors-or-self after the whole cache
                parents = [-1] + [int(torch.randint(-1, i, (1,), generator=g)) for i in range(1, n)]
                depth, anc = [], torch.zeros(n, n, dtype=torch.bool)
                for i, p in enumerate(parents):
                    depth.append(1 if p < 0 else depth[p] + 1)
                    anc[i, i] = True
                    if p >= 0:
                        anc[i] |= anc[p]
                allowed = torch.cat([torch.ones(n, at, dtype=torch.bool), anc], 1)
                positions = at - 1 + torch.tensor(depth)
                leaf = n - 1
                while leaf >= 0:
                    path.insert(0, leaf)
                    leaf = parents[leaf]
            a, b = (_through(model, use, tokens, positions, cache, allowed) for use, cache in zip((None, lean), caches))
            worst = max(worst, _relative(a, b))
            if path:
                for cache in caches:
                    cache.keep(torch.cat([torch.arange(at), at + torch.tensor(path)]))
    return worst
