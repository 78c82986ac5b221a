"""The cache a lean pass's layers see (engine.model.lean_step): fixed buffers whose addresses and
shapes never change between passes, so a CUDA graph can hold the layers that read them.

- Attention's `update` writes the bucket's K/V at the columns held in a device tensor (`slot`)
  and hands back the cache's first `columns`, read under the pass's mask.
- A hybrid's Gated DeltaNet layers (Qwen3.5 / Qwen3.6 / Qwen3-Next) read the LinearCache calls
  (engine.model.linear_state). On committed text (one token that sees the whole cache) the
  token's end state is folded into the committed one in place, as the general path's commit
  does. In a tree (`tree` buckets) the pass's shape is a PassTree of B nodes over fixed tables
  (parents, ancestors and the pointer-jumping tables, filled before each pass by `set_tree`:
  the tree's n nodes, then the pads as roots of their own) and each layer's per-node inputs
  (x, k, v, beta, g: B rows, the graph's outputs) are kept (`pending`) until `hand_over` gives
  the cache their first n rows, as the general path's layers give theirs; the states are only
  read. Only a tree on committed text (nothing pending: no earlier pass's nodes as ancestors)
  comes here.

What this module does not do: run the layers, build masks or capture graphs (lean_step.py).
"""

from __future__ import annotations

import math

import torch

from engine.model.cache import KVCache
from engine.model.hybrid_cache import HybridCache
from engine.model.linear_attention import advance
from engine.model.linear_state import LinearLayerState, LinearPending, NodeInputs, PassTree


class Slots:
    """The cache stand-in of one cache buffer set, bucket and column count (module docstring);
    `tree`: the bucket's size for a hybrid's tree passes, None for steps on committed text."""

    def __init__(self, cache: KVCache, slot: torch.Tensor, columns: int, tree: int | None = None) -> None:
        self.cache, self.slot, self.columns = cache, slot, columns
        self.chain = PassTree.of_chain(1, cache.device, kept_whole=True)
        self.tree: PassTree | None = None
        self.pending: dict[int, LinearPending] = {}  # a tree pass's per-node inputs, by layer (B rows)
        if tree is not None:
            device, levels = cache.device, max(1, math.ceil(math.log2(tree)))
            self.tree = PassTree(torch.full((tree,), -1, dtype=torch.long, device=device), False, False,
                                 torch.eye(tree, dtype=torch.bool, device=device),
                                 tuple(torch.full((tree + 1,), tree, dtype=torch.long, device=device)
                                       for _ in range(levels)))

    def update(self, key: torch.Tensor, value: torch.Tensor, layer_idx: int, *args: object,
               **kwargs: object) -> tuple[torch.Tensor, torch.Tensor]:
        keys, values = self.cache.keys[layer_idx], self.cache.values[layer_idx]
        keys.index_copy_(2, self.slot, key)
        values.index_copy_(2, self.slot, value)
        return keys[:, :, : self.columns], values[:, :, : self.columns]

    def pass_tree(self) -> PassTree:
        return self.tree if self.tree is not None else self.chain

    def linear_state(self, layer_idx: int) -> LinearLayerState:
        assert isinstance(self.cache, HybridCache)
        return self.cache.states[layer_idx]

    def linear_prior(self, layer_idx: int) -> NodeInputs | None:
        return None

    def linear_pending(self, layer_idx: int, pending: LinearPending) -> None:
        if self.tree is None:  # committed text: folded in place
            advance(self.linear_state(layer_idx), pending, None)
        else:
            self.pending[layer_idx] = pending

    def set_tree(self, parents: torch.Tensor) -> None:
        """This pass's tree in the fixed tables: `parents` (n,) of its nodes (-1: the committed
        state), the pads after them each a root seen by nothing else."""
        tree = self.tree
        assert tree is not None
        bucket, n = tree.n, int(parents.shape[0])
        full = torch.cat([parents.to("cpu", torch.long), torch.full((bucket - n,), -1, dtype=torch.long)])
        built = PassTree.from_parents(full, "cpu", chain_ok=False)  # (on the host: a few small ops a depth)
        assert built.ancestors is not None and tree.ancestors is not None
        tree.parents.copy_(built.parents)
        tree.ancestors.copy_(built.ancestors)
        for level, jump in enumerate(tree.jumps):  # levels past the tree's depth jump nowhere (to `bucket`)
            if level < len(built.jumps):
                jump.copy_(built.jumps[level])
            else:
                jump.fill_(bucket)

    def hand_over(self, cache: HybridCache, n: int) -> None:
        """The tree pass's per-node inputs of its n nodes to `cache` (copies: the graphs write
        these buffers again on the next pass)."""
        for i, pending in self.pending.items():
            nodes = pending.nodes
            assert nodes is not None
            cache.linear_pending(i, LinearPending(n, NodeInputs(*(t[:n].clone() for t in (
                nodes.x, nodes.k, nodes.v, nodes.beta, nodes.g))), None))
