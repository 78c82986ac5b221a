"""The Linux installer end to end, as a user runs it, into a fresh home folder:

1. an offline bundle (installer/make_bundle.py: the scripts and every wheel, PyTorch's CPU build
   taken from pip's configured index, which here is this machine's local wheel) installed with
   the bundle's own `install.sh`, which takes the wheels beside it (pip gets --no-index:
   nothing is downloaded);
2. the .desktop entry checked by desktop-file-validate, the app started through the entry's
   Exec line (offscreen) for 10 seconds, and an upgrade refused while it runs;
3. a newer version installed from the source folder over it, keeping a conversation, a model
   and a setting;
4. the uninstaller, which keeps that data when asked nothing.

About 4 minutes, most of it pip unpacking PyTorch and PySide6.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from installer_env import REPO, user_env
from specchat_setup import launchers
from specchat_setup.environment import app_running
from specchat_setup.locations import Layout

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the Linux installer")

IGNORED = shutil.ignore_patterns(".venv", ".git", "__pycache__", "*.egg-info", "bench-out", "build", "dist",
                                 ".pytest_cache", "screenshots")
WRITE_STATE = """
from PySide6.QtCore import QSettings
from app.state.conversations import ConversationStore, default_path
from engine import paths
store = ConversationStore(default_path(paths.data_dir()))
chat = store.create("Kept across upgrades")
store.add_message(chat.id, "user", "Will you remember this?")
store.add_message(chat.id, "assistant", "Yes: it is in the database.")
store.close()
settings = QSettings("SpecChat", "SpecChat")
settings.setValue("installer_test/kept", "yes")
settings.sync()
"""
READ_STATE = """
import json
from PySide6.QtCore import QSettings
from app.state.conversations import ConversationStore, default_path
from engine import paths
store = ConversationStore(default_path(paths.data_dir()))
chats = store.conversations()
print(json.dumps({"titles": [c.title for c in chats],
                  "messages": [m.content for m in store.messages(chats[0].id)] if chats else [],
                  "setting": QSettings("SpecChat", "SpecChat").value("installer_test/kept")}))
