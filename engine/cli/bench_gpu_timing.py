"""How `specchat bench gpu` times things: whole passes, plain copies, the streamer alone, each
layer of a pass, and decoding steps as the engine runs them.

Every timed region starts and ends with a device synchronisation (torch.cuda.synchronize waits
for all streams, the streamer's copy stream included), so a figure is the region's own work.
Per-layer times come from CUDA events recorded on the compute stream through the streamer's
after_layer hook; on CPU, where layers run synchronously, from the wall clock.

What this module does not do: build models, decide what to measure or compare with the
planner (bench_gpu_passes).
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from engine.decoding.acceptance import AcceptanceModel
from engine.decoding.drafting import grow_tree
from engine.decoding.prefill import prefill
from engine.decoding.sampling import choose_token
from engine.decoding.verification import accept, prune_to_accepted, run_tree
from engine.model.causal_lm import CausalLM
from engine.offload.host_store import HostStore
from engine.offload.streamer import LayerStreamer
from engine.types import SamplingSettings, SpeculationSettings

MAX_DEPTH = SpeculationSettings().max_depth
GREEDY = SamplingSettings()


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def seconds(fn: Callable[[], object], device: torch.device) -> float:
    sync(device)
    t0 = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - t0


def best(fn: Callable[[], object], device: torch.device, repeats: int) -> float:
    """Fastest of `repeats` runs after one warm-up (the figure least disturbed by other work)."""
    fn()
    return min(seconds(fn, device) for _ in range(repeats))


def random_ids(n: int, vocab: int, seed: int) -> torch.Tensor:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed))


def out_of_memory(exc: BaseException) -> bool:
    """torch's allocator raises OutOfMemoryError; cuBLAS and some kernels report the same
    condition as a RuntimeError."""
    text = str(exc)
    return isinstance(exc, torch.OutOfMemoryError) or "out of memory" in text or "ALLOC_FAILED" in text


class LayerClock:
    """Per-layer times of the passes run inside `measuring()`. Each layer's time runs from the
    previous layer's end, so a streamed layer's includes waiting for its copy."""

    def __init__(self, streamer: LayerStreamer, device: torch.device) -> None:
        self.streamer, self.cuda = streamer, device.type == "cuda"
        self.resident = [h.store_index is None for h in streamer.homes]
        self._marks: list[tuple[int, Any]] = []
        self.passes: list[list[tuple[int, float]]] = []  # per pass: (layer, seconds)

    def _now(self) -> Any:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()  # on the current (compute) stream
            return event
        return time.perf_counter()

    @contextmanager
    def measuring(self) -> Iterator[None]:
        self._marks = [(-1, self._now())]
        self.streamer.after_layer = lambda i: self._marks.append((i, self._now()))
        try:
            yield
        finally:
            self.streamer.after_layer = None

    def collect(self) -> None:
        """Turn the marks of the last pass into layer times (after the device synced)."""
        marks = self._marks
        out = [(i, a.elapsed_time(b) / 1e3 if self.cuda else b - a) for (_, a), (i, b) in zip(marks, marks[1:])]
        if out:
            self.passes.append(out)
        self._marks = []

    def split(self) -> tuple[float | None, float | None]:
        """Median seconds of a resident layer and of a streamed layer over the collected passes
        (each pass's first layer is left out: its time includes the embeddings and the mask)."""
        res = [s for p in self.passes for i, s in p[1:] if self.resident[i]]
        st = [s for p in self.passes for i, s in p[1:] if not self.resident[i]]
        return (statistics.median(res) if res else None, statistics.median(st) if st else None)


def plain_copy_seconds(store: HostStore, layers: int, device: torch.device, repeats: int) -> float:
    """A plain copy of every layer from the store's (pinned) arenas into one device buffer, back
    to back on one stream: the ceiling a streamed pass aims at."""
    dst = torch.empty(store.layer_nbytes, dtype=torch.uint8, device=device)

    def run() -> None:
        for j in range(layers):
            dst.copy_(store.source(j), non_blocking=True)

    return best(run, device, repeats)


def pass_seconds(model: CausalLM, tokens: int, repeats: int, clock: LayerClock | None = None) -> float:
    """Fastest of `repeats` passes over `tokens` new tokens after 64 cached ones (after a
    warm-up); the timed passes' layer times go to `clock`."""
    context = 64
    vocab = model.shape.vocab_size
    cache = model.new_cache(context + tokens + 8)
    model.forward(random_ids(context, vocab, 3), torch.arange(context), cache, None)
    ids, pos = random_ids(tokens, vocab, 4), torch.arange(context, context + tokens)

    def run() -> None:
        cache.truncate(context)
        model.forward(ids, pos, cache, None)

    run()
    fastest = math.inf
    for _ in range(repeats):
        if clock is None:
            fastest = min(fastest, seconds(run, model.device))
            continue
        with clock.measuring():
            fastest = min(fastest, seconds(run, model.device))
        clock.collect()
    return fastest


@torch.inference_mode()
def stream_only(model: CausalLM, tokens: int) -> None:
    """One pass of the streamer with layers that do nothing: copies and dequantisation alone."""
    assert model.streamer is not None
    hidden = torch.zeros(1, tokens, model.shape.hidden_size, dtype=model.dtype, device=model.device)
    model.streamer.run(hidden, lambda layer, i, h: h)


class StepTimer:
    """Decoding steps as the engine runs them (generation.Engine._ar_step and _spec_step, with
    the same cache invariant: the target cache holds every committed token but the last), on a
    random prompt, greedy, timed part by part: draft (tree growth), target (the pass over the
    tree, or the single token and its head), other (acceptance walk and cache pruning).

    Trees grow to the full budget (min_pass_gain 0): a random draft is too unsure of itself for
    the gain rule, which would stop after the first pass."""

    def __init__(self, target: CausalLM, draft: CausalLM, prompt: int, steps: int, max_budget: int) -> None:
        assert target.streamer is not None
        self.target, self.draft, self.device = target, draft, target.device
        self.vocab = min(target.shape.vocab_size, draft.shape.vocab_size)
        room = prompt + steps * (MAX_DEPTH + 1)  # each step commits at most depth + 1 tokens
        self.tcache = target.new_cache(room + max_budget + 8)
        self.dcache = draft.new_cache(room + 4 * max_budget + 8)  # as the engine sizes it
        self.seq: list[int] = random_ids(prompt, self.vocab, seed=2).tolist()
        prefill(target, self.tcache, self.seq[:-1])
        prefill(draft, self.dcache, self.seq[:-1])
        self.clock = LayerClock(target.streamer, self.device)

    def autoregressive(self) -> dict[str, float]:
        seq, dev = self.seq, self.device
        sync(dev)
        t0 = time.perf_counter()
        with self.clock.measuring():
            hidden = self.target.forward(torch.tensor(seq[-1:]), torch.tensor([len(seq) - 1]), self.tcache, None)
        token = choose_token(self.target.logits(hidden)[0], GREEDY, None)
        sync(dev)
        target_s = time.perf_counter() - t0
        self.clock.collect()
        seq.append(token)
        return {"draft_s": 0.0, "target_s": target_s, "other_s": 0.0, "draft_passes": 0, "tree_nodes": 1, "tokens": 1}

    def speculative(self, budget: int) -> dict[str, float]:
        seq, dev, tcache, dcache = self.seq, self.device, self.tcache, self.dcache
        spec = SpeculationSettings(budget=budget, max_depth=MAX_DEPTH, min_pass_gain=0.0)
        pending = torch.tensor(seq[dcache.length:])  # committed tokens the draft has not read
        sync(dev)
        t0 = time.perf_counter()
        trace = grow_tree(self.draft, dcache, pending, spec, GREEDY, self.vocab, AcceptanceModel())
        sync(dev)
        t1 = time.perf_counter()
        past = tcache.length
        with self.clock.measuring():
            hidden = run_tree(self.target, tcache, trace.tree)
        sync(dev)
        t2 = time.perf_counter()
        self.clock.collect()
        found = accept(trace.tree, hidden, self.target.logits, lambda x, _: choose_token(x, GREEDY, None),
                       MAX_DEPTH + 1)
        prune_to_accepted(tcache, past, dcache, trace.slots, found.path)
        sync(dev)
        seq.extend(found.tokens)
        return {"draft_s": t1 - t0, "target_s": t2 - t1, "other_s": time.perf_counter() - t2,
                "draft_passes": trace.passes, "tree_nodes": len(trace.tree), "tokens": len(found.tokens)}

    def rollback(self, draft_length: int) -> None:
        """After a failed step: both caches back to the committed state, as the engine does."""
        self.tcache.truncate(len(self.seq) - 1)
        self.dcache.truncate(min(draft_length, self.dcache.length))
