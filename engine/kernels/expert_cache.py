"""Which routed experts of an MoE model run on the GPU while the rest run on the CPU: the hot
set kept de-quantised in the VRAM a placement leaves spare (`PackedExperts.cache`), chosen by
how often tokens route to each expert, and those routing counts kept between processes.

With `--experts cpu` (or "auto" for an MoE GGUF too big for the GPU) attention, norms, router,
shared experts, embeddings and caches are on the GPU and the routed experts run packed on the
CPU. Whatever VRAM is left holds some experts in the model's dtype; a token routed to one of
them has it computed on the GPU, queued before the CPU starts on the token's other experts, so
both run at once. The share of routed work the cache takes is the share of routed (token,
expert) pairs that land on a cached expert: with routing spread evenly, the share of experts
cached; measured counts pick the experts that serve more.

Slots are given out over the whole model, not per layer: the (layer, expert) pairs with the
most routed tokens (counts from this process and the saved ones of earlier processes), so a
layer whose routing is concentrated gets more of them. Without counts the slots are spread
evenly over the layers. `rebalance` re-picks between answers and copies only experts new to
a layer's set, at most `max_copies` of them a time, so an answer never waits long for it.

The counts file (`<data>/routing/<target fingerprint hash>.json`) is untrusted input: a size
bound, one list of whole numbers >= 0 per MoE layer with the model's experts; anything else is
ignored with one log line.

What this module does not do: run experts (experts.py) or decide that experts run on the CPU
(engine.loading.layer_plan.experts_on_cpu).
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from engine import paths
from engine.errors import EngineError
from engine.kernels.experts import PackedExperts
from engine.untrusted import read_json_file

log = logging.getLogger(__name__)

VERSION = 1
MAX_BYTES = 8 * 1024 * 1024
MAX_COPIES = 256  # experts de-quantised and copied by one rebalance
MIN_GAIN = 0.02  # a rebalance moves experts only for this much more of the routed pairs served


def packed_experts(model: nn.Module) -> list[PackedExperts]:
    """The model's PackedExperts in layer order (module order)."""
    return [m for m in model.modules() if isinstance(m, PackedExperts)]


@dataclass(frozen=True)
class CacheState:
    """What the cache holds: experts cached over the model's routed experts, their bytes, and
    the share of the counted routed pairs they serve (nan without counts)."""

    cached: int
    experts: int
    nbytes: int
    served: float

    @property
    def fraction(self) -> float:
        return self.cached / self.experts if self.experts else 0.0


