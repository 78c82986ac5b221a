"""Placement: how many of a target's decoder layers stay on the device, in RAM and on disk,
from the memory each tier has and what a pass needs besides the layers (KV cache, activations).

Plain arithmetic on sizes: the loader calls it with measured free memory, the planner with a
profile's figures for a model that is not loaded yet.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.types import ModelShape, Offload, Packing, Placement
from engine.units import GIB

RING_SLOTS = 3  # device slots the streamer cycles offloaded layers through


@dataclass(frozen=True)
class MemoryNeeds:
    """Device memory a target needs besides its decoder layers, in bytes."""

    fixed: int  # embeddings, final norm, head, rotary tables; plus the draft if it shares the device
    kv_per_token: int  # all target layers, K and V
    activations: int  # one pass at the largest tree budget


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype_bytes: int) -> int:
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


def generation_bytes(target: ModelShape, draft: ModelShape | None, dtype_bytes: int, prompt: int,
                     max_new: int, budget: int) -> int:
    """Memory one generation allocates besides the weights, as Engine.generate sizes it: both KV
    caches at their full capacity (allocated up front), and for one target pass over a
    `budget`-token tree its hidden states, the additive mask over the whole cache and fp32
    logits. Not the per-head attention scores (fused attention kernels never hold them): this
    is the floor a request needs, for refusing what cannot fit, not a planning estimate."""
    target_tokens = prompt + max_new + budget + 8
    need = target.kv_bytes_per_token(dtype_bytes) * target_tokens
    need += budget * (6 * target.hidden_size + 3 * target.layer.intermediate_size) * dtype_bytes
    need += budget * target_tokens * dtype_bytes + budget * target.vocab_size * 4
    if draft is not None:
        need += draft.kv_bytes_per_token(dtype_bytes) * (prompt + max_new + 4 * budget + 8)
    return need


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
        budget = device_free - needs.fixed - needs.kv_per_token * context_length - needs.activations - margin
        gpu = max(0, min(num_layers, budget // max(layer_bytes, 1)))
        if gpu < num_layers:  # streaming needs a ring (and, for packed layers, a dense buffer)
            ring = ring_slots * layer_bytes + (dense_layer_bytes if quant != "none" else 0)
            gpu = max(0, min(num_layers, (budget - ring) // max(layer_bytes, 1)))
    rest = num_layers - gpu
    ram = min(rest, fit)
    return Placement(num_layers, gpu, ram, rest - ram, layer_bytes, quant, device)


def pass_bytes(tokens: int, past: int, hidden: int, intermediate: int, num_heads: int, dtype_bytes: int) -> int:
    """Transient memory of one pass over `tokens` new tokens after `past` cached ones (no logits:
    a prefill or a first pass asks for a few rows only): residual and normed states, q/k/v/o and
    the MLP's intermediates, the additive mask and every head's attention scores over the whole
    context (SDPA's math fallback materialises them)."""
    context = past + tokens
    states = tokens * (6 * hidden + 3 * intermediate) * dtype_bytes
    scores = tokens * context * (num_heads + 1) * dtype_bytes
    mask = tokens * context * (dtype_bytes + 1)
    return states + scores + mask


def tokens_per_pass(free_bytes: int, past: int, hidden: int, intermediate: int, num_heads: int, dtype_bytes: int,
                    most: int = 1 << 16) -> int:
    """The most new tokens one pass can read with `free_bytes` for its activations: how many
    prompt tokens a prefill (or a new turn's first pass) reads per stream of the weights.
    At least 1."""
    lo, hi = 1, max(1, most)
    while lo < hi:  # pass_bytes grows with tokens: the largest n that fits
        mid = (lo + hi + 1) // 2
        if pass_bytes(mid, past, hidden, intermediate, num_heads, dtype_bytes) <= free_bytes:
            lo = mid
        else:
            hi = mid - 1
    return lo
