"""KV cache written by position, with tree-friendly pruning.

Each layer owns preallocated key/value buffers (1, H_kv, capacity, D). A forward pass writes its
n new entries at [length, length + n) (gpt-fast style), so tree tokens land anywhere and
rollback is a length change. After a verification step, `keep(indices)` gathers the surviving
positions (the committed prefix plus the accepted tree path) to the front; the entries after
them are dead and get overwritten by the next pass.

transformers 5.x attention modules call `update(key, value, layer_idx)` on whatever object is
passed as `past_key_values`, so this class plugs into their decoder layers unchanged. It does
not manage attention masks or positions: the caller (causal_lm) supplies them.
"""

from __future__ import annotations

import torch


class KVCache:
    """Invariants: all layers hold `length` valid entries between passes; during a pass each
    layer's `update` sees the same number n of new entries, and `commit(n)` ends the pass."""

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
        capacity: int = 256,
    ) -> None:
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = torch.device(device)
        self.length = 0
        self.capacity = 0
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self._grow(capacity)

    @torch.inference_mode()  # buffers are inference tensors: passes run in inference mode
    def _grow(self, capacity: int) -> None:
        shape = (1, self.num_kv_heads, capacity, self.head_dim)
        keys = [torch.empty(shape, dtype=self.dtype, device=self.device) for _ in range(self.num_layers)]
        values = [torch.empty(shape, dtype=self.dtype, device=self.device) for _ in range(self.num_layers)]
        for new, old in zip(keys + values, self.keys + self.values):
            new[:, :, : self.length] = old[:, :, : self.length]
        self.keys, self.values, self.capacity = keys, values, capacity

    def reserve(self, n: int) -> None:
        """Make room for n more entries (amortised doubling, so appends stay O(1))."""
        need = self.length + n
        if need > self.capacity:
            self._grow(max(need, 2 * self.capacity))

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
        self.length = n

    def truncate(self, length: int) -> None:
        assert 0 <= length <= self.length
        self.length = length

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.length

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.keys + self.values)