def choose(counts: Sequence[Sequence[float]] | None, layers: int, experts: int, slots: int) -> list[list[int]]:
    """Each layer's experts to cache for `slots` in all: the (layer, expert) pairs with the most
    counted tokens, ties by layer then expert; without counts (or none counted) an even spread,
    the first layers taking the remainder."""
    slots = max(0, min(slots, layers * experts))
    if counts is None or not any(any(c > 0 for c in row) for row in counts):
        share = [slots // layers + (1 if i < slots % layers else 0) for i in range(layers)]
        return [list(range(n)) for n in share]
    ranked = sorted(((float(c), -i, -e) for i, row in enumerate(counts) for e, c in enumerate(row)), reverse=True)
    out: list[list[int]] = [[] for _ in range(layers)]
    for _, i, e in ranked[:slots]:
        out[-i].append(-e)
    return [sorted(ids) for ids in out]


def served(counts: Sequence[Sequence[float]], sets: Sequence[Sequence[int]]) -> float:
    """The share of the counted routed pairs the cached sets serve."""
    total = sum(sum(row) for row in counts)
    if total <= 0:
        return float("nan")
    return sum(sum(row[e] for e in ids if e >= 0) for row, ids in zip(counts, sets, strict=True)) / total


def fill(model: nn.Module, budget_bytes: int, device: torch.device | str, dtype: torch.dtype,
         counts: Sequence[Sequence[float]] | None = None) -> CacheState:
    """Cache as many experts as `budget_bytes` holds on `device` (in `dtype`), chosen by
    `counts` (else spread evenly; one row per MoE layer, packed_experts' order). Biases (gpt-oss)
    are cached beside their experts' matrices."""
    modules = packed_experts(model)
    if not modules:
        return CacheState(0, 0, 0, float("nan"))
    if counts is not None and len(counts) != len(modules):
        counts = None
    size = torch.empty((), dtype=dtype).element_size()
    per_expert = max(m.expert_nbytes for m in modules) * size // 4
    slots = max(0, budget_bytes) // per_expert
    sets = choose(counts, len(modules), modules[0].num_experts, int(slots))
    for m, ids in zip(modules, sets, strict=True):
        m.cache(ids, device, dtype)
    return state(model, counts)


def state(model: nn.Module, counts: Sequence[Sequence[float]] | None = None) -> CacheState:
    modules = packed_experts(model)
    cached = sum(e >= 0 for m in modules for e in m.hot_ids)
    experts = sum(m.num_experts for m in modules)
    share = served(counts, [m.hot_ids for m in modules]) if counts is not None else float("nan")
    return CacheState(cached, experts, sum(m.cached_nbytes for m in modules), share)


def current_counts(model: nn.Module, seed: Sequence[Sequence[float]] | None = None) -> list[list[float]]:
    """Routed tokens per expert per MoE layer: this process's (`PackedExperts.hits`) and `seed`'s."""
    modules = packed_experts(model)
    rows = [m.hits.tolist() for m in modules]
    if seed is not None and len(seed) == len(rows):
        rows = [[a + b for a, b in zip(r, s, strict=True)] if len(s) == len(r) else r for r, s in zip(rows, seed)]
    return [[float(c) for c in r] for r in rows]


def rebalance(model: nn.Module, seed: Sequence[Sequence[float]] | None = None,
              max_copies: int = MAX_COPIES) -> int:
    """Re-pick each layer's cached experts by the counts so far, keeping its number of slots
    (no memory moves between layers: `fill` at the next load spreads them by the saved counts):
    where that serves at least MIN_GAIN more of the routed pairs, the layers whose sets gain most
    take theirs first, as many as `max_copies` experts allow. Returns the experts copied."""
    modules = packed_experts(model)
    if not modules or not any(m.hot_ids for m in modules):
        return 0
    counts = current_counts(model, seed)
    now = [list(m.hot_ids) for m in modules]
    sets = [sorted(sorted(range(m.num_experts), key=lambda e: (-row[e], e))[: len(ids)])
            for m, row, ids in zip(modules, counts, now, strict=True)]
    if not served(counts, sets) >= served(counts, now) + MIN_GAIN:
        return 0
    ref = next(m._hot for m in modules if m._hot is not None)
    device, dtype = ref[0].device, ref[0].dtype
    gain = sorted(range(len(modules)), key=lambda i: -(sum(counts[i][e] for e in sets[i]) - sum(counts[i][e] for e in now[i])))
    copied = 0
    for i in gain:
        new = len(set(sets[i]) - set(now[i]))
        if new and copied + new <= max_copies:
            copied += modules[i].cache(sets[i], device, dtype)
    if copied:
        log.info("expert cache: %d experts moved to the GPU (now serving %.0f %% of the routed tokens counted)",
                 copied, 100 * served(counts, [m.hot_ids for m in modules]))
    return copied


class RoutingCounts:
    """An engine's side of the cache: the counts earlier processes saved for this model (the
    seed), and after each answer this process's added to them, saved, and the cache rebalanced.
    Inactive (`active` False) for a model with no experts cached."""

    def __init__(self, model: nn.Module, fingerprint: str, root: Path | None = None) -> None:
        self.model = model
        modules = packed_experts(model)
        self.file = CountsFile.of(fingerprint, root) if any(m.hot_ids for m in modules) else None
        self.seed = self.file.load(len(modules), modules[0].num_experts) if self.file is not None else None

    @property
    def active(self) -> bool:
        return self.file is not None

    def after_answer(self) -> int:
        """Save the counts and rebalance; the experts copied."""
        if self.file is None:
            return 0
        self.file.save(current_counts(self.model, self.seed))
        try:
            return rebalance(self.model, self.seed)
        except torch.OutOfMemoryError:  # the copies' temporaries did not fit: the cache stays as it is
            log.warning("expert cache: out of memory moving experts; the cached set stays as it was")
            return 0


# ---- the counts kept between processes --------------------------------------------------------
class CountsFile:
    """One target's routing counts on disk."""

    def __init__(self, path: Path, key: str) -> None:
        self.path, self.key = path, key
        self._warned = False

    @classmethod
    def of(cls, fingerprint: str, root: Path | None = None) -> CountsFile | None:
        if not fingerprint:
            return None
        name = hashlib.sha256(fingerprint.encode()).hexdigest()[:32] + ".json"
        return cls((root or paths.data_dir() / "routing") / name, fingerprint)

    def load(self, layers: int, experts: int) -> list[list[float]] | None:
        """The saved counts for `layers` MoE layers of `experts` each, or None (no file, another
        model, or a file that does not hold them: logged)."""
        if not self.path.is_file():
            return None
        try:
            data = read_json_file(self.path, what="the routing counts", max_bytes=MAX_BYTES)
            return _checked(data, self.key, layers, experts)
        except (EngineError, OSError, ValueError) as exc:
            log.info("ignoring %s: %s", self.path.name, getattr(exc, "user_message", exc))
            return None

    def save(self, counts: Iterable[Iterable[float]]) -> None:
        rows = [[int(c) for c in row] for row in counts]
        try:
            paths.write_json_atomic(self.path, {"version": VERSION, "key": self.key, "counts": rows}, indent=None)
        except OSError as exc:
            if not self._warned:
                log.warning("could not save the routing counts to %s: %s", self.path.parent, exc)
                self._warned = True


def _checked(data: object, key: str, layers: int, experts: int) -> list[list[float]]:
    if not isinstance(data, dict) or data.get("version") != VERSION or data.get("key") != key:
        raise ValueError("another version or model")
    rows = data.get("counts")
    if not isinstance(rows, list) or len(rows) != layers:
        raise ValueError(f"counts: not {layers} layers")
    out = []
    for row in rows:
        if not isinstance(row, list) or len(row) != experts or not all(
                isinstance(c, int) and not isinstance(c, bool) and 0 <= c < 2**62 for c in row):
            raise ValueError(f"counts: a layer is not {experts} whole numbers >= 0")
        out.append([float(c) for c in row])
    return out
