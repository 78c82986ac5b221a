"""Device memory for one generation: what its caches and passes need, the check that refuses a
request which cannot fit (naming the largest budget and answer length that would), and the
fallback after an out-of-memory in a step (halve the tree budget; below 1, decode one token
per pass).

Plain arithmetic on shapes plus the free-memory probe; the decode loop calls it, the planner
does not (it prices budgets, engine.planning.placement reserves room for them).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import replace

import psutil
import torch

from engine.errors import OutOfMemory
from engine.model.causal_lm import CausalLM
from engine.shapes import ModelShape
from engine.types import GenerationRequest
from engine.units import format_bytes

log = logging.getLogger(__name__)


def generation_bytes(target: ModelShape, draft: ModelShape | None, dtype_bytes: int, prompt: int,
                     max_new: int, budget: int) -> int:
    """Memory one generation allocates besides the weights, as Engine.generate sizes it: both
    caches at their full capacity (allocated up front; each layer by its kind, ModelShape.kv_bytes:
    a windowed layer holds its window plus the tree, a linear layer a fixed state), and for one
    target pass over a `budget`-token tree its hidden states, the additive mask over the whole
    cache and fp32 logits. Not the per-head attention scores (fused attention kernels never hold
    them): this is the floor a request needs, for refusing what cannot fit, not a planning
    estimate."""
    context = prompt + max_new + 8
    target_tokens = context + budget
    need = target.kv_bytes(context, budget, dtype_bytes)
    need += budget * (6 * target.hidden_size + 3 * target.activation_width) * dtype_bytes
    need += budget * target_tokens * dtype_bytes + budget * target.vocab_size * 4
    if draft is not None:
        need += draft.kv_bytes(context, 4 * budget, dtype_bytes)
    return need


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


def check_fits(target: CausalLM, draft: CausalLM | None, prompt: int, request: GenerationRequest,
               tree: int) -> None:
    """OutOfMemory, naming the largest tree budget and answer length that would fit, when the
    caches and one pass of a `tree`-token tree cannot fit in the memory free where they live (a
    budget of 10^9 would otherwise die in the allocator, asking for 100+ GB)."""
    budget = tree
    esize = target.dtype.itemsize

    def need(max_new: int, tree: int) -> int:
        return generation_bytes(target.shape, draft.shape if draft is not None else None, esize, prompt, max_new,
                                tree)

    free = free_memory(target.device)
    if need(request.max_new_tokens, budget) <= free:
        return
    where = "GPU memory" if target.device.type == "cuda" else "RAM"
    advice = []
    if budget > 1:
        most = largest(lambda b: need(request.max_new_tokens, b) <= free, budget)
        advice += [f"a tree budget of at most {most}"] if most else []
    most = largest(lambda m: need(m, budget) <= free, request.max_new_tokens)
    advice += [f"at most {most} new tokens per answer"] if most else []
    raise OutOfMemory(
        f"This request needs about {format_bytes(need(request.max_new_tokens, budget))} of {where} for its KV "
        f"caches and one pass over the tree, but {format_bytes(free)} is free. "
        + (f"Use {' or '.join(advice)}." if advice else "Start a new conversation, or free some memory.")
    )


def free_memory(device: torch.device) -> int:
    """Bytes a new allocation can get on `device`: free GPU memory plus what PyTorch's caching
    allocator holds unused; on the CPU the available RAM."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device))
    return int(psutil.virtual_memory().available)


def largest(fits: Callable[[int], bool], above: int) -> int:
    """The largest n in [0, above) with fits(n), for a monotone `fits` (0 when none)."""
    low, high = 0, above  # fits(low) is assumed (0 means "none"), fits(high) is false
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (mid, high) if fits(mid) else (low, mid)
    return low


def shrink_after_oom(request: GenerationRequest, device: torch.device) -> tuple[GenerationRequest, bool]:
    """After a device out-of-memory in a step: free cached blocks and halve the tree budget for
    the rest of the generation; below 1, decode autoregressively. Returns (request, use_spec)."""
    if device.type == "cuda":
        torch.cuda.empty_cache()
    budget = request.speculation.budget
    if budget <= 1:
        log.warning("out of device memory at tree budget 1: continuing autoregressively")
        return request, False
    log.warning("out of device memory at tree budget %d: retrying the step with %d", budget, budget // 2)
    return replace(request, speculation=replace(request.speculation, budget=budget // 2)), True
