"""Speculation trees: SpecExec's dynamic tree (grow_tree), with context candidates, and static
Sequoia trees (grow_static_tree).

A node's score is the log of the estimated chance that the target accepts the path to it: the
sum along the path of each node's calibrated acceptance (acceptance.py: the draft's
probability of its token at a learned draft temperature, and for context candidates the
length of the match that proposed them). The expected tokens of one target pass are 1 + the sum of exp(score) over the
nodes, so the tree we want holds the B best-scoring nodes. We grow it best-first, in batches:

  pass 0   the draft reads its pending tokens (committed tokens it has not seen, the root
           last); context candidates (context.py) enter as a trie below the root, unread.
  pass t   the m best unread nodes (and their unread ancestors: a context chain is read
           together) are read in one forward pass (tree mask over the draft's cache,
           depth-based positions); each yields its top-k draft children (a child that is
           already a context candidate is the same node, now with the draft's probability too).
  after each pass only the B best nodes survive. A child never scores above its parent (an
           acceptance chance is at most 1), so the survivors are closed under "parent of"
           (ties go to the older node, the parent).

Growth stops when no unread node is left above max depth, when a pass on a full tree adds no
node to it, after max_depth passes, or when the nodes the next pass would read hold less
acceptance in total than the pass is worth: their children can add at most that many expected
tokens, and a pass pays only while that gain exceeds the expected tokens so far times the
pass's share of a step's time (`stop_ratio`, measured by the engine; `spec.min_pass_gain`
fixes the threshold instead). Without a draft the tree is the context trie, cut to the budget.
Survivors are kept in creation order, which is parent-before-child; re-sorting by score breaks
that order and with it the verification pass.

The draft's K/V for every node it reads is appended to its cache; `DraftTrace.slots` records
where, so the caller can keep the accepted path's entries and drop the rest. `DraftTrace.logq`,
`.logq_t` and `.match` keep each node's evidence, which the engine labels after verification to
calibrate the acceptance model.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch

from engine.decoding.acceptance import TAUS, AcceptanceModel, has_sibling, log_z, tempered
from engine.decoding.grammar import GrammarState
from engine.decoding.sampling import process_logits
from engine.decoding.sequoia import StaticTree, build_tree
from engine.decoding.tree import Tree, ancestor_mask
from engine.kernels.embedding import leading_rows
from engine.model.cache import KVCache
from engine.model.causal_lm import CausalLM
from engine.model.head_draft import HeadDraft
from engine.types import GenerationRequest, SamplingSettings, SpeculationSettings

Seeds = tuple[list[int], list[int], list[int]]  # context trie below the root: tokens, parents, match


@dataclass(frozen=True)
class DraftTrace:
    tree: Tree
    slots: torch.Tensor  # (N,) long: draft cache slot of each node, -1 if the draft never read it
    passes: int
    seconds: float
    logq: torch.Tensor  # (N,) draft log-probability of each node's token at its parent; NaN if unscored
    match: torch.Tensor  # (N,) long: match length of a context candidate, 0 for draft-only nodes
    logq_t: torch.Tensor  # (N, len(TAUS)): log q of the node's token at its parent at each draft temperature; NaN if unscored
    shared: tuple[bool, ...] | None = None  # a context_tree's nodes with a sibling where it was priced; None: grown here


def scoring_distribution(sampling: SamplingSettings) -> SamplingSettings:
    """The draft distribution whose probabilities the acceptance model calibrates: the
    request's own processing when sampling (the draft imitates the target's processed
    distribution), the plain softmax when greedy; never a per-node repetition penalty."""
    if sampling.greedy:
        return SamplingSettings()
    return SamplingSettings(temperature=sampling.temperature, top_k=sampling.top_k, top_p=sampling.top_p,
                            min_p=sampling.min_p)


COPY_SIMILARITY = 0.5  # mean cosine of embedding rows above which a same-shaped draft is a copy


def copy_of_target(target: CausalLM, draft: CausalLM) -> bool:
    """Whether the draft is a compressed copy of the target (SubSpec's draft: the same model
    quantised harder), so that it may read the target's K/V for the committed tokens
    (`share_context`): the same cache shape and position encoding, and embedding rows that
    point the same way (an unrelated model of the same shape gives cosines near 0)."""
    if isinstance(draft, HeadDraft):  # it reads the target's hidden states, never its K/V
        return False
    t, d = target.shape, draft.shape
    if [spec is None for spec in target.linear] != [spec is None for spec in draft.linear]:
        return False  # a hybrid shares its linear layers' states too: the same layers must be linear
    if target.kv_shapes != draft.kv_shapes:  # Gemma 4: each layer's K/V heads and width
        return False
    if [k.window for k in target.kinds] != [k.window for k in draft.kinds]:  # which entries each layer holds
        return False
    if (t.num_layers, t.num_kv_heads, t.head_dim, t.hidden_size) != (d.num_layers, d.num_kv_heads, d.head_dim,
                                                                       d.hidden_size):
        return False
    for name in ("rope_theta", "rope_scaling", "rope_parameters", "max_position_embeddings"):
        if getattr(target.config, name, None) != getattr(draft.config, name, None):
            return False
    n = min(target.shape.vocab_size, draft.shape.vocab_size, 2048)
    a, b = leading_rows(target.embed, n), leading_rows(draft.embed, n)  # a packed table: only these rows
    if a.is_meta or b.is_meta:
        return False
    n = min(a.shape[0], b.shape[0])
    with torch.inference_mode():
        cos = torch.nn.functional.cosine_similarity(a[:n].float().cpu(), b[:n].float().cpu(), dim=-1)
    return float(cos.mean()) > COPY_SIMILARITY


@torch.inference_mode()
def share_context(draft_cache: KVCache, target_cache: KVCache, synced: int) -> int:
    """The draft's cache takes the target's K/V for every token the target's cache holds, so a
    compressed copy of the target drafts from the target's own view of the text (SubSpec)
    rather than its own drifted one, and reads nothing it would only have computed worse. Its
    entries before `synced` (what the previous call returned) are the target's already; only
    the rest is copied. Returns the new length of both caches."""
    draft_cache.take_entries(target_cache, synced)
    draft_cache.share_states(target_cache)  # a hybrid's linear layers: the target's states
    return target_cache.length


def _read_nodes(draft: CausalLM, cache: KVCache, tokens: torch.Tensor, parents: torch.Tensor,
                depths: torch.Tensor, slots: torch.Tensor, to_expand: torch.Tensor, root_pos: int,
                max_depth: int) -> torch.Tensor:
    """One batched draft pass over the nodes `to_expand` (parent-before-child order; every
    ancestor already read or in the batch): tree mask over the draft's cache, depth-based
    positions. Records their cache slots in `slots` (in place) and returns their hidden states
    (m, H)."""
    device = tokens.device
    m = to_expand.shape[0]
    past = cache.length
    slots[to_expand] = past + torch.arange(m, device=device)  # before the mask: in-batch ancestors
    anc = ancestor_mask(parents, to_expand, max_depth)  # (m, N) node j is ancestor-or-self
    allowed = torch.zeros((m, past + m), dtype=torch.bool, device=device)
    allowed[:, : root_pos + 1] = True  # committed prefix and the root
    rows, cols = (anc & (slots >= 0)[None]).nonzero(as_tuple=True)
    allowed[rows, slots[cols]] = True
    return draft.forward(tokens[to_expand], root_pos + depths[to_expand], cache, allowed)


def _read_pending(draft: CausalLM, cache: KVCache, pending: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Pass 0 of every tree: the draft reads its pending tokens (committed tokens it has not
    seen, the root last) as a causal chain after its cache. Returns the root's hidden state
    (1, H) and the root's cache position."""
    start = cache.length
    hidden = draft.forward(pending, torch.arange(start, start + pending.shape[0]), cache, None)
    return hidden[-1:], cache.length - 1


