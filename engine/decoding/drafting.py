"""Draft trees: SpecExec's dynamic tree (grow_tree) and static Sequoia trees (grow_static_tree).

The tree SpecExec wants is (approximately) the B most likely continuations under the draft: the
B nodes with the highest cumulative draft log-probability. We grow it best-first, in batches:

  pass 0   the draft reads its pending tokens (the root and any accepted tokens it has not
           seen); the root's distribution gives its top-k children.
  pass t   the m best nodes of the current tree that the draft has not read yet are read in one
           forward pass (tree mask over the draft's cache, depth-based positions); each yields
           its top-k children (unique tokens, score = parent score + log q(child)).
  after each pass only the B best nodes survive. A child never scores above its parent and the
           B-th best score only rises, so an evicted node can never come back, and the
           survivors are closed under "parent of" (ties go to the older node, the parent).

Growth stops when no unread node is left above max depth, when a pass on a full tree adds no
node to it (the best new candidates cannot enter the budget), when the nodes the next pass
would read hold less than `min_pass_gain` draft probability in total (a child's probability is
at most its parent's, so that bounds the expected accepted tokens the pass could add), or
after max_depth passes. On a full tree only nodes scoring above the worst survivor are read.
Survivors are kept in creation order, which is parent-before-child; re-sorting by score (as the
reference code does after its top-k) breaks that order and with it the verification pass.

The draft's K/V for every node it reads is appended to its cache; `DraftTrace.slots` records
where, so the caller can keep the accepted path's entries and drop the rest.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

import torch

from engine.decoding.sampling import process_logits
from engine.decoding.sequoia import StaticTree
from engine.decoding.tree import Tree, ancestor_mask
from engine.model.cache import KVCache
from engine.model.causal_lm import CausalLM
from engine.types import SamplingSettings, SpeculationSettings


@dataclass(frozen=True)
class DraftTrace:
    tree: Tree
    slots: torch.Tensor  # (N,) long: draft cache slot of each node, -1 if the draft never read it
    passes: int
    seconds: float


def _scoring(sampling: SamplingSettings, spec: SpeculationSettings) -> SamplingSettings:
    if sampling.greedy:
        return SamplingSettings(temperature=spec.greedy_draft_temperature)
    return replace(sampling, repetition_penalty=1.0)  # per-node histories are not worth it


def _read_nodes(draft: CausalLM, cache: KVCache, tokens: torch.Tensor, parents: torch.Tensor,
                depths: torch.Tensor, slots: torch.Tensor, to_expand: torch.Tensor, root_pos: int,
                max_depth: int) -> torch.Tensor:
    """One batched draft pass over the nodes `to_expand` (parent-before-child order; every
    ancestor already read): tree mask over the draft's cache, depth-based positions. Records
    their cache slots in `slots` (in place) and returns their hidden states (m, H)."""
    device = tokens.device
    m = to_expand.shape[0]
    past = cache.length
    anc = ancestor_mask(parents, to_expand, max_depth)  # (m, N) node j is ancestor-or-self
    allowed = torch.zeros((m, past + m), dtype=torch.bool, device=device)
    allowed[:, : root_pos + 1] = True  # committed prefix and the root
    rows, cols = (anc & (slots >= 0)[None]).nonzero(as_tuple=True)
    allowed[rows, slots[cols]] = True
    allowed[torch.arange(m, device=device), past + torch.arange(m, device=device)] = True
    hidden = draft.forward(tokens[to_expand], root_pos + depths[to_expand], cache, allowed)
    slots[to_expand] = past + torch.arange(m, device=device)
    return hidden


def _read_pending(draft: CausalLM, cache: KVCache, pending: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Pass 0 of every tree: the draft reads its pending tokens (committed tokens it has not
    seen, the root last) as a causal chain after its cache. Returns the root's hidden state
    (1, H) and the root's cache position."""
    start = cache.length
    hidden = draft.forward(pending, torch.arange(start, start + pending.shape[0]), cache, None)
    return hidden[-1:], cache.length - 1


