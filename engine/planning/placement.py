"""Placement: how many of a target's decoder layers stay on the device, in RAM and on disk,
from the memory each tier has and what a pass needs besides the layers (KV cache, activations).

Plain arithmetic on sizes: the loader calls it with measured free memory, the planner with a
profile's figures for a model that is not loaded yet.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.shapes import Packing, Placement
from engine.types import Offload
from engine.units import GIB

RING_SLOTS = 3  # device slots the streamer cycles offloaded layers through


@dataclass(frozen=True)
class MemoryNeeds:
    """Device memory a target needs besides its decoder layers, in bytes."""

    fixed: int  # embeddings, final norm, head, rotary tables; plus the draft if it shares the device
    kv_per_token: int  # all target layers, K and V
    activations: int  # one pass at the largest tree budget
    # the target's caches at the planned context and tree, by layer kind (ModelShape.kv_bytes:
    # windows, linear states, layers without K/V); None: kv_per_token for every context token
    kv_bytes: int | None = None

    def kv_at(self, context_length: int) -> int:
        """The target's caches planned for `context_length` tokens."""
        return self.kv_bytes if self.kv_bytes is not None else self.kv_per_token * context_length


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype_bytes: int) -> int:
    """Every layer full attention of one K/V shape; ModelShape.kv_bytes prices layers by kind."""
    return 2 * num_layers * num_kv_heads * head_dim * dtype_bytes


def activation_bytes(budget: int, context: int, hidden: int, intermediate: int, num_heads: int,
                     vocab: int, dtype_bytes: int) -> int:
    """A generous estimate of one pass's transient memory at `budget` tokens: residual and
    normed states, q/k/v/o, the MLP's three intermediates, the additive mask and attention
    scores of every head over the whole context (SDPA's math fallback materialises them),
    and fp32 logits for every tree row."""
    states = budget * (6 * hidden + 3 * intermediate) * dtype_bytes
    scores = budget * context * (num_heads + 1) * dtype_bytes
    logits = budget * vocab * 4
    return states + scores + logits


def plan_placement(*, num_layers: int, layer_bytes: int, dense_layer_bytes: int, quant: Packing,
                   offload: Offload, device: str, device_free: int, needs: MemoryNeeds, context_length: int,
                   host_free: int, margin: int = GIB, ring_slots: int = RING_SLOTS) -> Placement:
    """How many decoder layers stay on the device, in RAM and on disk.

    device_free: free device memory now (for a CPU device: the RAM the layers may use).
    host_free: RAM the host store may use (already less the OS/app margin).
    Resident layers are what fits after the fixed part, the KV cache for `context_length`,
    the activations, the margin and (when anything streams) the ring of slot buffers.
    """
    fit = max(0, host_free) // max(layer_bytes, 1)
    if device == "cpu":
        # device memory is RAM: "resident" layers and the host store draw on the same budget,
        # so auto keeps what fits resident and sends the rest to disk; all streams everything
        if offload == "none":
            return Placement(num_layers, num_layers, 0, 0, layer_bytes, quant, device)
        if offload == "auto":
            resident = min(num_layers, fit)
            return Placement(num_layers, resident, 0, num_layers - resident, layer_bytes, quant, device)
        ram = min(num_layers, fit)
        return Placement(num_layers, 0, ram, num_layers - ram, layer_bytes, quant, device)
    if offload == "none":
        gpu = num_layers
    elif offload == "all":
        gpu = 0
    else:
        budget = device_free - needs.fixed - needs.kv_at(context_length) - needs.activations - margin
        gpu = max(0, min(num_layers, budget // max(layer_bytes, 1)))
        if gpu < num_layers:  # streaming needs a ring (and, for packed layers, a dense buffer)
            ring = ring_slots * layer_bytes + (dense_layer_bytes if quant != "none" else 0)
            gpu = max(0, min(num_layers, (budget - ring) // max(layer_bytes, 1)))
    rest = num_layers - gpu
    ram = min(rest, fit)
    return Placement(num_layers, gpu, ram, rest - ram, layer_bytes, quant, device)
