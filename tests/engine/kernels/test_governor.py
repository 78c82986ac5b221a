"""The thread governor (engine/kernels/governor.py) under a simulated clock: the costs a 2-core
machine measured for the starter's step (idle: 2 threads 10 ms, 1 thread 18 ms; another process
holding a core: 2 threads 600 ms, 1 thread 12 ms)."""

from __future__ import annotations

from collections.abc import Callable

from engine.kernels.governor import FIRST_LOOK, MAX_BACKOFF, PROBE_EVERY, PROBE_STEPS, ThreadGovernor

IDLE = {2: 0.010, 1: 0.018}
BUSY = {2: 0.600, 1: 0.012}


def run(gov: ThreadGovernor, steps: int, cost: Callable[[int], float], key: object = "target") -> list[int]:
    used = []
    for _ in range(steps):
        t = gov.threads()
        used.append(t)
        gov.record(key, t, cost(t))
    return used


def test_an_idle_machine_keeps_every_thread_and_rarely_looks() -> None:
    gov = ThreadGovernor(2)
    used = run(gov, 2000, IDLE.__getitem__)
    assert gov.current == 2
    assert 1 <= used.count(1) <= (2000 // PROBE_EVERY + 1) * PROBE_STEPS  # a look now and then
    assert sum(IDLE[t] for t in used) < 1.02 * 2000 * IDLE[2]


def test_a_busy_machine_drops_to_one_thread_fast_and_pays_little_to_look_back() -> None:
    gov = ThreadGovernor(2)
    run(gov, 100, IDLE.__getitem__)
    used = run(gov, 40, BUSY.__getitem__)
    assert gov.current == 1
    assert used.count(2) <= 20  # the slowdown is seen within a few steps
    assert used[-1] == 1
    used = run(gov, 6000, BUSY.__getitem__)
    slow = used.count(2)
    assert 1 <= slow <= 5 * PROBE_STEPS  # the looks back at 2 threads back off: 256, 512, 1024, 2048 steps apart
    seconds = sum(BUSY[t] for t in used)
    assert seconds < 1.25 * 6000 * BUSY[1]


def test_a_process_started_on_a_busy_machine_looks_within_a_few_steps() -> None:
    """No fast step to compare with: without the early look it ran PROBE_EVERY steps at 600 ms."""
    gov = ThreadGovernor(2)
    used = run(gov, 40, BUSY.__getitem__)
    assert gov.current == 1
    assert used.count(2) == FIRST_LOOK
    assert set(used[FIRST_LOOK:]) == {1}


def test_the_machine_freed_again_gets_its_threads_back() -> None:
    gov = ThreadGovernor(2)
    run(gov, 50, IDLE.__getitem__)
    run(gov, 5000, BUSY.__getitem__)
    assert gov.current == 1
    used = run(gov, PROBE_EVERY * MAX_BACKOFF + 10, IDLE.__getitem__)
    assert gov.current == 2
    assert used[-1] == 2


def test_models_of_different_costs_are_judged_each_against_itself() -> None:
    """A draft's steps are 10x cheaper than the target's; interleaved on an idle machine they do
    not look like a slowdown of either."""
    gov = ThreadGovernor(2)
    seconds = 0.0
    for _ in range(600):
        seconds += sum(IDLE[t] for t in run(gov, 1, IDLE.__getitem__, key="target"))
        seconds += sum(IDLE[t] / 10 for t in run(gov, 3, lambda t: IDLE[t] / 10, key="draft"))
    assert gov.current == 2
    assert seconds < 1.02 * 600 * (IDLE[2] + 3 * IDLE[2] / 10)  # the looks cost under 2 %


def test_one_thread_has_nothing_to_choose() -> None:
    gov = ThreadGovernor(1)
    assert set(run(gov, 300, BUSY.__getitem__)) == {1}
