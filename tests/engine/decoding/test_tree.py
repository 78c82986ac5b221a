"""tree.py: masks and lookups against brute-force recomputation on random trees."""

from __future__ import annotations

import torch

from engine.decoding.tree import Tree, ancestor_mask, child_with_token, path_to


def random_tree(n: int, seed: int) -> Tree:
    g = torch.Generator().manual_seed(seed)
    parents = [-1]
    depths = [0]
    tokens = [5]
    used: set[tuple[int, int]] = set()
    while len(parents) < n:
        p = int(torch.randint(0, len(parents), (), generator=g))
        t = int(torch.randint(0, 50, (), generator=g))
        if (p, t) in used:
            continue
        used.add((p, t))
        parents.append(p)
        depths.append(depths[p] + 1)
        tokens.append(t)
    return Tree(torch.tensor(tokens), torch.tensor(parents), torch.tensor(depths), torch.zeros(n))


def test_ancestor_mask_matches_parent_walk() -> None:
    for seed in range(5):
        tree = random_tree(60, seed)
        tree.check()
        rows = torch.arange(len(tree))
        mask = ancestor_mask(tree.parents, rows, tree.max_depth)
        for i in range(len(tree)):
            expected = set(path_to(tree, i))
            assert set(mask[i].nonzero()[:, 0].tolist()) == expected


def test_ancestor_mask_subset_of_rows() -> None:
    tree = random_tree(30, 9)
    rows = torch.tensor([29, 3, 0])
    full = ancestor_mask(tree.parents, torch.arange(30), tree.max_depth)
    assert torch.equal(ancestor_mask(tree.parents, rows, tree.max_depth), full[rows])


def test_child_with_token() -> None:
    tree = random_tree(40, 3)
    for i in range(1, 40):
        p, t = int(tree.parents[i]), int(tree.tokens[i])
        assert child_with_token(tree, p, t) == i
    assert child_with_token(tree, 0, 999) == -1
