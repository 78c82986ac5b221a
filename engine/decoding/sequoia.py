"""Static Sequoia trees: the tree shape with the best expected tokens per target pass for a
token budget and a depth limit, from an acceptance-by-rank vector (Sequoia, Chen et al. 2024).

Model (positional acceptance): `accept[r]` is the chance that the target's next token is the
draft's (r+1)-th likeliest token at a node, independent of the node. Node v of a tree is reached
by the acceptance walk iff every token on its root path is the target's choice, with chance
f(v) = product of accept[rank] along the path. The walk emits the accepted path plus one token
of the target's own, so expected tokens per pass = 1 + sum of f(v) over the non-root nodes.

Dynamic program over (nodes n, depth d); children of a node hold ranks 0..c-1 (the top-c
draft tokens):

    T(n, d) = 1 + G_d(0, n - 1)            best tree of n nodes (root included), depth <= d
    G_d(j, m) = max over s in 1..m of accept[j] * T(s, d - 1) + G_d(j + 1, m - s);  G_d(j, 0) = 0

Each inner max is a (max, +) convolution, vectorised with numpy; O(D * K * N^2) work for N
nodes, K ranks and depth D (a 1024 budget, 16 ranks and depth 16 take a few seconds on one
core, so trees are built once per budget and cached by the caller). With a non-increasing
`accept` the answer equals "the N best nodes of the infinite tree", which the tests use as a
second, independent reference besides brute force.

What this module does not do: fill the shape with tokens (drafting.grow_static_tree does that
with the draft model) or measure `accept` (cli.bench.measure_rank_acceptance).
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

NEG = -1e30


@dataclass(frozen=True)
class StaticTree:
    """A tree shape in breadth-first order (node 0 is the root, parents[i] < i).

    ranks[i]: node i carries its parent's (ranks[i]+1)-th likeliest draft token (-1 for the root).
    expected_tokens: the model's expected tokens per target pass (1 + sum of path chances).
    """

    parents: tuple[int, ...]
    ranks: tuple[int, ...]
    depths: tuple[int, ...]
    expected_tokens: float

    @property
    def budget(self) -> int:
        """Draft tokens in the tree (the root is the last committed token, not a draft token)."""
        return len(self.parents) - 1

    @property
    def max_depth(self) -> int:
        return max(self.depths)

    def max_children(self) -> int:
        counts = np.bincount(np.asarray(self.parents[1:], dtype=np.int64), minlength=len(self.parents))
        return int(counts.max()) if len(self.parents) > 1 else 0


def expected_tokens(parents: Sequence[int], ranks: Sequence[int], accept: Sequence[float]) -> float:
    """1 + sum over non-root nodes of the product of accept[rank] along the root path
    (parents[i] < i)."""
    chance = [1.0] * len(parents)
    for i in range(1, len(parents)):
        r = ranks[i]
        chance[i] = chance[parents[i]] * (accept[r] if r < len(accept) else 0.0)
    return 1.0 + sum(chance[1:])


def build_tree(accept: Sequence[float], budget: int, max_depth: int) -> StaticTree:
    """The best tree with at most `budget` draft tokens and depth at most `max_depth`.

    Uses exactly `budget` tokens when accept has enough positive ranks (more nodes never
    lower the expectation); fewer only when the tree cannot grow (depth times ranks)."""
    if budget < 0 or max_depth < 0:
        raise ValueError("budget and max_depth must be >= 0")
    q = np.clip(np.asarray(accept, dtype=np.float64), 0.0, 1.0)
    k = len(q)
    n_max = budget + 1
    depth = min(max_depth, budget)
    # T[d][n]: best value of a tree of n nodes with depth <= d; n = 0 is infeasible.
    t_prev = np.full(n_max + 1, NEG)
    t_prev[1] = 1.0  # d = 0: the root alone
    tables: list[np.ndarray] = [t_prev]
    choices: list[np.ndarray] = [np.zeros((0, 0), dtype=np.int32)]  # choices[d][j, m] = s
    m_idx = np.arange(n_max)[:, None]  # (M, 1) nodes to distribute among ranks j..
    s_idx = np.arange(1, n_max)[None, :]  # (1, M-1) nodes given to rank j
    valid = s_idx <= m_idx  # (M, M-1)
    diff = np.clip(m_idx - s_idx, 0, None)  # (M, M-1) nodes left for ranks j+1..
    for _ in range(depth):
        g_next = np.full(n_max, NEG)  # G(k, m): no ranks left
        g_next[0] = 0.0
        choice = np.zeros((k, n_max), dtype=np.int32)
        ok = valid & (t_prev[1:n_max][None, :] > NEG / 2)  # (M, M-1) feasible child sizes
        for j in range(k - 1, -1, -1):
            sub = q[j] * t_prev[1:n_max]  # (M-1,) value of a rank-j child subtree of s nodes
            cand = np.where(ok, sub[None, :] + g_next[diff], NEG)  # (M, M-1)
            best_s = cand.argmax(axis=1)  # (M,)
            best = cand[np.arange(n_max), best_s]
            g = np.where(best > NEG / 2, best, NEG)
            g[0] = 0.0
            choice[j] = np.where(g > NEG / 2, best_s + 1, 0)
            choice[j, 0] = 0
            g_next = g
        t_cur = np.full(n_max + 1, NEG)
        t_cur[1:] = np.where(g_next > NEG / 2, 1.0 + g_next, NEG)
        tables.append(t_cur)
        choices.append(choice)
        t_prev = t_cur
    final = tables[-1]
    n_best = max(n for n in range(1, n_max + 1) if final[n] > NEG / 2)
    # more nodes never hurt, but a budget the shape cannot hold (ranks x depth) stays smaller
    parents, ranks, depths = _reconstruct(choices, len(tables) - 1, n_best, k)
    value = expected_tokens(parents, ranks, q.tolist())
    assert abs(value - final[n_best]) < 1e-6 * max(1.0, value), "DP value and rebuilt tree disagree"
    return StaticTree(tuple(parents), tuple(ranks), tuple(depths), float(value))


def _reconstruct(choices: list[np.ndarray], depth: int, nodes: int, k: int) -> tuple[list[int], list[int], list[int]]:
    """Rebuild the tree of T(nodes, depth) from the DP's choices, breadth-first."""
    parents, ranks, depths = [-1], [-1], [0]
    queue = [(0, depth, nodes)]  # (node index, depth budget, subtree size)
    head = 0
    while head < len(queue):
        node, d, n = queue[head]
        head += 1
        m, j = n - 1, 0
        while m > 0:
            assert j < k and d >= 1, "DP choice table inconsistent"
            s = int(choices[d][j, m])
            assert s >= 1
            parents.append(node)
            ranks.append(j)
            depths.append(depths[node] + 1)
            queue.append((len(parents) - 1, d - 1, s))
            m -= s
            j += 1
    return parents, ranks, depths


