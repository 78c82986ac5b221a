"""One instance per data folder (app/single_instance.py), with real processes:

- launches started at the same moment (a barrier releases them together), several rounds:
  exactly one stays running and every other one asked it to raise its window;
- a killed instance (SIGKILL: its lock and its socket file left behind) does not block the next;
- a second launch of the real app raises the first window, exits, and logs no "started";
- a read-only data folder still gives one instance (the unlocked fallback).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from pytestqt.qtbot import QtBot

from app.single_instance import LOCK_NAME, Running, SingleInstance, acquire, server_name

REPO = Path(__file__).resolve().parents[2]
LAUNCHES = 4
ROUNDS = 6
BARRIER_S = 0.3  # from handing out the start time to the start

# One launch: Qt up, then the barrier (a start time on stdin, then spinning until that moment, so
# the launches are running, not waking up, when it comes), then the single-instance check.
CHILD = """
import os, sys, time
from pathlib import Path
from PySide6.QtCore import QTimer
from PySide6.QtWidgets import QApplication
from app.single_instance import SingleInstance, acquire
app = QApplication([])
print("ready", flush=True)
start = float(sys.stdin.readline())
while time.time() < start:
    pass
got = acquire(Path(sys.argv[1]))
if isinstance(got, SingleInstance):
    print("first", flush=True)
    got.raise_requested.connect(lambda: print("raise", flush=True))
    QTimer.singleShot(60_000, app.quit)
    app.exec()
else:
    print("second", getattr(got, "raised", None), flush=True)
"""


def _env(data: Path, **extra: str) -> dict[str, str]:
    return dict(os.environ, QT_QPA_PLATFORM="offscreen", SPECCHAT_DATA_DIR=str(data), SPECCHAT_SKIP_WIZARD="1",
                PYTHONPATH=str(REPO), **extra)


def _launch_together(data: Path, n: int) -> list[subprocess.Popen[str]]:
    """`n` launches that reach the check at the same moment: once every one is ready, each is
    given the same start time a little ahead."""
    procs = [subprocess.Popen([sys.executable, "-c", CHILD, str(data)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, env=_env(data), cwd=REPO)
             for _ in range(n)]
    for proc in procs:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    start = f"{time.time() + BARRIER_S}\n"
    for proc in procs:
        assert proc.stdin is not None
        proc.stdin.write(start)
        proc.stdin.flush()
    return procs


def test_launches_at_the_same_moment_leave_exactly_one_running(tmp_path: Path) -> None:
    data = tmp_path / "data"
    for round_ in range(ROUNDS):
        procs = _launch_together(data, LAUNCHES)
        try:
            firsts = []
            for proc in procs:
                assert proc.stdout is not None
                line = proc.stdout.readline().strip()
                if line == "first":
                    firsts.append(proc)
                else:
                    assert line == "second True", (round_, line)
                    assert proc.wait(timeout=30) == 0
            assert len(firsts) == 1, f"round {round_}: {len(firsts)} instances running"
            first = firsts[0]
            assert first.stdout is not None
            raises = [first.stdout.readline().strip() for _ in range(LAUNCHES - 1)]
            assert raises == ["raise"] * (LAUNCHES - 1)
            assert first.poll() is None  # still running
        finally:
            for proc in procs:
                if proc.poll() is None:
                    # the last round is killed outright: its lock and socket file stay behind
                    proc.send_signal(signal.SIGKILL if round_ % 2 else signal.SIGTERM)
                proc.wait(timeout=30)
    assert (data / LOCK_NAME).is_file()


def test_a_killed_instance_does_not_block_the_next_start(qtbot: QtBot, tmp_path: Path) -> None:
    data = tmp_path / "data"
    procs = _launch_together(data, 1)
    proc = procs[0]
    assert proc.stdout is not None and proc.stdout.readline().strip() == "first"
    proc.kill()
    proc.wait(timeout=30)
    started = time.monotonic()
    again = acquire(data)
    assert isinstance(again, SingleInstance) and again.locked
    assert time.monotonic() - started < 2.0  # no waiting on the dead one
    try:
        assert isinstance(acquire(data), Running)  # and it holds the folder now
    finally:
        again.release()


def test_a_second_launch_raises_the_first_exits_and_logs_no_start(qtbot: QtBot, tmp_path: Path) -> None:
    data, logs = tmp_path / "data", tmp_path / "logs"
    first = acquire(data)
    assert isinstance(first, SingleInstance)
    try:
        env = _env(data, SPECCHAT_LOG_DIR=str(logs))
        with qtbot.waitSignal(first.raise_requested, timeout=60_000):
            proc = subprocess.Popen([sys.executable, "-c", "import sys; from app.main import main; sys.exit(main([]))"],
                                    cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        out, _ = proc.communicate(timeout=60)
        assert proc.returncode == 0 and b"already running; its window was raised" in out
        log = logs / "specchat.log"
        assert not log.exists() or "SpecChat started" not in log.read_text(encoding="utf-8")
    finally:
        first.release()


def test_other_data_folders_are_other_instances(qtbot: QtBot, tmp_path: Path) -> None:
    assert server_name(tmp_path / "a") != server_name(tmp_path / "b")
    a = acquire(tmp_path / "a")
    b = acquire(tmp_path / "b")
    assert isinstance(a, SingleInstance) and isinstance(b, SingleInstance)
    assert isinstance(acquire(tmp_path / "a"), Running)  # while a runs
    a.release()
    b.release()
    again = acquire(tmp_path / "a")  # free again
    assert isinstance(again, SingleInstance)
    again.release()


@pytest.mark.parametrize("how", ["read-only folder", "lock path is a folder"])
def test_without_a_lock_file_there_is_still_one_instance(qtbot: QtBot, tmp_path: Path, how: str) -> None:
    data = tmp_path / "data"
    data.mkdir()
    if how == "read-only folder":
        if sys.platform == "win32" or os.geteuid() == 0:
            pytest.skip("root writes into read-only folders")
        data.chmod(0o555)
    else:
        (data / LOCK_NAME).mkdir()
    try:
        first = acquire(data)
        assert isinstance(first, SingleInstance) and not first.locked
        try:
            assert isinstance(acquire(data), Running)
        finally:
            first.release()
    finally:
        data.chmod(0o755)
