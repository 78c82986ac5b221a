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

Measured unions are described by one more number, the sharing exponent s in (0, 1]: N tokens
wake what N^s independent tokens would,

    u(N) = E * (1 - (1 - k/E)^(N^s))

s = 1 is the prior; a model whose tokens share their experts has a smaller s (the synthetic MoE
of random weights, whose token states are alike: s ~ 0.25). `fit_sharing` finds s from the
(tokens, union) pairs a model's passes gave; the planner then prices its trees by that curve
(ExpertShape.sharing), still exact at one token (k) and at saturation (E).

What this module does not do: measure (engine.kernels.experts counts, bench_moe.py prints), or
place experts.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import TYPE_CHECKING

from engine.units import GB

if TYPE_CHECKING:
    from engine.planning.profile import HardwareProfile
    from engine.shapes import ModelShape

MIN_SHARING = 0.05
SHARING_STEPS = 200  # the grid fit_sharing searches (0.05 .. 1.0)


def expert_union(tokens: float, experts: int, top_k: int, sharing: float = 1.0) -> float:
    """u(N): experts a pass over `tokens` tokens reads in one layer; `sharing` 1 is the prior."""
    if tokens <= 0 or experts <= 0:
        return 0.0
    k = min(top_k, experts)
    return experts * (1.0 - (1.0 - k / experts) ** (tokens ** sharing))


def fit_sharing(unions: Mapping[int, tuple[int, float]], experts: int, top_k: int) -> float:
    """The sharing exponent whose u(N) is nearest (in log, weighted by the square root of the
    observations) the measured `unions`: tokens per pass -> (observations, mean experts woken
    per MoE layer). Passes of one token say nothing (they always wake k); without passes of
    more, or with unions at or above the prior's, 1.0 (the prior)."""
    points = [(n, math.sqrt(obs), math.log(max(u, 1e-9))) for n, (obs, u) in unions.items() if n > 1 and obs > 0]
    if not points or experts <= top_k:
        return 1.0

    def error(s: float) -> float:
        return sum(w * (math.log(expert_union(n, experts, top_k, s)) - lu) ** 2 for n, w, lu in points)

    grid = [MIN_SHARING + (1.0 - MIN_SHARING) * i / SHARING_STEPS for i in range(SHARING_STEPS + 1)]
    return min(grid, key=error)


def expert_bytes_per_pass(tokens: int, experts: int, top_k: int, expert_bytes: int, layers: int) -> float:
    """Bytes of routed experts a pass over `tokens` tokens reads, by the prior, over `layers` MoE layers."""
    return expert_union(tokens, experts, top_k) * expert_bytes * layers


def cached_expert_seconds(profile: HardwareProfile, target: ModelShape, tokens: int) -> float:
    """An average layer's routed experts for `tokens` tokens were all of them cached in VRAM (16-bit,
    engine.kernels.expert_cache): the union read from VRAM once."""
    ex, gpu = target.experts, profile.gpu
    if ex is None or gpu is None:
        return math.inf
    u = expert_union(tokens, ex.experts, ex.top_k, ex.sharing)
    return target.moe_fraction * 2 * u * target.expert_params / (gpu.device_memory_gbps * GB)