def best_nodes_tree(accept: Sequence[float], budget: int, max_depth: int) -> StaticTree:
    """The `budget` highest-chance nodes of the infinite rank tree (depth <= max_depth): the
    optimum when accept is non-increasing. A best-first search; used as a cross-check."""
    q = [min(max(float(a), 0.0), 1.0) for a in accept]
    parents, ranks, depths, chance = [-1], [-1], [0], [1.0]
    heap: list[tuple[float, int, int, int]] = []  # (-chance, order, parent, rank)
    order = 0
    if q and max_depth > 0:
        heapq.heappush(heap, (-q[0], order, 0, 0))
    while heap and len(parents) - 1 < budget:
        neg, _, parent, rank = heapq.heappop(heap)
        parents.append(parent)
        ranks.append(rank)
        depths.append(depths[parent] + 1)
        chance.append(-neg)
        me = len(parents) - 1
        order += 1
        if rank + 1 < len(q):  # next sibling
            heapq.heappush(heap, (-chance[parent] * q[rank + 1], order, parent, rank + 1))
        if depths[me] < max_depth:  # first child
            order += 1
            heapq.heappush(heap, (-chance[me] * q[0], order, me, 0))
    return StaticTree(tuple(parents), tuple(ranks), tuple(depths), 1.0 + sum(chance[1:]))
