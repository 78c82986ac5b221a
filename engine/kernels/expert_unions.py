"""The routing statistics of an MoE model's PackedExperts (engine.kernels.experts), summed over its
layers: how many experts passes of 2+ tokens woke (each module's `union_log`), kept across
processes (engine.decoding.learned) and read by the planner's union fit
(engine.planning.moe.fit_sharing).

What this module does not do: count anything (PackedExperts does, as it runs).
"""

from __future__ import annotations

from collections.abc import Iterable

from torch import nn

from engine.kernels.experts import PackedExperts

UnionTotals = dict[int, tuple[int, int, int]]  # log2 bucket of tokens -> (calls, tokens, experts woken), summed


def union_totals(modules: Iterable[nn.Module], seed: UnionTotals | None = None) -> UnionTotals:
    """The union logs of the PackedExperts among `modules` (a model's), summed over its MoE
    layers and added to `seed` (what earlier processes measured: engine.decoding.learned)."""
    totals = {b: list(t) for b, t in (seed or {}).items()}
    for m in modules:
        if isinstance(m, PackedExperts):
            for bucket, (calls, tokens, union) in m.union_log.items():
                t = totals.setdefault(bucket, [0, 0, 0])
                t[0], t[1], t[2] = t[0] + calls, t[1] + tokens, t[2] + union
    return {b: (t[0], t[1], t[2]) for b, t in totals.items()}


def measured_unions(modules: Iterable[nn.Module], seed: UnionTotals | None = None) -> dict[int, tuple[int, float]]:
    """What the PackedExperts among `modules` (and `seed`) measured of passes of 2+ tokens: mean
    tokens per pass (by powers of two) -> (observations, mean experts woken per MoE layer), the
    input of engine.planning.moe.fit_sharing; {} before any such pass."""
    return {round(tokens / calls): (calls, union / calls)
            for calls, tokens, union in union_totals(modules, seed).values() if calls}
