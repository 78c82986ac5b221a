"""KV cache written by position, with tree-friendly pruning.

Each layer owns preallocated key/value buffers (1, H_kv, capacity, D). A forward pass writes its
n new entries at [length, length + n) (gpt-fast style), so tree tokens land anywhere and
rollback is a length change. After a verification step, `keep(indices)` gathers the surviving
positions (the committed prefix plus the accepted tree path) to the front; the entries after
them are dead and get overwritten by the next pass.

transformers 5.x attention modules call `update(key, value, layer_idx)` on whatever object is
passed as `past_key_values`, so this class plugs into their decoder layers unchanged. It does
not manage attention masks or positions: the caller (causal_lm) supplies them. Between
conversations a cache can be copied up to a length (`copy_prefix`), moved off the device
(`to`), and exported or rebuilt layer by layer (`tensors`, `from_tensors`) for saving.

Layers may differ in shape (`layer_shapes`: Gemma 4's full-attention layers have wider heads
and fewer of them than its sliding ones; a layer that reuses another layer's K/V keeps none,
width 0). Without it every layer is (num_kv_heads, head_dim).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

LayerShapes = tuple[tuple[int, int], ...]  # each layer's (kv heads, head dim)


class KVCache:
    """Invariants: all layers hold `length` valid entries between passes; during a pass each
    layer's `update` sees the same number n of new entries, and `commit(n)` ends the pass."""

    @property
    def complete(self) -> bool:
        """Whether every entry is final (a cache with a pass's pending entries is not saved)."""
        return True

    def share_states(self, other: KVCache) -> None:
        """After its K/V were set to `other`'s (drafting.share_context): take whatever else
        `other` holds for those entries. Nothing here."""

    def state_tensors(self) -> dict[str, torch.Tensor]:
        """What the cache holds besides its K/V (tensors()), by name, for saving: nothing here."""
        return {}

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
        capacity: int = 256,
        layer_shapes: Sequence[tuple[int, int]] | None = None,
    ) -> None:
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        # None: every layer is (num_kv_heads, head_dim)
        self.layer_shapes: LayerShapes | None = None
        if layer_shapes is not None and any(tuple(s) != (num_kv_heads, head_dim) for s in layer_shapes):
            assert len(layer_shapes) == num_layers
            self.layer_shapes = tuple((int(h), int(d)) for h, d in layer_shapes)
        self.dtype = dtype
        self.device = torch.device(device)
        self.length = 0
        self.capacity = 0
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        # each entry's position (sliding windows count along a node's path by position; tree
        # entries kept across draft passes are not at position = index)
        self.positions = torch.empty(0, dtype=torch.long, device=self.device)
        self._grow(capacity)

    @torch.inference_mode()  # buffers are inference tensors: passes run in inference mode
    def _grow(self, capacity: int) -> None:
        shapes = self.layer_shapes or ((self.num_kv_heads, self.head_dim),) * self.num_layers
        keys = [torch.empty((1, h, capacity, d), dtype=self.dtype, device=self.device) for h, d in shapes]
        values = [torch.empty((1, h, capacity, d), dtype=self.dtype, device=self.device) for h, d in shapes]
        for new, old in zip(keys + values, self.keys + self.values):
            new[:, :, : self.length] = old[:, :, : self.length]
        positions = torch.arange(capacity, dtype=torch.long, device=self.device)
        positions[: self.length] = self.positions[: self.length]
        self.keys, self.values, self.positions, self.capacity = keys, values, positions, capacity

    def reserve(self, n: int) -> None:
        """Make room for n more entries (amortised doubling, so appends stay O(1))."""
        need = self.length + n
        if need > self.capacity:
            self._grow(max(need, 2 * self.capacity))

    @torch.inference_mode()
    def set_positions(self, positions: torch.Tensor) -> None:
        """The positions of this pass's n entries (call after reserve(n), before the layers)."""
        n = positions.numel()
        self.positions[self.length : self.length + n] = positions.to(self.device)

    def positions_through(self, n: int) -> torch.Tensor:
        """(length + n,) positions of the valid entries and this pass's n."""
        return self.positions[: self.length + n]

    def update(
        self, key: torch.Tensor, value: torch.Tensor, layer_idx: int, *args: object, **kwargs: object
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write this pass's entries (1, H_kv, n, D) after the valid ones; return all of them."""
        n = key.shape[2]
        end = self.length + n
        assert end <= self.capacity, "call reserve(n) before the pass"
        k_buf, v_buf = self.keys[layer_idx], self.values[layer_idx]
        k_buf[:, :, self.length : end] = key
        v_buf[:, :, self.length : end] = value
        return k_buf[:, :, :end], v_buf[:, :, :end]

    def commit(self, n: int) -> None:
        self.length += n
        assert self.length <= self.capacity

    @torch.inference_mode()
    def keep(self, indices: torch.Tensor) -> None:
        """Keep only the entries at `indices` (ascending), moved to positions [0, len(indices))."""
        indices = indices.to(self.device)
        n = indices.numel()
        for buf in self.keys + self.values:
            buf[:, :, :n] = buf.index_select(2, indices)
        self.positions[:n] = self.positions.index_select(0, indices)
        self.length = n

    def truncate(self, length: int) -> None:
        assert 0 <= length <= self.length
        self.length = length

    def mark(self, position: int) -> None:
        """`position` (a prompt's end) is a point a later request may resume from. K/V entries
        can be cut anywhere, so nothing is kept here; caches whose state cannot be rolled back
        (hybrid_cache) keep a snapshot there."""

    def held_from(self, window: int) -> int:
        """The first entry the layers of a sliding `window` still hold (window_cache); here all."""
        return 0

    def settled(self, upto: int) -> None:
        """Entries [0, upto) are committed text and no later pass queries a position before
        `upto` (a pass without a tree mask starts there). Nothing to drop here (window_cache)."""

    @torch.inference_mode()
    def take_entries(self, other: KVCache, synced: int) -> None:
        """Hold `other`'s entries (a compressed copy of the target reads the target's K/V:
        drafting.share_context); those before `synced` are equal already."""
        m = other.length
        start = min(synced, self.length, m)
        self.truncate(min(self.length, m))
        start = min(start, self.length)
        self.reserve(m - self.length)
        for dst, src in zip(self.keys + self.values, other.keys + other.values):
            dst[:, :, start:m] = src[:, :, start:m].to(device=dst.device, dtype=dst.dtype)
        self.length = m

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.length

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.keys + self.values)

    def like(self, capacity: int) -> KVCache:
        """An empty cache of the same shape, dtype and device."""
        return KVCache(self.num_layers, self.num_kv_heads, self.head_dim, self.dtype, self.device, capacity,
                       self.layer_shapes)

    @torch.inference_mode()
    def copy_prefix(self, length: int, spare: int = 0) -> KVCache:
        """A new cache holding a copy of the first `length` entries (room for `spare` more)."""
        assert 0 <= length <= self.length
        out = self.like(max(length + spare, 1))
        for dst, src in zip(out.keys + out.values, self.keys + self.values):
            dst[:, :, :length] = src[:, :, :length]
        out.positions[:length] = self.positions[:length]
        out.length = length
        return out

    @torch.inference_mode()
    def to(self, device: torch.device | str) -> KVCache:
        """Move the valid entries to `device` (buffers trimmed to the length); self, moved."""
        device = torch.device(device)
        if device != self.device:
            self.keys = [k[:, :, : self.length].to(device) for k in self.keys]
            self.values = [v[:, :, : self.length].to(device) for v in self.values]
            self.positions = self.positions[: self.length].to(device)
            self.device, self.capacity = device, self.length
        return self

    def tensors(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(key, value) of each layer over the valid entries: views (1, H_kv, length, D)."""
        return [(k[:, :, : self.length], v[:, :, : self.length]) for k, v in zip(self.keys, self.values)]

    @classmethod
    @torch.inference_mode()
    def from_tensors(cls, layers: list[tuple[torch.Tensor, torch.Tensor]], device: torch.device | str,
                     spare: int = 0) -> KVCache:
        """A cache holding the given (key, value) per layer, each (1, H_kv, n, D), on `device`
        (layers may differ in H_kv and D)."""
        k0 = layers[0][0]
        _, heads, n, dim = k0.shape
        shapes = [(k.shape[1], k.shape[3]) for k, _ in layers]
        out = cls(len(layers), heads, dim, k0.dtype, device, max(n + spare, 1), layer_shapes=shapes)
        for i, (k, v) in enumerate(layers):
            out.keys[i][:, :, :n] = k
            out.values[i][:, :, :n] = v
        out.length = n
        return out


def steady_attention() -> None:
    """Keep PyTorch's scaled-dot-product attention off cuDNN's kernel (process-wide; flash,
    memory-efficient and math kernels stay). cuDNN builds an execution plan for each new shape,
    and every pass over this cache has a key length never seen before (a conversation only
    grows): measured on an H200 (PyTorch 2.11), a decode step's layers took ~8 ms each the first
    time a length came, against 2 ms on a length seen before, so a chat's every step paid it.
    The other kernels need no plan. Called wherever a model or a timed layer goes to a GPU."""
    torch.backends.cuda.enable_cudnn_sdp(False)
