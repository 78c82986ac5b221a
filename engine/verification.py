"""One target pass over a draft tree, and the acceptance walk.

Acceptance (SpecExec, lossless by construction): start at the root; at each node take the
target's own next token t (argmax at temperature 0, else one draw from the target's processed
distribution at that node); if a child of the node carries t, descend into it and repeat;
otherwise emit t and stop. Every emitted token is exactly what autoregressive decoding of the
target would choose given the same prefix and the same random draw, so greedy output is
identical and sampled output has the target's distribution; the draft only decides how many
tokens one pass yields. Logits are computed only for the nodes on the walk (a few rows), never
for the whole tree. Imports nothing from the engine but the tree, sampling and model wrapper.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from .cache import KVCache
from .causal_lm import CausalLM
from .tree import Tree, ancestor_mask, child_with_token, tree_positions


@dataclass(frozen=True)
class Acceptance:
    path: list[int]  # accepted tree nodes, root first (node indices)
    tokens: list[int]  # emitted tokens: those of path[1:] plus the target's own next token


def run_tree(target: CausalLM, cache: KVCache, tree: Tree) -> torch.Tensor:
    """Target pass over all tree nodes on top of `cache` (the committed prefix without the
    root). Returns (N, hidden) final hidden states; node i's K/V sits at slot past + i."""
    past = cache.length
    n = len(tree)
    nodes = torch.arange(n, device=tree.parents.device)
    anc = ancestor_mask(tree.parents, nodes, tree.max_depth)  # (N, N)
    allowed = torch.cat([torch.ones((n, past), dtype=torch.bool, device=anc.device), anc], dim=1)
    return target.forward(tree.tokens, tree_positions(tree.depths, past), cache, allowed)


def accept(
    tree: Tree,
    hidden: torch.Tensor,  # (N, hidden) from run_tree
    logits_of: Callable[[torch.Tensor], torch.Tensor],  # (k, hidden) -> (k, V)
    choose: Callable[[torch.Tensor, list[int]], int],  # ((V,) logits, tokens so far) -> token
    limit: int,
    stop_ids: frozenset[int] = frozenset(),
) -> Acceptance:
    """Walk the tree as described in the module docstring; emit at most `limit` tokens and stop
    after a token in `stop_ids` (EOS)."""
    node, path, out = 0, [0], []
    while len(out) < limit:
        token = choose(logits_of(hidden[node : node + 1])[0], out)
        out.append(token)
        if token in stop_ids:
            break
        child = child_with_token(tree, node, token)
        if child < 0:
            break
        node = child
        path.append(child)
    return Acceptance(path=path, tokens=out)
