"""Draft-free trees (context candidates alone), priced, built and labelled in plain Python.

Without a draft, a step's tree is the trie of its context candidates (context.trie), each node
scored by the acceptance model's chance for its match length (a table of its own for nodes with
a sibling), and cut to the size that pays on this machine (costs.best_size). The general tree
grower (drafting.grow_tree) does this with tensor operations built for trees a draft grows over
many passes: on the starter that cost ~1.6 ms to build a tree and ~0.7 ms to label it after the
pass (torch's per-operation overhead on trees of a few nodes), against a 10-15 ms step; and on
open chat most steps have candidates that do not pay, so most of that was spent on trees never
verified. Here:

- `seed_gains`: each node's chance along its path, best first: what best_size needs to decide
  whether a tree pays at all, before one is built;
- `context_tree`: the tree of the `size` best nodes as a DraftTrace, the one grow_tree and
  drafting.top_nodes would give for the same seeds (the same float32 sums, so the same ties);
- `teach_context`: a verified step's labels (each child of a node on the accepted path,
  accepted or not), as drafting.teach gives them.

What this module does not do: find candidates (context.py), grammar-constrained trees (their
nodes are filtered by the grammar: drafting.grow_tree), or trees with a draft.
"""

from __future__ import annotations

import math
import time

import numpy as np
import torch

from engine.decoding.acceptance import TAUS, AcceptanceModel
from engine.decoding.drafting import DraftTrace, Seeds
from engine.decoding.tree import Tree


def seed_siblings(seeds: Seeds) -> list[bool]:
    """Whether each node of a `trie` shares its parent with another (acceptance.has_sibling)."""
    parents = seeds[1]
    children: dict[int, int] = {}
    for p in parents:
        children[p] = children.get(p, 0) + 1
    return [children[p] > 1 for p in parents]


def _scores(seeds: Seeds, log_chances: list[float], max_depth: int) -> tuple[list[np.float32], list[int]]:
    """Each seed's log chance along its path (float32 sums, as grow_tree adds them), and its
    depth; nodes `max_depth` deep or deeper are the walk's limit and get no score (-inf)."""
    score: list[np.float32] = []
    depth: list[int] = []
    for i, parent in enumerate(seeds[1]):
        d = 1 if parent == 0 else depth[parent - 1] + 1
        own = np.float32(log_chances[i])
        score.append(own if parent == 0 else np.float32(own + score[parent - 1]))
        depth.append(d)
    return [s if d < max_depth else np.float32(-np.inf) for s, d in zip(score, depth)], depth


def seed_gains(seeds: Seeds, log_chances: list[float], max_depth: int, budget: int) -> list[float]:
    """The acceptance chances along the path of each node of a `trie` of candidates (each node's
    log chance given its parent, `log_chances`, summed over its ancestors), best first, at most
    `budget`: the gains drafting.grow_tree's tree of the same seeds has."""
    score, _ = _scores(seeds, log_chances, max_depth)
    kept = sorted((float(s) for s in score if s > -np.inf), reverse=True)
    return [math.exp(s) for s in kept[:budget]]


def context_tree(root: int, seeds: Seeds, shared: list[bool], log_chances: list[float], max_depth: int,
                 size: int) -> DraftTrace:
    """The root and the `size` best-scoring seeds (ties to the older node; a child never scores
    above its parent, so they form a tree), in creation order, as a DraftTrace; `shared`: the
    seeds' sibling flags they were priced with, kept for teach_context."""
    t0 = time.perf_counter()
    score, depth = _scores(seeds, log_chances, max_depth)
    order = sorted((i for i in range(len(score)) if score[i] > -np.inf), key=lambda i: (-score[i], i))
    kept = sorted(order[:size])
    index = {0: 0, **{i + 1: j + 1 for j, i in enumerate(kept)}}
    tokens, parents, matches = seeds
    n = len(kept) + 1
    tree = Tree(tokens=torch.tensor([root, *(tokens[i] for i in kept)], dtype=torch.long),
                parents=torch.tensor([-1, *(index[parents[i]] for i in kept)], dtype=torch.long),
                depths=torch.tensor([0, *(depth[i] for i in kept)], dtype=torch.long),
                logp=torch.tensor([0.0, *(float(score[i]) for i in kept)], dtype=torch.float32))
    return DraftTrace(tree=tree, slots=torch.full((n,), -1, dtype=torch.long), passes=0,
                      seconds=time.perf_counter() - t0, logq=torch.full((n,), math.nan),
                      match=torch.tensor([0, *(matches[i] for i in kept)], dtype=torch.long),
                      logq_t=torch.full((n, len(TAUS)), math.nan), shared=(False, *(shared[i] for i in kept)))


def teach_context(model: AcceptanceModel, trace: DraftTrace, path: list[int], chosen: list[int]) -> None:
    """drafting.teach for a context_tree: every child of a node on the accepted `path` is labelled,
    accepted when it carries the token the target `chosen` there, in the table it was priced
    from (its sibling flag in the trie)."""
    assert trace.shared is not None
    known = min(len(path), len(chosen))
    choice = {path[i]: chosen[i] for i in range(known)}
    parents, tokens, match = trace.tree.parents.tolist(), trace.tree.tokens.tolist(), trace.match.tolist()
    kids = [i for i in range(1, len(parents)) if parents[i] in choice]
    model.observe_context([match[i] for i in kids], [trace.shared[i] for i in kids],
                          [tokens[i] == choice[parents[i]] for i in kids])
