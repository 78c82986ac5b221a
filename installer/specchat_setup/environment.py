"""The private Python environment: create it, run pip in it, ask it what it holds; and the
checks around that (free disk space, a running app).

pip's own progress bars stream to the terminal; its verbose log goes to runtime/pip.log, and a
failure is reported as one `SetupError` whose message says what to do, never a traceback.
"""

from __future__ import annotations

import getpass
import hashlib
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import venv
from pathlib import Path

from . import VERSION_REQUIRED
from .locations import Layout


# Python in the environment never looks at the current folder or PYTHON* variables: a SpecChat
# source folder there (its specchat.egg-info) would pass for the installed package.
ISOLATED = ("-I",)
LOW_SPACE = 500_000_000  # below this after a failed pip run, the disk filling up is the likely cause


class SetupError(Exception):
    """A failure the user can act on; the message says how."""


def check_python() -> None:
    if sys.version_info[:2] < VERSION_REQUIRED:
        raise SetupError(f"SpecChat needs Python {VERSION_REQUIRED[0]}.{VERSION_REQUIRED[1]} or newer; "
                         f"this is {sys.version.split()[0]} ({sys.executable}).")
    try:
        import ensurepip  # noqa: F401  # Debian and Ubuntu ship it separately (python3-venv)
    except ImportError as exc:
        minor = f"{sys.version_info[0]}.{sys.version_info[1]}"
        raise SetupError(
            f"This Python ({sys.executable}) cannot create virtual environments. Install the venv "
            f"module, e.g. `sudo apt install python{minor}-venv` on Debian or Ubuntu, then run the "
            "installer again.") from exc


def free_bytes(path: Path) -> int:
    probe = path
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    return shutil.disk_usage(probe).free


def check_space(path: Path, needed: int, what: str) -> None:
    free = free_bytes(path)
    if free < needed:
        raise SetupError(f"{what} needs about {needed / 1e9:.1f} GB free on the disk holding {path}; "
                         f"it has {free / 1e9:.1f} GB. Free some space and run the installer again.")


def venv_works(layout: Layout) -> tuple[int, int] | None:
    """The environment's Python version, or None when it is missing or broken (for example the
    system Python it was made from was removed)."""
    if not layout.python.exists():
        return None
    try:
        done = subprocess.run([str(layout.python), *ISOLATED, "-c", "import sys; print(*sys.version_info[:2])"],
                              capture_output=True, text=True, timeout=60, check=False)
    except OSError:
        return None
    parts = done.stdout.split()
    return (int(parts[0]), int(parts[1])) if done.returncode == 0 and len(parts) == 2 else None


def create_venv(layout: Layout) -> bool:
    """Make the environment unless a working one for this Python exists. True if made anew."""
    existing = venv_works(layout)
    if existing == sys.version_info[:2]:
        return False
    if layout.venv.exists():
        shutil.rmtree(layout.venv)  # broken, or made by another Python: rebuild (data stays)
    try:
        venv.EnvBuilder(with_pip=True, clear=True, upgrade_deps=False).create(layout.venv)
    except (OSError, subprocess.CalledProcessError) as exc:
        hint = ""
        if layout.platform == "linux":  # Debian and Ubuntu keep ensurepip in a separate package
            minor = f"{sys.version_info[0]}.{sys.version_info[1]}"
            hint = f" On Debian or Ubuntu, install the venv module first: sudo apt install python{minor}-venv."
        raise SetupError(f"Could not create the Python environment in {layout.venv} ({exc}).{hint}") from exc
    return True


def pip(layout: Layout, args: list[str], what: str, hint: str) -> None:
    """Run pip in the environment with its progress shown; raise SetupError on failure."""
    command = [str(layout.python), *ISOLATED, "-m", "pip", "--disable-pip-version-check",
               "--log", str(layout.pip_log), *args]
    print(f"\n==> {what}", flush=True)
    try:
        code = subprocess.run(command, cwd=layout.runtime, check=False).returncode
    except KeyboardInterrupt:
        raise SetupError("Cancelled. Nothing you had was lost; run the installer again to finish.") from None
    if code != 0:
        if free_bytes(layout.runtime) < LOW_SPACE:
            hint = (f"The disk holding {layout.runtime} is full ({free_bytes(layout.runtime) / 1e6:.0f} MB free): "
                    "free some space and run the installer again.")
        raise SetupError(f"{what} failed (pip exited with {code}). {hint} "
                         f"pip's full log: {layout.pip_log}")


def query(layout: Layout, code: str) -> dict[str, object]:
    """Run Python code in the environment that prints one JSON object."""
    done = subprocess.run([str(layout.python), *ISOLATED, "-c", code], capture_output=True, text=True,
                          cwd=layout.runtime, timeout=300, check=False)
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise SetupError(f"The installed environment does not work: {last}. Run the installer again; "
                         f"if it keeps failing, remove {layout.venv} first.")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert isinstance(result, dict)
    return result


def installed_versions(layout: Layout) -> dict[str, str]:
    """Versions of specchat, torch and PySide6 in the environment ({} when there is none)."""
    if venv_works(layout) is None:
        return {}
    code = ("import json, importlib.metadata as m\n"
            "out = {}\n"
            "for name in ('specchat', 'torch', 'PySide6'):\n"
            "    try: out[name] = m.version(name)\n"
            "    except m.PackageNotFoundError: pass\n"
            "print(json.dumps(out))")
    try:
        return {k: str(v) for k, v in query(layout, code).items()}
    except SetupError:
        return {}


def server_name(data_dir: Path) -> str:
    """The app's single-instance server name (app/single_instance.py computes the same)."""
    key = f"{getpass.getuser()}:{data_dir.resolve()}".encode()
    return "specchat-" + hashlib.sha1(key).hexdigest()[:16]


def app_running(layout: Layout) -> bool:
    """True when SpecChat is running for this data folder (it listens on a local socket or,
    on Windows, a named pipe). The app is asked to raise its window, so the user sees it."""
    name = server_name(layout.data)
    if layout.platform == "windows":
        try:
            with open(rf"\\.\pipe\{name}", "r+b", buffering=0) as pipe:
                pipe.write(b"raise\n")
            return True
        except OSError:
            return False
    path = Path(os.environ.get("TMPDIR") or tempfile.gettempdir()) / name
    if not path.exists():
        return False
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(1.0)
        try:
            sock.connect(str(path))
            sock.sendall(b"raise\n")
            return True
        except OSError:
            return False


def folder_bytes(path: Path) -> int:
    total = 0
    for root, _dirs, files in os.walk(path):
        for name in files:
            try:
                total += (Path(root) / name).lstat().st_size
            except OSError:
                pass
    return total