def _scores(local: torch.Tensor, parents: torch.Tensor, depths: torch.Tensor) -> torch.Tensor:
    """Cumulative log acceptance: each node's own plus its ancestors' (the root 0)."""
    score = torch.zeros_like(local)
    for d in range(1, int(depths.max()) + 1 if depths.numel() else 1):
        at = (depths == d).nonzero()[:, 0]
        score[at] = local[at] + score[parents[at]]
    return score


def grow_tree(
    draft: CausalLM | None,
    cache: KVCache | None,
    pending: torch.Tensor,  # (p,) committed tokens the draft has not read; the last one is the root
    spec: SpeculationSettings,
    sampling: SamplingSettings,
    vocab_limit: int,
    model: AcceptanceModel,
    seeds: Seeds = ([], [], []),
    stop_ratio: float = 0.0,
    grammar: GrammarState | None = None,
) -> DraftTrace:
    """Grow a tree of at most `spec.budget` tokens below the root (see the module docstring).
    With a draft, `cache` holds the committed prefix before the call and afterwards also the
    pending tokens and every node read; without one the tree is the context seeds alone. Under
    a `grammar` (after the committed tokens) every node is one it allows: seeds it forbids are
    left out, and the draft's distribution at each node it expands is masked to the allowed
    tokens (grammar.py)."""
    t0 = time.perf_counter()
    budget, max_depth, k = spec.budget, spec.max_depth, spec.branching
    device = draft.device if draft is not None else torch.device("cpu")
    scoring = scoring_distribution(sampling)
    n_seed = len(seeds[0])
    allowed = grammar.keep([0, *seeds[0]], [-1, *seeds[1]])[1:] if grammar is not None else [True] * n_seed
    keep_seed = [i for i in range(n_seed) if allowed[i] and _depth(seeds[1], i) < max_depth]  # the walk's limit
    tokens = torch.tensor([int(pending[-1]), *(seeds[0][i] for i in keep_seed)], dtype=torch.long, device=device)
    remap = {0: 0, **{i + 1: j + 1 for j, i in enumerate(keep_seed)}}
    parents = torch.tensor([-1, *(remap[seeds[1][i]] for i in keep_seed)], dtype=torch.long, device=device)
    match = torch.tensor([0, *(seeds[2][i] for i in keep_seed)], dtype=torch.long, device=device)
    depths = torch.zeros(tokens.shape[0], dtype=torch.long, device=device)
    for i in range(1, tokens.shape[0]):
        depths[i] = depths[parents[i]] + 1
    logq = torch.full((tokens.shape[0],), math.nan, device=device)
    logq_t = torch.full((tokens.shape[0], len(TAUS)), math.nan, device=device)
    slots = torch.full((tokens.shape[0],), -1, dtype=torch.long, device=device)
    passes = 0
    to_expand = torch.tensor([0], device=device)
    expand_hidden = None
    if draft is not None:
        assert cache is not None
        expand_hidden, root_pos = _read_pending(draft, cache, pending)
        slots[0] = root_pos
        passes = 1

    while True:
        n_old = tokens.shape[0]
        if expand_hidden is not None:  # children of the nodes just read
            assert draft is not None
            q = _draft_distribution(draft.logits(expand_hidden)[:, :vocab_limit], scoring, grammar,
                                    _paths(tokens, parents, to_expand))  # (m, V)
            lz = log_z(q)  # (m, len(TAUS))
            row_of = torch.full((n_old,), -1, dtype=torch.long, device=device)
            row_of[to_expand] = torch.arange(to_expand.shape[0], device=device)
            seeded = (row_of[parents.clamp(min=0)] >= 0) & (parents >= 0) & torch.isnan(logq)
            at = seeded.nonzero()[:, 0]  # context children of read nodes: the draft's view of them
            if at.numel():
                logq[at] = q[row_of[parents[at]], tokens[at].clamp(max=q.shape[-1] - 1)]
                logq_t[at] = tempered(logq[at], lz[row_of[parents[at]]])
            kk = min(k, q.shape[-1])
            child_lp, child_tok = torch.topk(q, kk, dim=-1)  # (m, kk)
            existing = (parents[:, None] == to_expand[None]) & seeded[:, None]  # (N, m)
            is_new = torch.isfinite(child_lp)
            for r in range(to_expand.shape[0]):  # skip children the trie already has
                have = tokens[existing[:, r]]
                if have.numel():
                    is_new[r] &= ~torch.isin(child_tok[r], have)
            new_parent = to_expand[:, None].expand(-1, kk)[is_new]
            tokens = torch.cat([tokens, child_tok[is_new]])
            parents = torch.cat([parents, new_parent])
            depths = torch.cat([depths, depths[new_parent] + 1])
            logq = torch.cat([logq, child_lp[is_new].float()])
            logq_t = torch.cat([logq_t, tempered(child_lp[is_new], lz[:, None, :].expand(-1, kk, -1)[is_new])])
            match = torch.cat([match, torch.zeros_like(new_parent)])
            slots = torch.cat([slots, torch.full_like(new_parent, -1)])
        score = _scores(model.log_accept(logq, match, logq_t, has_sibling(parents)), parents, depths)
        score[0] = 0.0

        # keep the root and the `budget` best other nodes, in creation order
        n = tokens.shape[0]
        added = n - n_old
        if n - 1 > budget:
            order = torch.sort(-score[1:], stable=True).indices[:budget] + 1
            keep = torch.cat([torch.zeros(1, dtype=torch.long, device=device), order.sort().values])
            index = torch.full((n,), -1, dtype=torch.long, device=device)
            index[keep] = torch.arange(keep.shape[0], device=device)
            new_parents = parents[keep]
            new_parents[1:] = index[new_parents[1:]]
            assert bool((new_parents[1:] >= 0).all()), "a kept node lost its parent"
            added = int((keep >= n_old).sum())
            tokens, parents, depths, logq, match, logq_t, slots, score = (
                tokens[keep], new_parents, depths[keep], logq[keep], match[keep], logq_t[keep], slots[keep], score[keep])
        full = tokens.shape[0] - 1 >= budget

        if draft is None or passes > max_depth or (full and added == 0 and expand_hidden is not None):
            break
        to_expand = _next_batch(score, slots, parents, depths, max_depth, full, spec.nodes_per_draft_pass)
        if to_expand.numel() == 0:
            break
        gain = float(score[to_expand].exp().sum())  # the most expected tokens their children add
        expected = 1.0 + float(score[1:].exp().sum())
        threshold = spec.min_pass_gain if spec.min_pass_gain is not None else expected * stop_ratio
        if gain < threshold:
            break
        assert cache is not None
        expand_hidden = _read_nodes(draft, cache, tokens, parents, depths, slots, to_expand, int(slots[0]), max_depth)
        passes += 1

    tree = Tree(tokens=tokens, parents=parents, depths=depths, logp=score)
    return DraftTrace(tree=tree, slots=slots, passes=passes, seconds=time.perf_counter() - t0, logq=logq, match=match,
                      logq_t=logq_t)


