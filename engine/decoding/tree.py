"""The token tree of one speculation step, and the masks and positions it implies.

Node 0 is the root: the last committed token, which the target has not seen yet. Every other
node is a draft token. Invariant: nodes are stored parent-before-child (parents[i] < i), so a
prefix of the node list is always a valid tree and a single forward pass in storage order is
causally consistent. Pure tensor code; imports nothing else from the engine.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Tree:
    tokens: torch.Tensor  # (N,) long
    parents: torch.Tensor  # (N,) long, -1 for the root
    depths: torch.Tensor  # (N,) long, 0 for the root
    logp: torch.Tensor  # (N,) float32, cumulative draft log-probability, 0 for the root

    def __len__(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def max_depth(self) -> int:
        return int(self.depths.max().item()) if len(self) else 0

    def check(self) -> None:
        """Assert the structural invariants (cheap; used by tests and debug runs)."""
        n = len(self)
        idx = torch.arange(n)
        assert n >= 1 and int(self.parents[0]) == -1 and int(self.depths[0]) == 0
        assert bool((self.parents[1:] < idx[1:]).all()), "parent-before-child order broken"
        assert bool((self.parents[1:] >= 0).all())
        assert bool((self.depths[1:] == self.depths[self.parents[1:]] + 1).all())
        # siblings carry distinct tokens
        key = self.parents[1:] * (int(self.tokens.max()) + 1) + self.tokens[1:]
        assert key.unique().numel() == n - 1, "duplicate sibling tokens"


def ancestor_mask(parents: torch.Tensor, rows: torch.Tensor, max_depth: int) -> torch.Tensor:
    """(len(rows), N) bool: entry [i, j] is True when node j is node rows[i] or an ancestor of it.

    Walks parent pointers max_depth times, vectorised over rows; no Python loop over nodes.
    """
    n = parents.shape[0]
    k = rows.shape[0]
    out = torch.zeros((k, n), dtype=torch.bool, device=parents.device)
    row_ids = torch.arange(k, device=parents.device)
    cur = rows.clone()
    for _ in range(max_depth + 1):
        live = cur >= 0
        if not bool(live.any()):
            break
        out[row_ids[live], cur[live]] = True
        cur = torch.where(live, parents[cur.clamp(min=0)], cur)
    return out


def tree_positions(depths: torch.Tensor, root_position: int) -> torch.Tensor:
    """Depth-based position ids: a node at depth d sits d tokens after the root."""
    return depths + root_position


def child_with_token(tree: Tree, node: int, token: int) -> int:
    """Index of the child of `node` that carries `token`, or -1."""
    hit = ((tree.parents == node) & (tree.tokens == token)).nonzero()
    return int(hit[0, 0]) if hit.numel() else -1


def path_to(tree: Tree, node: int) -> list[int]:
    """Node indices from the root to `node`, inclusive."""
    path = []
    while node >= 0:
        path.append(node)
        node = int(tree.parents[node])
    return path[::-1]
