"""The uninstaller on an installed layout (made by hand here; test_install_linux.py makes a
real one): it removes the app, its launchers and its cache, and asks before deleting models
and conversations."""

from __future__ import annotations

import json
import os
import pty
import select
import subprocess
import sys
import time
from pathlib import Path

from installer_env import INSTALLER, user_env
from specchat_setup import environment
from specchat_setup.locations import Layout


def installed(home: Path) -> tuple[Layout, list[Path]]:
    """A runtime folder with a manifest, launchers, a cache, models, conversations, settings."""
    layout = Layout("linux", home / ".local" / "share" / "specchat", home / ".cache" / "specchat")
    (layout.venv / "bin").mkdir(parents=True)
    (layout.venv / "bin" / "python").write_text("")
    entry = home / ".local" / "share" / "applications" / "specchat.desktop"
    icon = home / ".local" / "share" / "icons" / "hicolor" / "64x64" / "apps" / "specchat.png"
    for path in (entry, icon):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("x")
    layout.manifest.write_text(json.dumps({"version": "0.1.0", "launchers": [str(entry), str(icon)]}))
    (layout.cache / "starter").mkdir(parents=True)
    (layout.cache / "starter" / "model.gguf").write_bytes(b"0" * 1000)
    (layout.models / "org--model").mkdir(parents=True)
    (layout.models / "org--model" / "model.safetensors").write_bytes(b"0" * 5000)
    (layout.data / "conversations.sqlite3").write_text("db")
    (layout.data / "hardware_profile.json").write_text("{}")
    chosen = home / "big disk" / "models"
    (chosen / "org--big").mkdir(parents=True)
    settings = home / ".config" / "SpecChat" / "SpecChat.conf"
    settings.parent.mkdir(parents=True)
    settings.write_text(f"[preferences]\nbudget=0\nmodels_dir={chosen}\n")  # as QSettings writes it
    return layout, [entry, icon]


def run_uninstall(home: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "specchat_setup", "uninstall", *args], env=user_env(home),
                          capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=120, check=False)


def test_without_a_terminal_it_keeps_models_and_conversations(home: Path) -> None:
    layout, launcher_files = installed(home)
    done = run_uninstall(home, "--yes")
    assert done.returncode == 0, done.stderr
    assert not layout.runtime.exists() and not layout.cache.exists()
    assert not any(p.exists() for p in launcher_files)
    assert (layout.models / "org--model" / "model.safetensors").is_file()
    assert (layout.data / "conversations.sqlite3").read_text() == "db"
    assert (home / ".config" / "SpecChat" / "SpecChat.conf").is_file()
    assert "Kept your models" in done.stdout and "conversations and settings" in done.stdout
    assert f"the folder you chose ({home / 'big disk' / 'models'}" in done.stdout
    again = run_uninstall(home, "--yes")
    assert again.returncode == 0 and "not installed" in again.stdout


def test_flags_remove_everything(home: Path) -> None:
    layout, _ = installed(home)
    done = run_uninstall(home, "--yes", "--remove-models", "--remove-conversations")
    assert done.returncode == 0, done.stderr
    assert not layout.data.exists()
    assert not (home / ".config" / "SpecChat").exists()
    assert (home / "big disk" / "models" / "org--big").is_dir()  # a folder the user chose: never deleted
    assert "Kept the models in the folder you chose" in done.stdout


def converse(home: Path, answers: list[bytes]) -> tuple[int, str]:
    """Run the uninstaller on a terminal (a pty) and answer its questions in order."""
    primary, secondary = pty.openpty()
    process = subprocess.Popen([sys.executable, "-m", "specchat_setup", "uninstall"], env=user_env(home),
                               stdin=secondary, stdout=secondary, stderr=secondary, close_fds=True)
    os.close(secondary)
    transcript = b""
    pending = list(answers)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        ready, _, _ = select.select([primary], [], [], 0.5)
        if ready:
            try:
                chunk = os.read(primary, 4096)
            except OSError:  # the child closed the terminal
                break
            if not chunk:
                break
            transcript += chunk
            if pending and transcript.rstrip().endswith((b"[Y/n]", b"[y/N]")):
                os.write(primary, pending.pop(0) + b"\n")
        elif process.poll() is not None:
            break
    code = process.wait(timeout=30)
    os.close(primary)
    return code, transcript.decode(errors="replace")


def test_asks_before_deleting_models_and_conversations(home: Path) -> None:
    layout, _ = installed(home)
    code, transcript = converse(home, [b"y", b"y", b"n"])  # uninstall: yes; models: yes; conversations: no
    assert code == 0, transcript
    assert "Uninstall SpecChat? [Y/n]" in transcript
    assert "Also delete your downloaded models" in transcript and "[y/N]" in transcript
    assert "Also delete your conversations and settings? [y/N]" in transcript
    assert not layout.models.exists() and not layout.runtime.exists()
    assert (layout.data / "conversations.sqlite3").is_file()


def test_saying_no_removes_nothing(home: Path) -> None:
    layout, launcher_files = installed(home)
    code, transcript = converse(home, [b"n"])
    assert code == 0 and "Nothing was removed" in transcript
    assert layout.runtime.exists() and all(p.exists() for p in launcher_files)


def test_a_running_app_stops_install_and_uninstall(home: Path, qapp: object) -> None:
    """The app's real single-instance server: the installer sees it and asks it to come forward."""
    from app.single_instance import acquire

    layout, _ = installed(home)
    instance = acquire(layout.data)
    assert instance is not None
    raised: list[bool] = []
    instance.raise_requested.connect(lambda: raised.append(True))
    assert environment.app_running(layout)
    deadline = time.monotonic() + 10
    while not raised and time.monotonic() < deadline:
        qapp.processEvents()  # type: ignore[attr-defined]
    assert raised
    done = run_uninstall(home, "--yes")
    assert done.returncode == 1 and "SpecChat is running" in done.stderr and layout.runtime.exists()
    instance.server.close()
    assert not environment.app_running(layout)
    assert INSTALLER.is_dir()
