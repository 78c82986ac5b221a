"""The cache of a hybrid model: K/V by position for its attention layers, a recurrent state per
Gated DeltaNet layer (linear_attention.py), kept consistent through tree passes and pruning.

A linear layer's memory is not a list of entries that can be gathered: it is one state after
the committed tokens. So the entries of this cache are in two parts:

- entries [0, committed) are folded into each linear layer's state;
- entries [committed, length) were read by passes whose tokens may still be cut (a verified
  tree, a draft's tree grown over several passes). Each linear layer keeps their inputs
  (`NodeInputs`), and every entry its parent slot, so a later pass reads them as ancestors
  (`linear_prior`), and `keep` replays the kept path from the state (`advance`).

A pass without a mask (`allowed` None: a prefill chunk, a plain decoding step, a draft's read
of committed tokens) is committed text: when nothing is pending it is folded at once. The
attention layers' K/V behave exactly as in KVCache.

A recurrent state cannot be rolled back, so the cache keeps snapshots of the linear states at
the points `mark` names (the engine marks each prompt's end: the next turn's prompt starts with
this one's, while the answer's tokens may be re-tokenised differently when the next turn renders
it). Cutting below `committed` (`truncate`, `copy_prefix`) goes back to the last snapshot at or
before the cut, or empties the cache; the engine then reads the rest again (lossless). The
newest SNAPSHOTS are kept. Saved to disk (cache_files), a cache carries its states and
snapshots beside its K/V (`state_tensors`, `from_saved`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.model.cache import KVCache

SNAPSHOTS = 2  # per cache: this turn's prompt end and the previous one
from engine.model.linear_attention import TILED, advance
from engine.model.linear_state import LinearLayerState, LinearPending, NodeInputs, PassTree


@dataclass(frozen=True)
class LinearSpec:
    """The state shape of one Gated DeltaNet layer."""

    conv_dim: int
    kernel: int
    num_v_heads: int
    head_k_dim: int
    head_v_dim: int
    tiled: bool = False  # value heads in llama.cpp's order (engine.model.linear_attention.TILED)

    @classmethod
    def of_config(cls, config: object) -> LinearSpec:
        def get(key: str) -> int:
            return int(getattr(config, key))

        key_dim = get("linear_num_key_heads") * get("linear_key_head_dim")
        value_dim = get("linear_num_value_heads") * get("linear_value_head_dim")
        return cls(2 * key_dim + value_dim, get("linear_conv_kernel_dim"), get("linear_num_value_heads"),
                   get("linear_key_head_dim"), get("linear_value_head_dim"), bool(getattr(config, TILED, False)))


def _cat_nodes(a: NodeInputs | None, b: NodeInputs) -> NodeInputs:
    if a is None:
        return b
    return NodeInputs(torch.cat([a.x, b.x]), torch.cat([a.k, b.k]), torch.cat([a.v, b.v]),
                      torch.cat([a.beta, b.beta]), torch.cat([a.g, b.g]))


def _slice_nodes(a: NodeInputs, n: int) -> NodeInputs | None:
    if n <= 0:
        return None
    return NodeInputs(a.x[:n], a.k[:n], a.v[:n], a.beta[:n], a.g[:n])


class HybridCache(KVCache):
    """KVCache for the attention layers plus the linear layers' states (module docstring).
    `linear[i]` is layer i's state shape, None for an attention layer (whose K/V this keeps;
    a linear layer's K/V buffers are empty)."""

    parents: torch.Tensor  # (capacity,) each entry's parent slot, on the CPU (-1: none)

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device | str, capacity: int = 256,
                 linear: list[LinearSpec | None] | None = None) -> None:
        self.linear: list[LinearSpec | None] = list(linear or [None] * num_layers)
        super().__init__(num_layers, num_kv_heads, head_dim, dtype, device, capacity)
        self.states: dict[int, LinearLayerState] = {}
        self.committed = 0
        self.prior: dict[int, NodeInputs | None] = {}
        self._pass_tree: PassTree | None = None
        self._pass_fold = False
        self._pass_parents: torch.Tensor | None = None
        self._pass_pending: dict[int, LinearPending] = {}
        self.marks: set[int] = set()
        self.snapshots: dict[int, dict[int, LinearLayerState]] = {}  # committed position -> states
        self._reset_states()

    # ---- storage --------------------------------------------------------------------------
    def _kv_width(self, layer: int) -> int:
        return 0 if self.linear[layer] is not None else self.head_dim

    @torch.inference_mode()
    def _grow(self, capacity: int) -> None:
        keys = [torch.empty((1, self.num_kv_heads, capacity, self._kv_width(i)), dtype=self.dtype, device=self.device)
                for i in range(self.num_layers)]
        values = [torch.empty_like(k) for k in keys]
        for new, old in zip(keys + values, self.keys + self.values):
            new[:, :, : self.length] = old[:, :, : self.length]
        positions = torch.arange(capacity, dtype=torch.long, device=self.device)
        positions[: self.length] = self.positions[: self.length]
        parents = torch.full((capacity,), -1, dtype=torch.long)
        if hasattr(self, "parents"):
            parents[: self.length] = self.parents[: self.length]
        self.keys, self.values, self.positions, self.capacity = keys, values, positions, capacity
        self.parents = parents  # each entry's parent slot (CPU; -1: none)

    def _reset_states(self) -> None:
        self.states = {i: LinearLayerState.zeros(s.conv_dim, s.kernel, s.num_v_heads, s.head_k_dim, s.head_v_dim,
                                                 self.dtype, self.device)
                       for i, s in enumerate(self.linear) if s is not None}
        self.prior = {i: None for i in self.states}
        self.committed = 0

    # ---- one pass (causal_lm calls begin_pass after reserve, commit at its end) ----------------
    def begin_pass(self, allowed: torch.Tensor | None, n: int, tables: bool = True) -> None:
        """Work out this pass's tree over the pending entries and its n new ones. `tables`
        False: only each entry's parent (a caller that runs the layers itself: the fused CPU
        pass, on a cache with nothing pending), not the PassTree the layers read."""
        past = self.length
        self._pass_pending = {}
        if allowed is None:
            parents = torch.arange(past - 1, past + n - 1)
        else:
            cols = torch.arange(allowed.shape[1], device=allowed.device)
            own = torch.arange(past, past + n, device=allowed.device)
            before = allowed & (cols[None, :] < own[:, None])
            parents = torch.where(before, cols[None, :], -1).amax(dim=1).cpu()
        self.parents[past : past + n] = parents
        base = self.committed
        if bool((parents < base - 1).any()):
            raise RuntimeError("a token of this pass branches off before the last committed token, which a "
                               "recurrent layer cannot do")
        m0 = past - base
        rel = self.parents[base : past + n] - base  # -1: the committed state
        self._pass_fold = allowed is None and m0 == 0
        if not tables:
            assert m0 == 0 and not self._pass_fold, "the fused pass reads a tree on committed text"
            if bool((rel >= torch.arange(n)).any()):
                raise ValueError("a token of this pass comes before its parent")
            self._pass_tree = None
        elif self._pass_fold:
            self._pass_tree = PassTree.of_chain(n, self.device, kept_whole=True)
        elif m0 == 0 and bool((rel == torch.arange(-1, n - 1)).all()):
            self._pass_tree = PassTree.of_chain(n, self.device)
        else:
            self._pass_tree = PassTree.from_parents(rel, self.device, chain_ok=m0 == 0)

    def pass_tree(self) -> PassTree:
        assert self._pass_tree is not None, "begin_pass first"
        return self._pass_tree

    def linear_state(self, layer_idx: int) -> LinearLayerState:
        return self.states[layer_idx]

    def linear_prior(self, layer_idx: int) -> NodeInputs | None:
        return self.prior[layer_idx]

    def linear_pending(self, layer_idx: int, pending: LinearPending) -> None:
        self._pass_pending[layer_idx] = pending

    def commit(self, n: int) -> None:
        super().commit(n)
        if not self.states:
            return
        assert set(self._pass_pending) == set(self.states), "a linear layer did not run in this pass"
        for i, pending in self._pass_pending.items():
            if self._pass_fold:
                advance(self.states[i], pending, None)
            else:
                assert pending.nodes is not None
                self.prior[i] = _cat_nodes(self.prior[i], pending.nodes)
        if self._pass_fold:
            self.committed = self.length
            self._snapshot_if_marked()
        self._pass_pending, self._pass_tree = {}, None

    def abandon_pass(self) -> None:
        """A pass stopped before its commit (CausalLM.interruptible): what its layers left
        pending goes; the states, which only a commit changes, are as they were."""
        self._pass_pending, self._pass_tree, self._pass_fold = {}, None, False

    def folded(self, n: int) -> None:
        """Commit n new entries, committed text the caller has already folded into every linear
        layer's state (engine/kernels/fused_layer.py's step, on a cache with nothing pending),
        instead of begin_pass ... commit."""
        assert self.complete and not self._pass_pending, "entries are pending"
        past = self.length
        self.parents[past : past + n] = torch.arange(past - 1, past + n - 1)
        super().commit(n)
        self.committed = self.length
        self._snapshot_if_marked()

    @torch.inference_mode()
    def share_states(self, other: KVCache) -> None:
        """A compressed copy of the target reads the target's view of the committed tokens:
        its K/V (copied by the caller, self.length == other.length) and here its linear
        layers' states. `other` must have nothing pending (between steps it has not)."""
        assert isinstance(other, HybridCache) and other.complete and self.length == other.length
        for i, state in self.states.items():
            state.conv.copy_(other.states[i].conv)
            state.recurrent.copy_(other.states[i].recurrent)
        self.prior = {i: None for i in self.states}
        self.committed = self.length
        self.parents[: self.length] = torch.arange(-1, self.length - 1)
        self.snapshots.clear()

    # ---- saving --------------------------------------------------------------------------
    @property
    def complete(self) -> bool:
        return self.committed == self.length

    def state_tensors(self) -> dict[str, torch.Tensor]:
        """`lin.<layer>.conv|rec`, and `snap.<position>.<layer>.conv|rec` per snapshot."""
        assert self.complete, "pending entries are not saved"
        out: dict[str, torch.Tensor] = {}
        for i, s in self.states.items():
            out[f"lin.{i}.conv"], out[f"lin.{i}.rec"] = s.tensors()
        for at, snap in self.snapshots.items():
            for i, s in snap.items():
                out[f"snap.{at}.{i}.conv"], out[f"snap.{at}.{i}.rec"] = s.tensors()
        return out

    @classmethod
    @torch.inference_mode()
    def from_saved(cls, layers: list[tuple[torch.Tensor, torch.Tensor]], states: dict[str, torch.Tensor],
                   linear: list[LinearSpec | None], num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                   device: torch.device | str) -> HybridCache | None:
        """A cache from saved K/V (per layer, (1, H_kv, n, D); linear layers' D is 0) and
        `state_tensors()`; None when anything does not fit `linear`'s shapes or `dtype`."""
        n = layers[0][0].shape[2]
        out = cls(len(layers), num_kv_heads, head_dim, dtype, device, max(n, 1), linear)

        def state(prefix: str, spec: LinearSpec) -> LinearLayerState | None:
            conv, rec = states.get(f"{prefix}.conv"), states.get(f"{prefix}.rec")
            if conv is None or rec is None or conv.dtype != dtype or rec.dtype != torch.float32:
                return None
            if tuple(conv.shape) != (1, spec.conv_dim, spec.kernel - 1) or \
                    tuple(rec.shape) != (1, spec.num_v_heads, spec.head_k_dim, spec.head_v_dim):
                return None
            return LinearLayerState.from_tensors(conv, rec, device)

        for i, spec in enumerate(linear):
            if spec is None:
                continue
            got = state(f"lin.{i}", spec)
            if got is None:
                return None
            out.states[i] = got
        positions = {int(name.split(".")[1]) for name in states if name.startswith("snap.")
                     and name.split(".")[1].isdigit()}
        for at in sorted(positions)[-SNAPSHOTS:]:
            if not 0 < at <= n:
                return None
            snap = {}
            for i, spec in enumerate(linear):
                if spec is not None:
                    got = state(f"snap.{at}.{i}", spec)
                    if got is None:
                        return None
                    snap[i] = got
            out.snapshots[at] = snap
        for i, (k, v) in enumerate(layers):
            out.keys[i][:, :, :n] = k
            out.values[i][:, :, :n] = v
        out.length = out.committed = n
        out.parents[:n] = torch.arange(-1, n - 1)
        return out

    # ---- snapshots -----------------------------------------------------------------------
    def mark(self, position: int) -> None:
        if position > self.committed:
            self.marks.add(position)
        elif position == self.committed:
            self._snapshot_if_marked(position)

    def _snapshot_if_marked(self, position: int | None = None) -> None:
        at = self.committed if position is None else position
        if position is None and at not in self.marks:
            return
        self.marks.discard(at)
        self.snapshots[at] = {i: s.clone() for i, s in self.states.items()}
        for old in sorted(self.snapshots)[:-SNAPSHOTS]:
            del self.snapshots[old]

    def _restore(self, length: int) -> int:
        """Go back to the newest snapshot at or before `length` (or empty); the new length."""
        at = max((p for p in self.snapshots if p <= length), default=0)
        if at == 0:
            self._reset_states()
        else:
            self.states = {i: s.clone() for i, s in self.snapshots[at].items()}
            self.prior = {i: None for i in self.states}
            self.committed = at
        for p in [p for p in self.snapshots if p > at]:
            del self.snapshots[p]
        self.length = at
        return at

    # ---- pruning -------------------------------------------------------------------------
    @torch.inference_mode()
    def keep(self, indices: torch.Tensor) -> None:
        idx = indices.cpu()
        base = self.committed
        folded = idx[idx < base]
        if folded.numel() != base or not torch.equal(folded, torch.arange(base)):
            raise RuntimeError("a recurrent layer's state cannot drop committed tokens")
        path = (idx[idx >= base] - base).tolist()
        expect = -1
        for j in path:  # the kept pending entries must be one chain from the committed state
            if int(self.parents[base + j]) - base != expect:
                raise RuntimeError("the kept entries are not one path of the tree")
            expect = j
        # a marked position inside the kept path splits the replay there, for its snapshot
        inside = sorted(p - base for p in self.marks if base < p <= base + len(path))
        cuts = [0] + inside + ([len(path)] if not inside or inside[-1] != len(path) else [])
        for a, b in zip(cuts, cuts[1:]):
            for i, state in self.states.items():
                nodes = self.prior[i]
                if b > a:
                    assert nodes is not None
                    spec = self.linear[i]
                    assert spec is not None
                    advance(state, LinearPending(int(nodes.x.shape[0]), nodes, None), path[a:b], spec.tiled)
            self.committed = base + b
            self._snapshot_if_marked()
        self.prior = {i: None for i in self.states}
        super().keep(indices)
        self.parents[: idx.numel()] = torch.arange(-1, idx.numel() - 1)
        self.committed = self.length

    def truncate(self, length: int) -> None:
        """Drop entries after `length`; below the committed tokens, back to the newest snapshot
        at or before it (or to nothing): the caller reads the rest again (it reads `length`)."""
        assert 0 <= length <= self.length
        if length < self.committed:
            self._restore(length)
            return
        keep = length - self.committed
        for i, nodes in self.prior.items():
            self.prior[i] = _slice_nodes(nodes, keep) if nodes is not None else None
        self.length = length

    def nbytes(self) -> int:
        states = list(self.states.values()) + [s for snap in self.snapshots.values() for s in snap.values()]
        return super().nbytes() + sum(s.nbytes() for s in states)

    def like(self, capacity: int) -> HybridCache:
        return HybridCache(self.num_layers, self.num_kv_heads, self.head_dim, self.dtype, self.device, capacity,
                           self.linear)

    @torch.inference_mode()
    def copy_prefix(self, length: int, spare: int = 0) -> HybridCache:
        """A copy of the first `length` entries; below the committed tokens, up to the newest
        snapshot at or before `length` (see truncate)."""
        assert 0 <= length <= self.length
        out = self.like(max(length + spare, 1))
        out.snapshots = {p: {i: s.clone() for i, s in snap.items()} for p, snap in self.snapshots.items()
                         if p <= length}
        if length < self.committed:
            at = max(out.snapshots, default=0)
            for dst, src in zip(out.keys + out.values, self.keys + self.values):
                dst[:, :, :at] = src[:, :, :at]
            out.positions[:at] = self.positions[:at]
            out._restore(at)
            return out
        for dst, src in zip(out.keys + out.values, self.keys + self.values):
            dst[:, :, :length] = src[:, :, :length]
        out.positions[:length] = self.positions[:length]
        out.parents[:length] = self.parents[:length]
        out.states = {i: s.clone() for i, s in self.states.items()}
        out.committed = self.committed
        out.prior = {i: (_slice_nodes(p, length - self.committed) if p is not None else None)
                     for i, p in self.prior.items()}
        out.length = length
        return out

    @torch.inference_mode()
    def to(self, device: torch.device | str) -> HybridCache:
        device = torch.device(device)
        if device != self.device:
            super().to(device)
            for state in self.states.values():
                state.to(device)
            for snap in self.snapshots.values():
                for state in snap.values():
                    state.to(device)
            self.prior = {i: (NodeInputs(p.x.to(device), p.k.to(device), p.v.to(device), p.beta.to(device),
                                         p.g.to(device)) if p is not None else None) for i, p in self.prior.items()}
        return self