def _draft_distribution(logits: torch.Tensor, scoring: SamplingSettings, grammar: GrammarState | None,
                        paths: list[list[int]]) -> torch.Tensor:
    """(m, V) draft logits at nodes with these paths below the root -> the processed draft
    log-distribution, restricted to the tokens the grammar allows there (a row with none: all
    -inf, so the node gets no children)."""
    if grammar is None:
        return process_logits(logits, scoring)
    allowed = torch.from_numpy(grammar.masks(paths)[:, : logits.shape[-1]]).to(logits.device)  # (m, V)
    q = process_logits(logits.masked_fill(~allowed, -math.inf), scoring)
    return q.masked_fill(~allowed.any(-1, keepdim=True), -math.inf)  # a row with nothing allowed is NaN


def _paths(tokens: torch.Tensor, parents: torch.Tensor, nodes: torch.Tensor) -> list[list[int]]:
    """Each node's tokens below the root (root excluded), read off the parent pointers."""
    toks, pars = tokens.tolist(), parents.tolist()
    out = []
    for node in nodes.tolist():
        path = []
        while node > 0:
            path.append(toks[node])
            node = pars[node]
        out.append(path[::-1])
    return out


def top_nodes(trace: DraftTrace, count: int) -> DraftTrace:
    """The root and the `count` best-scoring nodes of a tree (a tree again: a child never
    scores above its parent, ties go to the older node), in creation order."""
    tree = trace.tree
    n = len(tree)
    if count >= n - 1:
        return trace
    order = torch.sort(-tree.logp[1:], stable=True).indices[:count] + 1
    return keep_nodes(trace, torch.cat([torch.zeros(1, dtype=torch.long, device=order.device), order.sort().values]))


