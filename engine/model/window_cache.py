"""A KV cache whose sliding-window layers hold their window plus the tree, not the whole history.

A layer with window w lets a token at position q read keys at positions q - w < k <= q. Once
every later query is known to sit at position Q or beyond, the committed entries at positions
up to Q - w are dead for that layer. So each window size keeps `start[w]`: the index of the
first entry its layers still hold (buffer column 0 of those layers is entry `start[w]`). The
full-attention layers hold every entry as in KVCache; entry indices, lengths and positions are
shared by all layers, and causal_lm slices each layer's mask from column `held_from(w)`.

When is "every later query at Q or beyond" known? Between decoding steps every entry is
committed text (verification's invariant) and, for committed text, index == position. Two
points say so: a pass without a tree mask (a prefill chunk, a plain step) starts at its first
token's position (`settled(past)`, called by causal_lm), and `keep` ends a verification step
with nothing but committed text. Dead entries are dropped only once a quarter window (at
least SLACK_MIN) of them has gathered, so shifting the buffers costs about four entries a
step, and a window's layers hold at most w - 1 + w/4 committed entries plus a pass's tree.

What a cut of the history then needs: `truncate(L)` and `copy_prefix(L)` must hold, for each
window, the entries at positions L - w + 1 .. L - 1. While they are still held that is free.
Further back, the entries before a prompt's end that `mark` named (the point the next turn
resumes from) are copied aside just before they would be dropped (the newest SNAPSHOTS marks),
and a cut goes back to the newest point every window can serve: the cut itself, a snapshot,
or nothing. The caller then reads the rest again (it reads `length`), as with HybridCache.

Buffers of the windowed layers grow in `update`, when a pass needs more room than they have:
the engine's `reserve` of a whole answer in advance sizes the full layers only.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.model.cache import KVCache, LayerShapes

SNAPSHOTS = 2  # marks whose windows are kept once trimmed: this turn's prompt end and the previous one
SLACK_MIN = 4  # dead entries gathered before a window's buffers shift (at least a quarter window)
FIRST_TREE = 64  # room for a pass beyond the window in a windowed layer's first buffer (it grows as needed)


def _slack(window: int) -> int:
    return max(SLACK_MIN, window // 4)


class WindowedCache(KVCache):
    """KVCache with `windows[i]` (None: full attention) per layer (module docstring)."""

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device | str, capacity: int = 256,
                 layer_shapes: Sequence[tuple[int, int]] | None = None,
                 windows: Sequence[int | None] = ()) -> None:
        assert len(windows) == num_layers and any(w is not None for w in windows)
        if any(w is not None and w < 1 for w in windows):
            raise ValueError(f"a sliding window must be a positive number of tokens, not {list(windows)}")
        self.windows: tuple[int | None, ...] = tuple(windows)
        self.sizes = sorted({w for w in self.windows if w is not None})
        self.start: dict[int, int] = {w: 0 for w in self.sizes}
        self.marks: set[int] = set()
        # position -> layer -> (k, v) of the entries before that position its window needs
        self.snapshots: dict[int, dict[int, tuple[torch.Tensor, torch.Tensor]]] = {}
        super().__init__(num_layers, num_kv_heads, head_dim, dtype, device, capacity, layer_shapes)

    # ---- storage ---------------------------------------------------------------------------
    def _shape(self, layer: int) -> tuple[int, int]:
        return self.layer_shapes[layer] if self.layer_shapes else (self.num_kv_heads, self.head_dim)

    def _held(self, layer: int) -> int:
        """Entries layer `layer` holds now (its buffer columns [0, held))."""
        w = self.windows[layer]
        return self.length - (self.start[w] if w is not None else 0)

    @torch.inference_mode()
    def _grow(self, capacity: int) -> None:
        """Full layers (and positions) to `capacity` entries; windowed layers keep their buffers
        (grown in update), allocated here at first."""
        first = not self.keys
        keys, values = [], []
        for i, w in enumerate(self.windows):
            if w is not None and not first:
                keys.append(self.keys[i])
                values.append(self.values[i])
                continue
            h, d = self._shape(i)
            size = capacity if w is None else min(capacity, w + _slack(w) + FIRST_TREE)
            k = torch.empty((1, h, size, d), dtype=self.dtype, device=self.device)
            v = torch.empty_like(k)
            if not first:
                k[:, :, : self.length] = self.keys[i][:, :, : self.length]
                v[:, :, : self.length] = self.values[i][:, :, : self.length]
            keys.append(k)
            values.append(v)
        positions = torch.arange(capacity, dtype=torch.long, device=self.device)
        positions[: self.length] = self.positions[: self.length]
        self.keys, self.values, self.positions, self.capacity = keys, values, positions, capacity

    @torch.inference_mode()
    def _grow_window(self, window: int, need: int) -> None:
        for i, w in enumerate(self.windows):
            if w != window:
                continue
            old_k, old_v = self.keys[i], self.values[i]
            cap = max(need, 2 * old_k.shape[2])
            k = torch.empty((*old_k.shape[:2], cap, old_k.shape[3]), dtype=self.dtype, device=self.device)
            v = torch.empty_like(k)
            k[:, :, : old_k.shape[2]] = old_k  # all of it: a pass's earlier layers wrote beyond length
            v[:, :, : old_v.shape[2]] = old_v
            self.keys[i], self.values[i] = k, v

    def make_room(self, n: int) -> None:
        """Room for n more entries in every windowed layer's buffers (a pass that writes them
        itself, not through `update`: engine.kernels.fused_layer)."""
        for w in self.sizes:
            need = self.length - self.start[w] + n
            if any(need > self.keys[i].shape[2] for i, lw in enumerate(self.windows) if lw == w):
                self._grow_window(w, need)

    def held_from(self, window: int) -> int:
        return self.start[window]

    def update(self, key: torch.Tensor, value: torch.Tensor, layer_idx: int, *args: object,
               **kwargs: object) -> tuple[torch.Tensor, torch.Tensor]:
        w = self.windows[layer_idx]
        if w is None:
            return super().update(key, value, layer_idx)
        n = key.shape[2]
        assert self.length + n <= self.capacity, "call reserve(n) before the pass"
        at = self.length - self.start[w]
        end = at + n
        if end > self.keys[layer_idx].shape[2]:
            self._grow_window(w, end)
        k_buf, v_buf = self.keys[layer_idx], self.values[layer_idx]
        k_buf[:, :, at:end] = key
        v_buf[:, :, at:end] = value
        return k_buf[:, :, :end], v_buf[:, :, :end]

    # ---- dropping what no query reads again ------------------------------------------------
    def settled(self, upto: int) -> None:
        self._trim(upto)

    @torch.inference_mode()
    def _trim(self, upto: int) -> None:
        """Entries [0, upto) are committed text and no later query sits before `upto`: drop the
        ones every window has left behind (once enough have gathered)."""
        for w in self.sizes:
            first = max(0, upto - w + 1)  # the oldest entry a query at `upto` reads
            dead = first - self.start[w]
            if dead < _slack(w):
                continue
            self._snapshot_marks(w, upto, first)
            held = self.length - self.start[w]
            for i, lw in enumerate(self.windows):
                if lw == w:
                    for buf in (self.keys[i], self.values[i]):
                        buf[:, :, : held - dead] = buf[:, :, dead:held].clone()
            self.start[w] = first

    def _snapshot_marks(self, window: int, upto: int, first: int) -> None:
        """Copy aside, for every mark at or before `upto` whose entries the window is about to
        drop (those before `first`), the entries a query at the mark reads."""
        for p in sorted(self.marks):
            need = max(0, p - window + 1)
            if p > upto or need >= first or need < self.start[window]:
                continue  # not committed yet, nothing of it dropped, or already gone
            a, b = need - self.start[window], p - self.start[window]
            snap = self.snapshots.setdefault(p, {})
            for i, w in enumerate(self.windows):
                if w == window:
                    snap[i] = (self.keys[i][:, :, a:b].clone(), self.values[i][:, :, a:b].clone())
        for old in sorted(self.snapshots)[:-SNAPSHOTS]:
            del self.snapshots[old]
        newest = max(self.snapshots, default=0)
        self.marks = {p for p in self.marks if p >= newest}

    def mark(self, position: int) -> None:
        self.marks.add(position)

    # ---- what a cut can go back to ---------------------------------------------------------
    def _serves(self, window: int, at: int) -> str | None:
        """How the layers of `window` can stand at length `at`: "held", "snap", or None."""
        if at <= self.length and self.start[window] <= max(0, at - window + 1):
            return "held"
        snap = self.snapshots.get(at)
        if snap is not None and all(i in snap for i, w in enumerate(self.windows) if w == window):
            return "snap"
        return None

    def _resume_point(self, length: int) -> int:
        for at in [length, *sorted((p for p in self.snapshots if p < length), reverse=True)]:
            if all(self._serves(w, at) for w in self.sizes):
                return at
        return 0

    @torch.inference_mode()
    def _install(self, window: int, at: int, src: WindowedCache) -> None:
        """Set this cache's `window` layers to stand at length `at` from `src`'s held entries or
        its snapshot there (src may be self)."""
        if at == 0:
            self.start[window] = 0
            return
        how = src._serves(window, at)
        assert how is not None, "a resume point every window serves"
        if how == "held" and src is self:
            return
        start = src.start[window] if how == "held" else at - min(at, window - 1)
        for i, w in enumerate(self.windows):
            if w != window:
                continue
            if how == "held":
                k = src.keys[i][:, :, : at - start]
                v = src.values[i][:, :, : at - start]
            else:
                k, v = src.snapshots[at][i]
            if k.shape[2] > self.keys[i].shape[2]:
                self._grow_window(window, k.shape[2])
            self.keys[i][:, :, : k.shape[2]] = k
            self.values[i][:, :, : v.shape[2]] = v
        self.start[window] = start

    def truncate(self, length: int) -> None:
        """Drop entries after `length`; where a window no longer holds what a query at `length`
        reads, back to the newest point it can serve (module docstring)."""
        assert 0 <= length <= self.length
        at = self._resume_point(length)
        for w in self.sizes:
            self._install(w, at, self)
        for p in [p for p in self.snapshots if p > at]:
            del self.snapshots[p]
        self.marks = {p for p in self.marks if p <= at}
        self.length = at

    # ---- pruning and copies ------------------------------------------------------------------
    @torch.inference_mode()
    def keep(self, indices: torch.Tensor) -> None:
        indices = indices.to(self.device)
        n = indices.numel()
        chosen = {w: indices[indices >= self.start[w]] - self.start[w] for w in self.sizes}
        for i, w in enumerate(self.windows):
            idx = indices if w is None else chosen[w]
            for buf in (self.keys[i], self.values[i]):
                buf[:, :, : idx.numel()] = buf.index_select(2, idx)
        for w in self.sizes:
            self.start[w] = n - chosen[w].numel()
        self.positions[:n] = self.positions.index_select(0, indices)
        self.length = n
        self._trim(n)  # a step ends with committed text only

    def like(self, capacity: int) -> WindowedCache:
        return WindowedCache(self.num_layers, self.num_kv_heads, self.head_dim, self.dtype, self.device, capacity,
                             self.layer_shapes, self.windows)

    @torch.inference_mode()
    def copy_prefix(self, length: int, spare: int = 0) -> WindowedCache:
        """A copy of the first `length` entries, or of the newest point before it that every
        window can serve (see truncate)."""
        assert 0 <= length <= self.length
        at = self._resume_point(length)
        out = self.like(max(at + spare, 1))
        for i, w in enumerate(self.windows):
            if w is None:
                out.keys[i][:, :, :at] = self.keys[i][:, :, :at]
                out.values[i][:, :, :at] = self.values[i][:, :, :at]
        for w in self.sizes:
            out._install(w, at, self)
        out.positions[:at] = self.positions[:at]
        out.snapshots = {p: {i: (k.clone(), v.clone()) for i, (k, v) in snap.items()}
                         for p, snap in self.snapshots.items() if p <= at}
        out.marks = {p for p in self.marks if p <= at}
        out.length = at
        return out

    @torch.inference_mode()
    def take_entries(self, other: KVCache, synced: int) -> None:
        assert isinstance(other, WindowedCache) and other.windows == self.windows
        m = other.length
        start = min(synced, self.length, m)
        self.truncate(min(self.length, m))
        start = min(start, self.length)
        self.reserve(m - self.length)
        for i, w in enumerate(self.windows):
            if w is None:
                self.keys[i][:, :, start:m] = other.keys[i][:, :, start:m].to(self.dtype)
                self.values[i][:, :, start:m] = other.values[i][:, :, start:m].to(self.dtype)
        self.length = m
        for w in self.sizes:  # the other's window as it holds it
            self._install(w, m, other)
        self.positions[:m] = other.positions[:m].to(self.device)
        # the windows `other` copied aside are of these same entries
        self.snapshots = {p: {i: (self._own(k), self._own(v)) for i, (k, v) in snap.items()}
                          for p, snap in other.snapshots.items()}
        self.marks = set(other.marks)

    def _own(self, t: torch.Tensor) -> torch.Tensor:
        """A copy of another cache's tensor on this cache's device and dtype (never shared: a
        saved file holds each tensor once)."""
        return t.to(self.device, self.dtype, copy=True)

    @torch.inference_mode()
    def to(self, device: torch.device | str) -> WindowedCache:
        device = torch.device(device)
        if device != self.device:
            self.keys = [k[:, :, : self._held(i)].to(device) for i, k in enumerate(self.keys)]
            self.values = [v[:, :, : self._held(i)].to(device) for i, v in enumerate(self.values)]
            self.positions = self.positions[: self.length].to(device)
            self.snapshots = {p: {i: (k.to(device), v.to(device)) for i, (k, v) in snap.items()}
                              for p, snap in self.snapshots.items()}
            self.device, self.capacity = device, self.length
        return self

    def nbytes(self) -> int:
        snaps = sum(k.numel() * k.element_size() * 2 for snap in self.snapshots.values() for k, _ in snap.values())
        return super().nbytes() + snaps

    # ---- saving --------------------------------------------------------------------------------
    def tensors(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each layer's held entries: a windowed layer's first is entry `start[w]`."""
        return [(k[:, :, : self._held(i)], v[:, :, : self._held(i)])
                for i, (k, v) in enumerate(zip(self.keys, self.values))]

    def state_tensors(self) -> dict[str, torch.Tensor]:
        """`win.<w>.start` per window size, `wsnap.<position>.<layer>.k|v` per snapshot."""
        out = {f"win.{w}.start": torch.tensor([s], dtype=torch.int64) for w, s in self.start.items()}
        for p, snap in self.snapshots.items():
            for i, (k, v) in snap.items():
                out[f"wsnap.{p}.{i}.k"], out[f"wsnap.{p}.{i}.v"] = k, v
        return out

    @classmethod
    @torch.inference_mode()
    def from_saved(cls, layers: list[tuple[torch.Tensor, torch.Tensor]], states: dict[str, torch.Tensor],
                   n: int, windows: Sequence[int | None], shapes: LayerShapes, dtype: torch.dtype,
                   device: torch.device | str) -> WindowedCache | None:
        """A cache of `n` entries from `tensors()` and `state_tensors()` as saved (untrusted: None
        when any part does not fit `windows` and each layer's (heads, width) in `shapes`)."""
        if len(layers) != len(windows) or len(shapes) != len(windows) or n < 0:
            return None
        start: dict[int, int] = {}
        for w in {w for w in windows if w is not None}:
            t = states.get(f"win.{w}.start")
            if t is None or t.dtype != torch.int64 or t.numel() != 1 or not 0 <= int(t) <= n:
                return None
            start[w] = int(t)
        known = {f"win.{w}.start" for w in start}
        snapshots: dict[int, dict[int, tuple[torch.Tensor, torch.Tensor]]] = {}
        for name in states:
            if name in known:
                continue
            parts = name.split(".")
            if len(parts) != 4 or parts[0] != "wsnap" or not parts[1].isdigit() or not parts[2].isdigit() \
                    or parts[3] not in ("k", "v"):
                return None
            p, i = int(parts[1]), int(parts[2])
            if not 0 < p <= n or i >= len(windows) or windows[i] is None:
                return None
            k, v = states.get(f"wsnap.{p}.{i}.k"), states.get(f"wsnap.{p}.{i}.v")
            heads, width = shapes[i]
            want = (1, heads, min(p, (windows[i] or 1) - 1), width)
            if k is None or v is None or tuple(k.shape) != want or tuple(v.shape) != want \
                    or k.dtype != dtype or v.dtype != dtype:
                return None
            snapshots.setdefault(p, {})[i] = (k, v)
        for i, (k, v) in enumerate(layers):
            window = windows[i]
            held = n - (start[window] if window is not None else 0)
            if k.shape[2] != held or v.shape[2] != held:
                return None
        heads0, dim0 = shapes[0]
        out = cls(len(layers), heads0, dim0, dtype, device, max(n, 1), shapes, windows)
        for i, (k, v) in enumerate(layers):
            if k.shape[2] > out.keys[i].shape[2]:
                out._grow_window(windows[i] or 0, k.shape[2])
            out.keys[i][:, :, : k.shape[2]] = k
            out.values[i][:, :, : v.shape[2]] = v
        out.start = start
        out.snapshots = {p: {i: (k.to(out.device), v.to(out.device)) for i, (k, v) in snap.items()}
                         for p, snap in sorted(snapshots.items())[-SNAPSHOTS:]}
        out.length = n
        return out
