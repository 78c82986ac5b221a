"""CPU threads for the compute: one per physical core.

A decode step is a run of matrix-vector products bound by memory bandwidth; a second hardware
thread on the same core shares that core's load ports and caches and adds no bandwidth, while
the extra thread in every parallel region costs synchronisation (llama.cpp defaults to physical
cores for the same reason). PyTorch's own default follows its OpenMP runtime, which counts
logical processors on most builds.

`use_compute_threads` is called when a model loads on the CPU; a choice made first with
`set_threads` (the benchmarks' --threads) or with SPECCHAT_THREADS / OMP_NUM_THREADS in the
environment is kept.
"""

from __future__ import annotations

import logging
import os

import psutil
import torch

log = logging.getLogger(__name__)

_chosen: int | None = None  # threads set on purpose (set_threads), kept by use_compute_threads


def physical_cores() -> int:
    """Physical cores this process may run on: psutil's count of cores, no more than the CPUs
    the process's affinity mask (a container's cpuset, `taskset`) allows."""
    cores = psutil.cpu_count(logical=False) or os.cpu_count() or 1
    try:
        allowed = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not on Linux
        allowed = os.cpu_count() or cores
    return max(1, min(cores, allowed))


def compute_threads() -> int:
    """The thread count to use: SPECCHAT_THREADS when it is a positive number, PyTorch's current
    count when OMP_NUM_THREADS is set (the user chose), else the physical cores."""
    named = os.environ.get("SPECCHAT_THREADS", "").strip()
    if named.isdigit() and int(named) > 0:
        return int(named)
    if os.environ.get("OMP_NUM_THREADS", "").strip():
        return torch.get_num_threads()
    return physical_cores()


def set_threads(n: int) -> None:
    """Use `n` threads from now on, and keep them when a model loads."""
    global _chosen
    _chosen = n
    torch.set_num_threads(n)


def use_compute_threads() -> int:
    """Set PyTorch's intra-op threads to compute_threads() unless set_threads chose already;
    the count in use."""
    n = _chosen if _chosen is not None else compute_threads()
    if torch.get_num_threads() != n:
        log.info("CPU threads: %d (was %d)", n, torch.get_num_threads())
        torch.set_num_threads(n)
    return n
