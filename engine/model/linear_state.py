"""The state of Gated DeltaNet layers in a tree pass (linear_attention.py computes with them):
a layer's committed state, the shape of a pass's tree over pending and new tokens, the per-node
inputs a pass hands back until the accepted path is known, and what the cache passed to a
layer provides (`LinearCache`, which engine.model.hybrid_cache implements)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch


@dataclass
class LinearLayerState:
    """The committed state of one linear layer for one sequence."""

    conv: torch.Tensor  # (1, conv_dim, kernel - 1) the last pre-conv inputs, model dtype
    recurrent: torch.Tensor  # (1, H_v, dk, dv) fp32, as transformers keeps it

    @classmethod
    @torch.inference_mode()
    def zeros(cls, conv_dim: int, kernel: int, num_v_heads: int, dk: int, dv: int,
              dtype: torch.dtype, device: torch.device | str) -> LinearLayerState:
        return cls(torch.zeros(1, conv_dim, kernel - 1, dtype=dtype, device=device),
                   torch.zeros(1, num_v_heads, dk, dv, dtype=torch.float32, device=device))

    @torch.inference_mode()
    def clone(self) -> LinearLayerState:
        return LinearLayerState(self.conv.clone(), self.recurrent.clone())

    @torch.inference_mode()
    def to(self, device: torch.device | str) -> LinearLayerState:
        """Self, moved to `device`."""
        self.conv, self.recurrent = self.conv.to(device), self.recurrent.to(device)
        return self

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(conv, recurrent), for saving."""
        return self.conv, self.recurrent

    @classmethod
    @torch.inference_mode()
    def from_tensors(cls, conv: torch.Tensor, recurrent: torch.Tensor,
                     device: torch.device | str) -> LinearLayerState:
        assert conv.dim() == 3 and recurrent.dim() == 4 and recurrent.dtype == torch.float32
        return cls(conv.to(device).clone(), recurrent.to(device).clone())

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())


@dataclass(frozen=True)
class PassTree:
    """The shape of one pass's n tokens, built once per pass and read by every linear layer.

    Invariant: parents[i] < i; -1 means the node hangs off the committed state."""

    parents: torch.Tensor  # (n,) long, on the model's device
    chain: bool  # parents == [-1, 0, ..., n-2]
    kept_whole: bool  # a chain the caller keeps in full (prefill): layers hand back no per-node inputs
    ancestors: torch.Tensor | None  # (n, n) bool, [j, i]: i is j or an ancestor of j; None for a chain
    jumps: tuple[torch.Tensor, ...]  # (n + 1,) long each: 2^t-th ancestors, n = none (pointer jumping)

    @property
    def n(self) -> int:
        return int(self.parents.shape[0])

    @classmethod
    def of_chain(cls, n: int, device: torch.device | str, kept_whole: bool = False) -> PassTree:
        parents = torch.arange(-1, n - 1, device=device)
        return cls(parents, True, kept_whole, None, ())

    @classmethod
    def from_parents(cls, parents: torch.Tensor | Sequence[int], device: torch.device | str,
                     chain_ok: bool = True) -> PassTree:
        """One host read of the parents; every table built on `device`. `chain_ok=False` keeps
        the tree form for a chain (the cache's pending tokens come first in it)."""
        ps = [int(p) for p in (parents.tolist() if isinstance(parents, torch.Tensor) else parents)]
        n = len(ps)
        depth = [0] * n
        for i, p in enumerate(ps):
            if not -1 <= p < i:
                raise ValueError(f"token {i} has parent {p}: parents must come first")
            depth[i] = 1 if p < 0 else depth[p] + 1
        if chain_ok and all(p == i - 1 for i, p in enumerate(ps)):
            return cls.of_chain(n, device)
        par = torch.tensor(ps, dtype=torch.long, device=device)
        ancestors = torch.eye(n, dtype=torch.bool, device=device)
        by_depth: dict[int, list[int]] = {}
        for i, d in enumerate(depth):
            by_depth.setdefault(d, []).append(i)
        for d in range(2, max(depth) + 1):  # a row is complete once its parent's level is done
            rows = torch.tensor(by_depth[d], device=device)
            ancestors[rows] |= ancestors[par[rows]]
        jump = torch.cat([torch.where(par >= 0, par, n), torch.tensor([n], device=device)])  # (n + 1,)
        jumps = []
        for _ in range(math.ceil(math.log2(max(depth)))):
            jumps.append(jump)
            jump = jump[jump]
        return cls(par, False, False, ancestors, tuple(jumps))

    def path_sums(self, g: torch.Tensor) -> torch.Tensor:
        """(H, n) -> (H, n): each node's sum of g over its root-to-node path (itself included)."""
        if self.chain:
            return g.cumsum(-1)
        total = torch.cat([g, g.new_zeros(g.shape[0], 1)], -1)  # column n: "no ancestor", stays 0
        for jump in self.jumps:
            total = total + total[:, jump]
        return total[:, :-1]

    def conv_windows(self, kernel: int) -> torch.Tensor:
        """(n, kernel) long: each node's conv inputs, oldest first, as indices into
        [committed conv columns (kernel - 1), this pass's tokens (n)]."""
        km1 = kernel - 1
        own = torch.arange(self.n, device=self.parents.device) + km1
        committed_parent = (torch.arange(km1, device=own.device) - 1).clamp(min=0)  # col 0: never read
        ext_parent = torch.cat([committed_parent, torch.where(self.parents >= 0, self.parents + km1, km1 - 1)])
        cols = [own]
        for _ in range(km1):
            cols.append(ext_parent[cols[-1]])
        return torch.stack(cols[::-1], dim=1)


@dataclass(frozen=True)
class NodeInputs:
    """Per-node inputs of one layer's pass, enough to replay any root-to-node path."""

    x: torch.Tensor  # (n, conv_dim) pre-conv inputs, model dtype
    k: torch.Tensor  # (n, H_k, dk) post-conv keys, not normalised, model dtype
    v: torch.Tensor  # (n, H_v, dv) post-conv values, model dtype
    beta: torch.Tensor  # (n, H_v) model dtype
    g: torch.Tensor  # (n, H_v) fp32 log-decay


@dataclass(frozen=True)
class LinearPending:
    """What one layer's pass hands back for `advance`: per-node inputs (None for a chain kept
    whole) and, for a chain, the state after all of it."""

    n: int
    nodes: NodeInputs | None
    end: LinearLayerState | None


@runtime_checkable
class LinearCache(Protocol):
    """What `TreeGatedDeltaNet` needs from the `past_key_values` object of a pass."""

    def pass_tree(self) -> PassTree:
        """This pass's shape, built once per pass (`PassTree.from_parents`, `PassTree.of_chain`)."""
        ...

    def linear_state(self, layer_idx: int) -> LinearLayerState:
        """The layer's committed state; the pass only reads it."""
        ...

    def linear_pending(self, layer_idx: int, pending: LinearPending) -> None:
        """Keep `pending` until the accepted path is known, then `advance(state, pending, path)`."""
        ...

    def linear_prior(self, layer_idx: int) -> NodeInputs | None:
        """The inputs of the tokens earlier passes read that are not yet folded into the
        committed state (a draft's tree grows over several passes), or None. When given, the
        pass tree covers them first, then this pass's tokens."""
        ...
