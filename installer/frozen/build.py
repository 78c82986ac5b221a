"""Build SpecChat's one-folder frozen bundle with PyInstaller (issue 7, alternative packaging).

    python installer/frozen/build.py --dist /tmp/frozen-dist [--work DIR] [--clean]

Runs PyInstaller on installer/frozen/specchat.spec in the current interpreter (which must have
SpecChat's dependencies and `pyinstaller` installed; CPU torch keeps the bundle CPU-only), puts
the folder `SpecChat/` (executables `specchat-gui` and `specchat`) under --dist, and prints
the build time, the folder's size and its file count. Keep --dist and --work outside the
repository. Standard library and PyInstaller only.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
SPEC = HERE / "specchat.spec"
BUNDLE_NAME = "SpecChat"  # COLLECT(name=...) in the spec


@dataclass(frozen=True)
class FolderSize:
    bytes: int
    files: int


def folder_size(root: Path) -> FolderSize:
    """Total size of the regular files under `root` (symbolic links not followed) and their count."""
    total = 0
    count = 0
    for dirpath, _dirnames, filenames in os.walk(root):
        for name in filenames:
            path = Path(dirpath) / name
            if path.is_symlink() or not path.is_file():
                continue
            total += path.stat().st_size
            count += 1
    return FolderSize(total, count)


def human(size: int) -> str:
    value = float(size)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def pyinstaller_command(dist: Path, work: Path, clean: bool) -> list[str]:
    command = [sys.executable, "-m", "PyInstaller", str(SPEC), "--noconfirm",
               "--distpath", str(dist), "--workpath", str(work), "--log-level", "WARN"]
    if clean:
        command.append("--clean")
    return command


def build(dist: Path, work: Path, clean: bool) -> int:
    """Run PyInstaller; print time, size and file count. Returns PyInstaller's exit status."""
    command = pyinstaller_command(dist, work, clean)
    print("$ " + " ".join(command), flush=True)
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")  # PyInstaller imports torch in its helper processes
    started = time.monotonic()
    code = subprocess.call(command, env=env)
    elapsed = time.monotonic() - started
    if code != 0:
        print(f"PyInstaller failed (exit {code}) after {elapsed:.0f} s", file=sys.stderr)
        return code
    bundle = dist / BUNDLE_NAME
    size = folder_size(bundle)
    print(f"built {bundle} in {elapsed:.0f} s")
    print(f"size: {human(size.bytes)} ({size.bytes} bytes) in {size.files} files")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Build SpecChat's one-folder PyInstaller bundle.")
    parser.add_argument("--dist", type=Path, required=True, help="folder to put SpecChat/ in")
    parser.add_argument("--work", type=Path, default=None,
                        help="PyInstaller's work folder (default: a folder in the system temp dir)")
    parser.add_argument("--clean", action="store_true", help="clear PyInstaller's caches first")
    args = parser.parse_args(argv)
    work = args.work or Path(tempfile.gettempdir()) / "specchat-pyinstaller-work"
    return build(args.dist.resolve(), work.resolve(), args.clean)


if __name__ == "__main__":
    sys.exit(main())