def allowed_nodes(trace: DraftTrace, grammar: GrammarState) -> DraftTrace:
    """The tree without the nodes the grammar forbids (and their subtrees)."""
    tree = trace.tree
    kept = grammar.keep(tree.tokens.tolist(), tree.parents.tolist())
    if all(kept):
        return trace
    return keep_nodes(trace, torch.tensor(kept, device=tree.tokens.device).nonzero()[:, 0])


def keep_nodes(trace: DraftTrace, keep: torch.Tensor) -> DraftTrace:
    """The nodes `keep` (ascending indices, the root first, each node's parent among them) as a
    tree of their own, in creation order."""
    tree = trace.tree
    n = len(tree)
    index = torch.full((n,), -1, dtype=torch.long, device=keep.device)
    index[keep] = torch.arange(keep.shape[0], device=keep.device)
    parents = tree.parents[keep]
    parents[1:] = index[parents[1:]]
    assert bool((parents[1:] >= 0).all()), "a kept node lost its parent"
    cut = Tree(tokens=tree.tokens[keep], parents=parents, depths=tree.depths[keep], logp=tree.logp[keep])
    return DraftTrace(cut, trace.slots[keep], trace.passes, trace.seconds, trace.logq[keep], trace.match[keep],
                      trace.logq_t[keep])


def _depth(parents: list[int], i: int) -> int:
    """Depth of seed i (0-based) below the root."""
    d, node = 1, parents[i]
    while node > 0:
        d, node = d + 1, parents[node - 1]
    return d


