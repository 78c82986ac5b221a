"""One instance per data folder (app/single_instance.py), with real processes:

- launches started at the same moment (a barrier releases them together), several rounds:
  exactly one stays running and every other one asked it to raise its window;
- a killed instance (SIGKILL: its lock and its socket file left behind) does not block the next;
- a second launch of the real app raises the first window, exits, and logs no "started";
- a read-only data folder still gives one instance (the unlocked fallback).
"""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from pytestqt.qtbot import QtBot

from app.single_instance import LOCK_NAME, Running, SingleInstance, acquire, server_name

REPO = Path(__file__).resolve().parents[2]
LAUNCHES = 4
ROUNDS = 6
BARRIER_S = 0.3  # from handing out the start time to the start
LINE_TIMEOUT_S = 60

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


class Launch:
    """One launch in a subprocess; its output lines arrive in a queue (a hung child fails the
    test after LINE_TIMEOUT_S instead of hanging it)."""

    def __init__(self, data: Path) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", CHILD, str(data)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=_env(data),
                                     cwd=REPO)
        self._lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._lines.put(line.strip())
        self._lines.put("<exited>")

    def line(self) -> str:
        try:
            return self._lines.get(timeout=LINE_TIMEOUT_S)
        except queue.Empty:
            return "<no answer>"

    def start_at(self, moment: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(moment)
        self.proc.stdin.flush()

    def end(self, how: signal.Signals = signal.SIGTERM) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(how)
        self.proc.wait(timeout=30)


def _launch_together(data: Path, n: int) -> list[Launch]:
    """`n` launches that reach the check at the same moment: once every one is ready, each is
    given the same start time a little ahead."""
    launches = [Launch(data) for _ in range(n)]
    for launch in launches:
        assert launch.line() == "ready"
    start = f"{time.time() + BARRIER_S}\n"
    for launch in launches:
        launch.start_at(start)
    return launches


def test_launches_at_the_same_moment_leave_exactly_one_running(tmp_path: Path) -> None:
    data = tmp_path / "data"
    for round_ in range(ROUNDS):
        launches = _launch_together(data, LAUNCHES)
        try:
            firsts = []
            for launch in launches:
                line = launch.line()
                if line == "first":
                    firsts.append(launch)
                else:
                    assert line == "second True", (round_, line)
                    assert launch.proc.wait(timeout=30) == 0
            assert len(firsts) == 1, f"round {round_}: {len(firsts)} instances running"
            first = firsts[0]
            assert [first.line() for _ in range(LAUNCHES - 1)] == ["raise"] * (LAUNCHES - 1)
            assert first.proc.poll() is None  # still running
        finally:
            for launch in launches:  # every other round killed outright: its lock and socket file stay behind
                launch.end(signal.SIGKILL if round_ % 2 else signal.SIGTERM)
    assert (data / LOCK_NAME).is_file()


def test_a_killed_instance_does_not_block_the_next_start(qtbot: QtBot, tmp_path: Path) -> None:
    data = tmp_path / "data"
    [launch] = _launch_together(data, 1)
    assert launch.line() == "first"
    launch.end(signal.SIGKILL)
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
