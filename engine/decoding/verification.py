"""One target pass over a draft tree, and the acceptance walk.

Acceptance (SpecExec, lossless by construction): start at the root; at each node take the
target's own next token t (argmax at temperature 0, else one draw from the target's processed
distribution at that node); if a child of the node carries t, descend into it and repeat;
otherwise emit t and stop. Every emitted token is exactly what autoregressive decoding of the
target would choose given the same prefix and the same random draw, so greedy output is
identical and sampled output has the target's distribution; the draft only decides how many
tokens one pass yields. Logits are computed only for the nodes on the walk (a few rows), never
for the whole tree. Imports nothing from the engine but the tree and the model wrapper.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine.decoding.tree import Tree, ancestor_mask, child_with_token, tree_positions
from engine.model.cache import KVCache
from engine.model.causal_lm import CausalLM, causal_allowed


@dataclass(frozen=True)
class Acceptance:
    path: list[int]  # accepted tree nodes, root first (node indices)
    tokens: list[int]  # emitted tokens: those of path[1:] plus the target's own next token


def run_tree(target: CausalLM, cache: KVCache, tree: Tree, pending: torch.Tensor | None = None,
             with_pending: bool = False) -> torch.Tensor:
    """One target pass on top of `cache`: first the committed tokens the target has not read
    yet (`pending`, a causal chain, possibly none: the prompt's uncached tail on a new turn),
    then every tree node (the root is the last committed token). Returns the tree nodes' final
    hidden states (N, hidden); with p pending tokens and `past` = cache.length before the call,
    node i's K/V sits at slot past + p + i. Reading the prompt's tail in the same pass as the
    first tree is what makes a new turn cost one weight pass before its first token.
    `with_pending`: the pending tokens' hidden states come first (p + N rows)."""
    past = cache.length
    p = 0 if pending is None else int(pending.shape[0])
    n = len(tree)
    device = tree.parents.device
    nodes = torch.arange(n, device=device)
    anc = ancestor_mask(tree.parents, nodes, tree.max_depth)  # (N, N)
    allowed = torch.cat([torch.ones((n, past + p), dtype=torch.bool, device=device), anc], dim=1)  # (N, past+p+N)
    tokens, positions = tree.tokens, tree_positions(tree.depths, past + p)
    if p:
        assert pending is not None
        chain = torch.cat([causal_allowed(past, p, device), torch.zeros((p, n), dtype=torch.bool, device=device)],
                          dim=1)  # (p, past+p+N)
        allowed = torch.cat([chain, allowed])
        tokens = torch.cat([pending.to(device), tokens])
        positions = torch.cat([torch.arange(past, past + p, device=device), positions])
    hidden = target.forward(tokens, positions, cache, allowed)
    return hidden if with_pending else hidden[p:]


Sink = Callable[[int, torch.Tensor], None]  # (first position, (n, H) hidden states) of committed tokens


def read_committed(target: CausalLM, cache: KVCache, seq: list[int], sink: Sink | None = None) -> torch.Tensor:
    """One target pass over the committed tokens `seq` it lacks, as a chain (a plain decoding
    step: the root, after a new turn's uncached tail); their hidden states, also to `sink`."""
    past = cache.length
    hidden = target.forward(torch.tensor(seq[past:]), torch.arange(past, len(seq)), cache, None)
    if sink is not None:
        sink(past, target.head_states(hidden))
    return hidden


def committed_states(hidden: torch.Tensor, p: int, path: list[int]) -> torch.Tensor:
    """The target's hidden states of the positions a verification pass commits, from run_tree's
    rows with the `p` pending tokens first: the pending chain, then the accepted path (root first)."""
    return torch.cat([hidden[:p], hidden[p:][torch.tensor(path, device=hidden.device)]])


def accept(
    tree: Tree,
    hidden: torch.Tensor,  # (N, hidden) from run_tree
    logits_of: Callable[[torch.Tensor], torch.Tensor],  # (k, hidden) -> (k, V)
    choose: Callable[[torch.Tensor, list[int]], int],  # ((V,) logits, tokens so far) -> token
    limit: int,
    stop_ids: frozenset[int] = frozenset(),
) -> Acceptance:
    """Walk the tree as described in the module docstring; emit at most `limit` tokens and stop
    after a token in `stop_ids` (EOS). `choose` gets the node's logits and the tokens emitted so
    far, which are the node's path below the root: a request under a grammar masks the logits
    there to the tokens it allows after that path (grammar.py), so the walk is constrained
    plain decoding's, and a node the grammar forbids is never descended into."""
    node, path = 0, [0]
    out: list[int] = []
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


def prune_to_accepted(target_cache: KVCache, past: int, draft_cache: KVCache | None, draft_slots: torch.Tensor,
                      path: list[int], draft_keeps_path: bool = True) -> None:
    """Cut both caches back to the accepted path after a verification pass.

    Cache invariant between steps: each cache holds a prefix of the committed tokens (the
    target's, after a step, all but the last: the root of the next tree); each model reads the
    committed tokens it lacks (its "pending" tokens) at the start of its next pass, the target
    in run_tree's chain, the draft in its pass 0. `past` is the target cache's length before
    the pass plus the pending tokens the pass read (committed, so all kept): node i's entry
    sits at slot past + i, and keeping [0, past) and past + path restores the invariant, since
    the walk emits one token beyond the path (the new root). The draft read the nodes whose `draft_slots` are >= 0; the
    read nodes of any root path form a prefix of it (a node is read only after its parent), so
    the draft keeps its prefix up to the root's slot and then the read prefix of the path.
    A draft head (`draft_keeps_path` False) keeps only its prefix up to the root: its entries
    for tree nodes read its own hidden states, and it reads the accepted tokens again with the
    target's (head_draft), as the references do.
    """
    nodes = torch.tensor(path)
    target_cache.keep(torch.cat([torch.arange(past), past + nodes]))
    if draft_cache is None:
        return
    read = draft_slots[nodes[1:].to(draft_slots.device)]
    read = read[: int((read >= 0).sum())]
    root_slot = int(draft_slots[0])
    if not draft_keeps_path:
        draft_cache.truncate(root_slot + 1)
        return
    draft_cache.keep(torch.cat([torch.arange(root_slot + 1), read.cpu()]))
