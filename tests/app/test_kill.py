"""The app killed with SIGKILL mid-answer keeps every token it had shown.

The real app runs as a subprocess (offscreen) over a tmp data dir with the tiny pair. Two
documented test hooks (app/main.py): SPECCHAT_TEST_AUTOSEND sends a prompt once the model has
loaded; SPECCHAT_TEST_SHOWN_LOG appends, after every render of the streaming answer, the text the
window then showed. The test polls the database until the answer has grown over a few renders,
kills the process, and checks that the database text extends the last text the window showed.
An app that saved on a timer (or only on stop) fails this: its last renders are not saved yet.
"""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest
from PySide6.QtCore import QSettings

from app.state.conversations import default_path
from app.state.preferences import Preferences
from app.state.preferences_store import PreferencesStore

REPO = Path(__file__).resolve().parents[2]


def _assistant_text(db_path: Path) -> str | None:
    if not db_path.exists():
        return None
    try:
        db = sqlite3.connect(f"file:{db_path}?mode=ro", uri=True, timeout=1.0)
        try:
            row = db.execute("SELECT content FROM messages WHERE role = 'assistant' ORDER BY id DESC LIMIT 1").fetchone()
        finally:
            db.close()
    except sqlite3.OperationalError:  # the app has not created the tables yet
        return None
    return row[0] if row else None


def _shown(log: Path) -> list[str]:
    if not log.exists():
        return []
    lines = log.read_text(encoding="utf-8").split("\n")[:-1]  # a line cut by the kill has no newline
    return [json.loads(line)["text"] for line in lines]


@pytest.mark.skipif(sys.platform == "win32", reason="SIGKILL is POSIX")
def test_sigkill_mid_answer_loses_nothing_shown(tmp_path: Path, tiny_target_path: Path,
                                                 tiny_draft_path: Path) -> None:
    config = tmp_path / "config"
    prefs = Preferences(target=str(tiny_target_path), draft=str(tiny_draft_path), temperature=0.0,
                        max_new_tokens=1800, device="cpu", budget=8, max_depth=4, first_run_done=True)
    # where QSettings("SpecChat", "SpecChat") reads on Linux with XDG_CONFIG_HOME=config
    PreferencesStore(QSettings(str(config / "SpecChat" / "SpecChat.conf"), QSettings.Format.IniFormat)).save(prefs)
    shown_log = tmp_path / "shown.jsonl"
    env = dict(os.environ, QT_QPA_PLATFORM="offscreen", XDG_CONFIG_HOME=str(config), OMP_NUM_THREADS="1",
               SPECCHAT_DATA_DIR=str(tmp_path / "data"), SPECCHAT_CACHE_DIR=str(tmp_path / "cache"),
               SPECCHAT_MODELS_DIR=str(tmp_path / "models"), SPECCHAT_SKIP_WIZARD="1",
               SPECCHAT_TEST_AUTOSEND="hello", SPECCHAT_TEST_SHOWN_LOG=str(shown_log))
    db_path = default_path(tmp_path / "data")
    proc = subprocess.Popen([sys.executable, "-c", "import sys; from app.main import main; sys.exit(main([]))"],
                            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 180  # generous: a slow shared machine, not a performance check
        while time.monotonic() < deadline and proc.poll() is None:
            if len(_shown(shown_log)) >= 5:
                break
            time.sleep(0.05)
        assert proc.poll() is None, proc.stdout.read().decode(errors="replace") if proc.stdout else ""
        assert len(_shown(shown_log)) >= 5, "the answer never streamed"
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
    assert proc.returncode == -signal.SIGKILL
    shown = _shown(shown_log)
    saved = _assistant_text(db_path)
    assert saved is not None and shown[-1]
    assert saved.startswith(shown[-1]), (len(saved), len(shown[-1]))
    assert len(saved) < 4 * 1800  # it really was killed mid-answer, not after it finished
