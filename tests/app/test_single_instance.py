"""A second launch over the same data folder raises the first window and exits."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from pytestqt.qtbot import QtBot

from app.single_instance import SingleInstance, acquire, server_name

REPO = Path(__file__).resolve().parents[2]


def test_a_second_launch_asks_the_first_to_raise_and_exits(qtbot: QtBot, tmp_path: Path) -> None:
    data = tmp_path / "data"
    first = acquire(data)
    assert isinstance(first, SingleInstance)
    try:
        env = dict(os.environ, QT_QPA_PLATFORM="offscreen", SPECCHAT_DATA_DIR=str(data), SPECCHAT_SKIP_WIZARD="1")
        with qtbot.waitSignal(first.raise_requested, timeout=60_000):
            proc = subprocess.Popen([sys.executable, "-c", "import sys; from app.main import main; sys.exit(main([]))"],
                                    cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        out, _ = proc.communicate(timeout=60)
        assert proc.returncode == 0 and b"already running" in out
    finally:
        first.server.close()


def test_other_data_folders_are_other_instances(qtbot: QtBot, tmp_path: Path) -> None:
    assert server_name(tmp_path / "a") != server_name(tmp_path / "b")
    a = acquire(tmp_path / "a")
    b = acquire(tmp_path / "b")
    assert a is not None and b is not None
    assert acquire(tmp_path / "a") is None  # while a listens
    a.server.close()
    b.server.close()
    again = acquire(tmp_path / "a")  # the name is free again
    assert again is not None
    again.server.close()
