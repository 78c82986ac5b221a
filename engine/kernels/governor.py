"""How many threads the CPU kernels use now: all the compute threads, or one when the machine is
busy with other work.

The fused step waits at five OpenMP barriers a layer (150 a step on the starter). When another
process holds a core, a waiting thread spins for its whole spin count while the thread it waits
for cannot run, so every barrier costs about a spin count of time. Measured on the 2-core
machine with a second process using ~1.2 cores (the starter's Q4_1 step, layers and head):

    2 threads, OpenMP's default wait         600 ms a step
    2 threads, GOMP_SPINCOUNT=10000           60 ms
    2 threads, OMP_WAIT_POLICY=passive        27 ms
    1 thread                                  12 ms

while on an idle machine 2 threads are the fastest and the passive wait costs ~20 %. So the
thread count is chosen by measurement, as the engine chooses its trees: the kernels' callers time
each one-token step, and when a model's steps become much slower than its best (or, rarely, to
look again) the other count is tried for three steps and kept if its fastest beats the recent
ones. Trying the full
count while the machine stays busy is expensive (slow steps), so the wait before the next try
doubles each time it loses, up to a cap. Text does not depend on the count: the kernels give the
same bits with any number of threads (tests/engine/kernels/test_fused_layer.py).

What this module does not do: choose the compute threads (engine.threads) or time anything
itself; `record` gets the caller's measurements, so tests drive it with their own clock.
"""

from __future__ import annotations

import statistics
import threading
from collections import deque

import torch

PROBE_EVERY = 256  # steps between looks at the other count
MAX_BACKOFF = 8  # the wait doubles each time a look loses, up to this many times PROBE_EVERY
SLOWDOWN = 3.0  # a model's recent steps this much slower than its best: look now
QUIET = 16  # steps after a look before a slowdown may call for another
FIRST_LOOK = 8  # steps before the first look: a process started on a busy machine has no fast step
# to compare with, so without an early look it ran 256 steps at 600 ms before trying one thread
WINDOW = 8
PROBE_STEPS = 3  # a look's steps, judged by the fastest: the first after a switch pays for it (the
# other count's threads still spin for a while after their last region)


class ThreadGovernor:
    """The thread count for the next kernel call (`threads()`), and what each call measured
    (`record`), per model (any hashable key: steps of a draft and a target differ in cost)."""

    def __init__(self, most: int) -> None:
        self.most = max(1, most)
        self.current = self.most
        self._probe: int | None = None
        self._tried: dict[object, list[float]] = {}  # the look's steps so far, by model
        self._since = 0  # steps since the last look
        self._backoff = 1
        self._looked = False  # the first look is FIRST_LOOK steps in
        self._recent: dict[tuple[object, int], deque[float]] = {}
        self._best: dict[tuple[object, int], float] = {}
        self._lock = threading.Lock()

    def threads(self) -> int:
        with self._lock:
            return self._probe if self._probe is not None else self.current

    def _other(self) -> int:
        return 1 if self.current != 1 else self.most

    def record(self, key: object, threads: int, seconds: float) -> None:
        """One one-token step of model `key` ran with `threads` in `seconds`."""
        if self.most == 1:
            return
        with self._lock:
            arm = (key, threads)
            self._recent.setdefault(arm, deque(maxlen=WINDOW)).append(seconds)
            self._best[arm] = min(self._best.get(arm, seconds), seconds)
            if self._probe is not None:
                if threads == self._probe:  # judged by the first model to have its steps in
                    tried = self._tried.setdefault(key, [])
                    tried.append(seconds)
                    if len(tried) >= PROBE_STEPS:
                        self._judge(key, min(tried))
                return
            if threads != self.current:
                return
            self._since += 1
            recent = list(self._recent[arm])[-4:]
            slowed = len(recent) == 4 and statistics.median(recent) > SLOWDOWN * self._best[arm]
            early = not self._looked and self._since >= FIRST_LOOK
            if early or (slowed and self._since >= QUIET) or self._since >= PROBE_EVERY * self._backoff:
                self._probe, self._tried = self._other(), {}

    def _judge(self, key: object, seconds: float) -> None:
        probe, self._probe, self._since, self._looked = self._probe, None, 0, True
        assert probe is not None
        mine = self._recent.get((key, self.current))
        if mine and seconds < 0.9 * statistics.median(list(mine)[-4:]):
            self.current, self._backoff = probe, 1
        elif probe == self.most:  # the full count lost: wait longer before the next look
            self._backoff = min(self._backoff * 2, MAX_BACKOFF)


_governor: ThreadGovernor | None = None
_made = threading.Lock()


def governor() -> ThreadGovernor:
    """The process's governor, over PyTorch's thread count when first asked."""
    global _governor
    with _made:
        if _governor is None or _governor.most != torch.get_num_threads():
            _governor = ThreadGovernor(torch.get_num_threads())
        return _governor
