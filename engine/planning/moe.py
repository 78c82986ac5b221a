"""What a pass over N tokens costs an MoE layer: the union of the experts its tokens route to.

One token reads top_k of a layer's E experts; a tree of N tokens reads the union of theirs, not
N times top_k. With routing spread evenly and independently over the experts (the prior: a
random router, or a model before anything was measured), an expert is missed by all N tokens
with probability (1 - k/E)^N, so

    u(N) = E * (1 - (1 - k/E)^N)

experts are read: k for one token, nearly 2k for two, and every expert once N is a few times
E/k. Real routers favour some experts and neighbouring tokens share theirs, so the measured
union (engine.kernels.experts.PackedExperts.last_union, `specchat bench offload --moe`) lies at
or below the prior; the prior is the price a planner can rely on before a model was measured.

What this module does not do: measure (bench_moe.py), or place experts.
"""

from __future__ import annotations


def expert_union(tokens: int, experts: int, top_k: int) -> float:
    """The prior u(N): experts a pass over `tokens` tokens reads in one layer."""
    if tokens <= 0 or experts <= 0:
        return 0.0
    k = min(top_k, experts)
    return experts * (1.0 - (1.0 - k / experts) ** tokens)


def expert_bytes_per_pass(tokens: int, experts: int, top_k: int, expert_bytes: int, layers: int) -> float:
    """Bytes of routed experts a pass over `tokens` tokens reads, by the prior, over `layers` MoE layers."""
    return expert_union(tokens, experts, top_k) * expert_bytes * layers