def grow_tree(
    draft: CausalLM,
    cache: KVCache,
    pending: torch.Tensor,  # (p,) tokens the draft has not read; the last one is the root
    spec: SpeculationSettings,
    sampling: SamplingSettings,
    vocab_limit: int,
) -> DraftTrace:
    """Grow a tree of at most `spec.budget` draft tokens below the root. `cache` holds the
    committed prefix before the call; after it, also the pending tokens and every node read."""
    t0 = time.perf_counter()
    budget, max_depth, k = spec.budget, spec.max_depth, spec.branching
    per_pass = spec.nodes_per_draft_pass
    device = draft.device
    # Node scores estimate the chance the target accepts the path: under sampling that is the
    # target's processed distribution, which the draft imitates with the same settings; under
    # greedy decoding it is the chance of being the argmax, sharper than the draft's softmax.
    scoring = _scoring(sampling, spec)

    expand_hidden, root_pos = _read_pending(draft, cache, pending)
    tokens = pending[-1:].to(device).long()
    parents = torch.tensor([-1], device=device)
    depths = torch.tensor([0], device=device)
    logp = torch.zeros(1, device=device)
    slots = torch.tensor([root_pos], device=device)
    to_expand = torch.tensor([0], device=device)
    passes = 1

    while True:
        # children of the nodes just read
        q = process_logits(draft.logits(expand_hidden)[:, :vocab_limit], scoring)  # (m, V)
        kk = min(k, q.shape[-1])
        child_lp, child_tok = torch.topk(q, kk, dim=-1)  # (m, kk)
        child_lp = child_lp + logp[to_expand][:, None]
        ok = torch.isfinite(child_lp)
        n_old = tokens.shape[0]
        tokens = torch.cat([tokens, child_tok[ok]])
        parents = torch.cat([parents, to_expand[:, None].expand(-1, kk)[ok]])
        depths = torch.cat([depths, (depths[to_expand] + 1)[:, None].expand(-1, kk)[ok]])
        logp = torch.cat([logp, child_lp[ok]])
        slots = torch.cat([slots, torch.full((int(ok.sum()),), -1, device=device)])

        # keep the root and the `budget` best other nodes, in creation order
        n = tokens.shape[0]
        if n - 1 > budget:
            order = torch.sort(-logp[1:], stable=True).indices[:budget] + 1
            keep = torch.cat([torch.zeros(1, dtype=torch.long, device=device), order.sort().values])
            remap = torch.full((n,), -1, dtype=torch.long, device=device)
            remap[keep] = torch.arange(keep.shape[0], device=device)
            new_parents = parents[keep]
            new_parents[1:] = remap[new_parents[1:]]
            assert bool((new_parents[1:] >= 0).all()), "a kept node lost its parent"
            added = int((keep >= n_old).sum())
            tokens, parents, depths, logp, slots = tokens[keep], new_parents, depths[keep], logp[keep], slots[keep]
        else:
            added = n - n_old
        full = tokens.shape[0] - 1 >= budget

        if passes > max_depth or (full and added == 0):
            break
        useful = (slots < 0) & (depths < max_depth)
        if full:  # a child scores below its parent: only nodes above the worst survivor can add one
            useful &= logp > logp[1:].min()
        unread = useful.nonzero()[:, 0]
        if unread.numel() == 0:
            break
        best = torch.sort(-logp[unread], stable=True).indices[:per_pass]
        if float(logp[unread[best]].exp().sum()) < spec.min_pass_gain:
            break
        to_expand = unread[best].sort().values  # (m,) parent-before-child order

        expand_hidden = _read_nodes(draft, cache, tokens, parents, depths, slots, to_expand, root_pos, max_depth)
        passes += 1

    tree = Tree(tokens=tokens, parents=parents, depths=depths, logp=logp)
    return DraftTrace(tree=tree, slots=slots, passes=passes, seconds=time.perf_counter() - t0)


def grow_static_tree(
    draft: CausalLM,
    cache: KVCache,
    pending: torch.Tensor,  # (p,) tokens the draft has not read; the last one is the root
    shape: StaticTree,
    spec: SpeculationSettings,
    sampling: SamplingSettings,
    vocab_limit: int,
) -> DraftTrace:
    """Fill a static Sequoia tree shape (sequoia.build_tree) with draft tokens: one draft pass
    per level; the child of rank r of a node carries the node's (r+1)-th likeliest draft token
    (deterministic top-k, so siblings are distinct). Only nodes with children are read, so the
    read nodes of any root path form a prefix of it (the engine's cache pruning relies on it).
    Verification is the same walk as for SpecExec trees, hence lossless."""
    t0 = time.perf_counter()
    scoring = _scoring(sampling, spec)
    device = draft.device
    root_hidden, root_pos = _read_pending(draft, cache, pending)
    n = len(shape.parents)
    parents = torch.tensor(shape.parents, device=device)
    ranks = torch.tensor(shape.ranks, device=device)
    depths = torch.tensor(shape.depths, device=device)
    tokens = torch.zeros(n, dtype=torch.long, device=device)
    tokens[0] = pending[-1]
    logp = torch.zeros(n, device=device)
    slots = torch.full((n,), -1, device=device)
    slots[0] = root_pos
    has_children = torch.bincount(parents[1:], minlength=n) > 0 if n > 1 else torch.zeros(1, dtype=torch.bool)
    kmax = int(ranks.max()) + 1 if n > 1 else 1
    expand, expand_hidden, passes = torch.tensor([0], device=device), root_hidden, 1
    row_of = torch.full((n,), -1, dtype=torch.long, device=device)
    for level in range(1, shape.max_depth + 1):
        q = process_logits(draft.logits(expand_hidden)[:, :vocab_limit], scoring)  # (m, V)
        child_lp, child_tok = torch.topk(q, min(kmax, q.shape[-1]), dim=-1)  # (m, k)
        kids = (depths == level).nonzero()[:, 0]
        row_of[expand] = torch.arange(expand.shape[0], device=device)
        rows, r = row_of[parents[kids]], ranks[kids].clamp(max=child_tok.shape[-1] - 1)
        tokens[kids] = child_tok[rows, r]
        logp[kids] = logp[parents[kids]] + child_lp[rows, r]
        expand = kids[has_children[kids]]
        if expand.numel() == 0:
            break
        expand_hidden = _read_nodes(draft, cache, tokens, parents, depths, slots, expand, root_pos, shape.max_depth)
        passes += 1
    tree = Tree(tokens=tokens, parents=parents, depths=depths, logp=logp)
    return DraftTrace(tree=tree, slots=slots, passes=passes, seconds=time.perf_counter() - t0)