"""


def run(command: list[str], env: dict[str, str], timeout: float = 900) -> subprocess.CompletedProcess[str]:
    return subprocess.run(command, env=env, capture_output=True, text=True, stdin=subprocess.DEVNULL,
                          cwd=env["HOME"], timeout=timeout, check=False)


def installer(source: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return run(["sh", str(source / "installer" / "install.sh"), "--torch", "cpu", "--torch-index", "pip", "--yes"], env)


def make_bundle(source: Path, out: Path) -> None:
    done = subprocess.run([sys.executable, str(source / "installer" / "make_bundle.py"), "--out", str(out),
                           "--torch-index", "pip"], capture_output=True, text=True, timeout=900, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]


def desktop_field(entry: Path, key: str) -> str:
    return next(line.split("=", 1)[1] for line in entry.read_text().splitlines() if line.startswith(key + "="))


def test_install_launch_upgrade_uninstall(tmp_path: Path) -> None:
    # spaces in every path, as on every Mac ("~/Library/Application Support/specchat/runtime/venv")
    source = tmp_path / "SpecChat source"
    shutil.copytree(REPO, source, ignore=IGNORED)
    home = tmp_path / "home of Ann"
    (home / "Desktop").mkdir(parents=True)
    env = user_env(home)
    env.pop("PYTHONPATH")
    env["PATH"] = f"{home / '.local' / 'bin'}:{env['PATH']}"
    layout = Layout("linux", home / ".local" / "share" / "specchat", home / ".cache" / "specchat")

    bundle = tmp_path / "SpecChat bundle"
    make_bundle(source, bundle)
    first = run(["sh", str(bundle / "install.sh"), "--yes"], env)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    assert "Installing SpecChat 0.1.0" in first.stdout
    assert "PyTorch 2.13.0: cpu build from the wheelhouse (torch-2.13.0+cpu" in first.stdout
    assert "Qt's system libraries" in first.stdout or "Qt needs system libraries" in first.stdout
    assert "Traceback" not in first.stdout + first.stderr

    entry = home / ".local" / "share" / "applications" / "specchat.desktop"
    assert (home / "Desktop" / "specchat.desktop").is_file()
    validator = shutil.which("desktop-file-validate")
    if validator is None:
        pytest.fail("desktop-file-validate is missing; install Debian's desktop-file-utils (.ci/run does)")
    checked = run([validator, str(entry)], env, timeout=60)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert Path(desktop_field(entry, "Icon")).is_file()
    terminal = run(["specchat", "--version"], env, timeout=120)  # the command, linked into ~/.local/bin
    assert terminal.returncode == 0, terminal.stderr
    assert terminal.stdout.startswith("SpecChat 0.1.0 · PyTorch 2.13.0+cpu (CPU build)"), terminal.stdout
    assert f"environment: {layout.venv}" in terminal.stdout

    # start the app the way the desktop does: the Exec line, run as-is
    command = launchers.exec_unquote(desktop_field(entry, "Exec"))
    assert command == [str(layout.gui_program)]
    log = tmp_path / "app.log"
    with open(log, "w") as output:
        app = subprocess.Popen(command, env=env, stdout=output, stderr=subprocess.STDOUT, cwd=home)
    try:
        started = time.monotonic()
        while not app_running(layout) and app.poll() is None and time.monotonic() - started < 60:
            time.sleep(0.2)
        assert app.poll() is None, log.read_text()
        assert app_running(layout), "the app never opened its single-instance server"
        busy = installer(source, env)  # an upgrade while the app runs is refused, nothing touched
        assert busy.returncode == 1 and "SpecChat is running" in busy.stderr, busy.stdout + busy.stderr
        time.sleep(max(0.0, 10 - (time.monotonic() - started)))
        assert app.poll() is None, log.read_text()
    finally:
        app.terminate()
        app.wait(timeout=30)
    shown = log.read_text()
    assert "Traceback" not in shown and "could not load the Qt platform plugin" not in shown, shown

    wrote = run([str(layout.python), "-c", WRITE_STATE], env, timeout=120)
    assert wrote.returncode == 0, wrote.stderr
    model_file = layout.models / "org--tiny" / "config.json"
    model_file.parent.mkdir(parents=True)
    model_file.write_text("{}")

    # upgrade: a newer version of the source, installed over the old one
    pyproject = source / "pyproject.toml"
    pyproject.write_text(pyproject.read_text().replace('version = "0.1.0"', 'version = "0.1.1"', 1))
    second = installer(source, env)
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    assert "Upgrading SpecChat 0.1.1 (installed: 0.1.0)" in second.stdout
    version = run(["specchat", "--version"], env, 120)
    assert version.stdout.startswith("SpecChat 0.1.1 · PyTorch 2.13.0+cpu"), version.stdout + version.stderr
    assert desktop_field(entry, "X-SpecChat-Version") == "0.1.1"
    state = run([str(layout.python), "-c", READ_STATE], env, timeout=120)
    assert state.returncode == 0, state.stderr
    assert '"titles": ["Kept across upgrades"]' in state.stdout
    assert "Yes: it is in the database." in state.stdout and '"setting": "yes"' in state.stdout
    assert model_file.is_file()

    removed = run(["sh", str(layout.uninstaller), "--yes"], env, timeout=300)
    assert removed.returncode == 0, removed.stdout + removed.stderr
    assert not layout.runtime.exists() and not entry.exists()
    assert not (home / "Desktop" / "specchat.desktop").exists()
    assert not list((home / ".local" / "share" / "icons").rglob("specchat.*"))
    assert not (home / ".local" / "bin" / "specchat").is_symlink()
    assert model_file.is_file() and (layout.data / "conversations.sqlite3").is_file()
    assert "Kept your models" in removed.stdout
