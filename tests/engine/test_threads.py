"""CPU threads for the compute (engine.threads): the physical cores this process may run on,
unless the user named a count; a count the benchmarks set on purpose survives a model load."""

from __future__ import annotations

import os

import psutil
import pytest
import torch

from engine import threads


@pytest.fixture(autouse=True)
def _restore() -> object:
    before, chosen = torch.get_num_threads(), threads._chosen
    yield
    torch.set_num_threads(before)
    threads._chosen = chosen


def test_physical_cores_within_the_affinity_mask(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SPECCHAT_THREADS", raising=False)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(psutil, "cpu_count", lambda logical=True: 16 if logical else 8)  # 2 threads per core
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)), raising=False)
    assert threads.compute_threads() == 8  # not the 16 logical processors
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2}, raising=False)  # a container's cpuset
    assert threads.compute_threads() == 3
    monkeypatch.setattr(psutil, "cpu_count", lambda logical=True: None)  # psutil cannot tell
    monkeypatch.setattr(os, "cpu_count", lambda: 4)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(4)), raising=False)
    assert threads.compute_threads() == 4


def test_a_count_the_user_names_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPECCHAT_THREADS", "3")
    assert threads.compute_threads() == 3
    for bad in ("0", "-2", "many", ""):
        monkeypatch.setenv("SPECCHAT_THREADS", bad)
        assert threads.compute_threads() >= 1
    monkeypatch.delenv("SPECCHAT_THREADS")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    assert threads.compute_threads() == 1


def test_a_count_set_on_purpose_survives_a_load(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPECCHAT_THREADS", "2")
    threads._chosen = None
    assert threads.use_compute_threads() == 2 and torch.get_num_threads() == 2
    threads.set_threads(1)
    assert threads.use_compute_threads() == 1 and torch.get_num_threads() == 1
