"""The installer's failures end in one message that says what to do, never a traceback, and
leave nothing half-made behind that a re-run could trip over."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

from installer_env import REPO, user_env
from specchat_setup.locations import Layout


def install(home: Path, *args: str, env_extra: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    env = user_env(home)
    env.update(env_extra or {})
    return subprocess.run([sys.executable, "-m", "specchat_setup", "install", "--yes", *args], env=env,
                          capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=600, check=False,
                          cwd=home)


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_unreachable_package_index(home: Path) -> None:
    offline = {"PIP_CONFIG_FILE": "/dev/null", "PIP_FIND_LINKS": "", "PIP_RETRIES": "0", "PIP_TIMEOUT": "5",
               "PIP_INDEX_URL": f"http://127.0.0.1:{closed_port()}/simple"}
    done = install(home, "--torch", "cpu", "--torch-index", f"http://127.0.0.1:{closed_port()}/simple",
                   env_extra=offline)
    assert done.returncode == 1
    assert "error: Installing PyTorch (cpu build) failed" in done.stderr
    assert "Check the internet connection, or install from a folder of wheels with --wheelhouse" in done.stderr
    assert "Traceback" not in done.stderr + done.stdout
    layout = Layout("linux", home / ".local" / "share" / "specchat", home / ".cache" / "specchat")
    assert layout.pip_log.is_file() and not layout.manifest.exists()
    assert not (home / ".local" / "share" / "applications").exists()


def test_wheelhouse_without_specchat(home: Path, tmp_path: Path) -> None:
    empty = tmp_path / "wheels"
    empty.mkdir()
    done = install(home, "--wheelhouse", str(empty))
    assert done.returncode == 1 and "has no specchat-*.whl" in done.stderr and "Traceback" not in done.stderr
    missing = install(home, "--wheelhouse", str(tmp_path / "nope"))
    assert missing.returncode == 1 and "no such folder" in missing.stderr


def test_not_a_source_folder(home: Path, tmp_path: Path) -> None:
    done = install(home, "--source", str(tmp_path))
    assert done.returncode == 1 and "is not a SpecChat source folder" in done.stderr


def test_unknown_torch_build(home: Path) -> None:
    done = install(home, "--source", str(REPO), "--torch", "rocm")
    assert done.returncode == 1 and "use auto, cpu, cuda" in done.stderr