def _next_batch(score: torch.Tensor, slots: torch.Tensor, parents: torch.Tensor, depths: torch.Tensor,
                max_depth: int, full: bool, per_pass: int) -> torch.Tensor:
    """The best unread nodes for the next draft pass, with their unread ancestors (a context
    chain is read in one go), at most `per_pass` nodes, parent-before-child order."""
    useful = (slots < 0) & (depths < max_depth)
    useful[0] = False
    if full:  # a child scores below its parent: only nodes above the worst survivor can add one
        useful &= score > score[1:].min()
    unread = useful.nonzero()[:, 0]
    chosen: set[int] = set()
    # plain lists for the walk: an element of a device tensor read in a loop waits for the device
    # each time (on a GPU ~2 ms a draft pass went to these reads)
    slot, parent = slots.tolist(), parents.tolist()
    for node in unread[torch.sort(-score[unread], stable=True).indices].tolist():
        chain = []
        while node > 0 and slot[node] < 0 and node not in chosen:
            chain.append(node)
            node = parent[node]
        if len(chosen) + len(chain) > per_pass:
            if chosen:
                break
            chain = chain[-per_pass:]  # the chain's top part: its ancestors first
        chosen.update(chain)
        if len(chosen) >= per_pass:
            break
    return torch.tensor(sorted(chosen), dtype=torch.long, device=score.device)


def grow_static_tree(
    draft: CausalLM,
    cache: KVCache,
    pending: torch.Tensor,  # (p,) tokens the draft has not read; the last one is the root
    shape: StaticTree,
    spec: SpeculationSettings,
    sampling: SamplingSettings,
    vocab_limit: int,
    grammar: GrammarState | None = None,
) -> DraftTrace:
    """Fill a static Sequoia tree shape (sequoia.build_tree) with draft tokens: one draft pass
    per level; the child of rank r of a node carries the node's (r+1)-th likeliest draft token
    (deterministic top-k, so siblings are distinct). Only nodes with children are read, so the
    read nodes of any root path form a prefix of it (the engine's cache pruning relies on it).
    Verification is the same walk as for SpecExec trees, hence lossless. Under a `grammar` the
    ranks are those of the masked draft distribution, and the nodes it forbids (ranks beyond
    the allowed tokens) are cut from the shape at the end."""
    t0 = time.perf_counter()
    scoring = scoring_distribution(sampling)
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
        q = _draft_distribution(draft.logits(expand_hidden)[:, :vocab_limit], scoring, grammar,
                                _paths(tokens, parents, expand))  # (m, V)
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
    trace = DraftTrace(tree=tree, slots=slots, passes=passes, seconds=time.perf_counter() - t0,
                       logq=torch.full((n,), math.nan, device=device),
                       match=torch.zeros(n, dtype=torch.long, device=device),
                       logq_t=torch.full((n, len(TAUS)), math.nan, device=device))
    return trace if grammar is None else allowed_nodes(trace, grammar)


def grow(draft: CausalLM, cache: KVCache, pending: torch.Tensor, request: GenerationRequest, vocab_limit: int,
         model: AcceptanceModel, seeds: Seeds, stop_ratio: float, grammar: GrammarState | None,
         shapes: dict[tuple[tuple[float, ...], int, int], StaticTree]) -> DraftTrace:
    """The draft's tree for a request: a static Sequoia shape (`shapes` keeps each one built:
    the DP takes up to seconds for large budgets) or SpecExec's best-first growth."""
    spec = request.speculation
    if spec.tree_mode == "sequoia":
        key = (spec.rank_acceptance, spec.budget, spec.max_depth)
        if key not in shapes:
            shapes[key] = build_tree(*key)
        return grow_static_tree(draft, cache, pending, shapes[key], spec, request.sampling, vocab_limit, grammar)
    return grow_tree(draft, cache, pending, spec, request.sampling, vocab_limit, model, seeds, stop_ratio, grammar)


def teach(model: AcceptanceModel, trace: DraftTrace, path: list[int], chosen: list[int]) -> None:
    """Label every child of a node on the accepted `path` of a step's tree: accepted when it
    carries the token the target `chosen` there."""
    tree = trace.tree
    known = min(len(path), len(chosen))
    choice = torch.full((len(tree),), -1, dtype=torch.long, device=tree.tokens.device)
    choice[torch.tensor(path[:known], device=choice.device)] = torch.tensor(chosen[:known], device=choice.device)
    kids = (tree.parents >= 0).nonzero()[:, 0]
    kids = kids[choice[tree.parents[kids]] >= 0]
    if kids.numel():
        model.observe(trace.logq[kids], trace.match[kids], trace.logq_t[kids],
                      tree.tokens[kids] == choice[tree.parents[kids]], has_sibling(tree.parents)[kids.cpu()])
