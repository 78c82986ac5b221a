"""Reading a prompt into a model's KV cache: the chunked prefill.

A new turn reads only what the prefix cache lacks. What does not fit one pass is read in
chunks as large as the device's free memory allows (an offloaded target then streams its
weights as few times as it can); on a CPU, where a pass costs mostly its tokens' compute,
chunks are sized to take about PREFILL_STEP_S so a Stop waits for one chunk at most. The last
part of the prompt is left for the first decoding pass, which reads it together with the tree.

What this module does not do: choose what is cached (prefix_cache) or decode (generation).
"""

from __future__ import annotations

import logging
import threading
import time

import torch

from engine.decoding.memory import tokens_per_pass
from engine.decoding.verification import Sink
from engine.errors import OutOfMemory
from engine.kernels.fused_layer import PassInterrupted
from engine.model.cache import KVCache
from engine.model.causal_lm import FUSED_PASS_TOKENS, CausalLM

log = logging.getLogger(__name__)

PREFILL_FIRST_CHUNK = 32
PREFILL_MIN_CHUNK = 8
PREFILL_STEP_S = 0.3  # the time one CPU prefill chunk aims at: a Stop waits for at most one chunk
# the same where a pass stops between runs of its layers (CausalLM.can_interrupt): a Stop waits for
# one run, an eighth of this, and larger chunks read a prompt faster (an MoE's experts get more tokens
# each: the synthetic MoE Q4_K_M reads 126 tok/s in chunks of 32 and 161 in chunks of 192)
PREFILL_STEP_INTERRUPTIBLE_S = 1.2
PREFILL_ROOM_CPU = 192  # on a CPU, the most tokens the first decoding pass reads (its cost is its tokens)


def prefill(model: CausalLM, cache: KVCache, ids: list[int], leave_room: int | None = None,
            chunk: int | None = None, cancel: threading.Event | None = None, sink: Sink | None = None) -> int:
    """Read `ids[cache.length:]` into the cache; with `leave_room`, all but the last part, which
    one pass of the model can read together with `leave_room` more tokens (the first decoding
    step reads it: on a new turn that is the only weight pass before the first token). Chunks
    are as large as the device's free memory allows (memory.tokens_per_pass),
    so an offloaded target streams its weights as few times as it can; `chunk` caps them. A
    device out-of-memory halves the chunk and retries (the cache commits only after a whole
    pass). Returns the number of passes.

    A `cancel` set meanwhile stops it between chunks (the cache then holds the chunks done), so
    a Stop waits for one chunk at most. On a CPU, where a pass costs mostly its tokens' compute
    (~20 s for 512 tokens of the starter on 2 cores), chunks are therefore sized to take about
    PREFILL_STEP_S; where the pass also stops between runs of its layers (CausalLM.interruptible:
    not a streamed one) about PREFILL_STEP_INTERRUPTIBLE_S, a Stop then dropping the chunk under way.
    The first decoding pass reads at most PREFILL_ROOM_CPU (a hybrid's, before a tree, what its
    fused tree pass takes: CausalLM.tree_room); on a GPU, where
    an offloaded pass costs mostly reading the weights, they stay as large as memory allows,
    since a smaller one would only read the weights more often.

    `sink` receives each chunk's final hidden states with its first position (a draft head
    reads the target's: head_draft.HeadCache.observe)."""
    shape = model.shape
    size = tokens_per_pass(model.free_memory(), cache.length + len(ids), shape.hidden_size,
                           shape.activation_width, shape.layer.num_attention_heads, model.dtype.itemsize)
    if chunk is not None:
        size = min(size, chunk)
    most, room, adapt = size, size, model.device.type == "cpu"
    step = PREFILL_STEP_S
    if adapt:
        if cancel is not None and model.can_interrupt():  # a Stop waits for a run of layers, not a chunk
            step, most = PREFILL_STEP_INTERRUPTIBLE_S, min(most, FUSED_PASS_TOKENS)
        size, room = min(size, PREFILL_FIRST_CHUNK), min(size, PREFILL_ROOM_CPU)
        tree = model.tree_room()
        if tree is not None and leave_room is not None and leave_room > 1:
            # a hybrid's tree pass runs in C up to `tree` tokens, a larger one in the general path's blocks
            # (~0.15 s more for a 180-token prompt's tail on the synthetic Qwen3.5-MoE): the tail is read
            # here as a chain folded into the states, in one pass when it is short, and the first
            # decoding pass reads the tree alone
            room = min(room, tree)
            if len(ids) - cache.length <= PREFILL_ROOM_CPU:
                size = min(most, max(size, len(ids) - cache.length))
    last: tuple[int, float] | None = None  # (size, seconds) of the previous chunk
    passes = 0
    while len(ids) - cache.length > (0 if leave_room is None else max(room - leave_room, 0)):
        if cancel is not None and cancel.is_set():
            break
        start = cache.length
        piece = torch.tensor(ids[start : start + size])
        t0 = time.perf_counter()
        try:
            with model.interruptible(cancel):
                hidden = model.forward(piece, torch.arange(start, start + piece.shape[0]), cache, None)
        except PassInterrupted:
            break  # the Stop came mid-chunk: the cache holds the chunks before it
        except torch.OutOfMemoryError as exc:
            if size == 1:
                raise OutOfMemory("The device ran out of memory reading the prompt. Start a new "
                                  "conversation, or load the model with a shorter context.") from exc
            if model.device.type == "cuda":
                torch.cuda.empty_cache()
            size //= 2
            most = room = size
            log.warning("out of device memory in the prefill: chunks of %d tokens now", size)
            continue
        passes += 1
        if sink is not None:
            sink(start, model.head_states(hidden))
        if adapt:
            seconds = time.perf_counter() - t0
            size, last = next_prefill_chunk(piece.shape[0], seconds, last, most, step), (int(piece.shape[0]), seconds)
    return passes


def next_prefill_chunk(size: int, seconds: float, last: tuple[int, float] | None, most: int,
                       step: float = PREFILL_STEP_S) -> int:
    """The next CPU prefill chunk after one of `size` tokens took `seconds`, aiming at `step`
    seconds a chunk (see prefill)."""
    if last is not None and last[0] < size and seconds < 1.5 * last[1]:
        return most  # twice the tokens cost not much more: reading the weights dominates
    if seconds <= 0:
        return min(most, size * 2)
    fit = int(size * step / seconds)
    return max(PREFILL_MIN_CHUNK, min(most, fit, size * 2))
