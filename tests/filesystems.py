"""Real read-only folders and real full disks for tests (imported by name: tests/ is on sys.path).

A read-only folder: for a normal user, mode 0o555; for root, whom modes do not stop, a
read-only bind mount of the folder onto itself. A full disk: a small tmpfs mounted on a folder
(needs root). Where the machine allows neither (no root, no mount), the test is skipped rather
than faked: these are the conditions the code has to survive, so only the real thing counts.
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest


def _mount(*args: str) -> None:
    done = subprocess.run(["mount", *args], capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount here ({done.stderr.strip() or done.returncode})")


def _unmount(path: Path) -> None:
    subprocess.run(["umount", "-l", str(path)], capture_output=True)


def _need_root_mount() -> None:
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("needs root and mount(8) for a real small disk")


@contextmanager
def read_only(folder: Path) -> Iterator[Path]:
    """`folder` (existing, with its contents) made read-only for this process and its children."""
    if os.geteuid() != 0:
        mode = folder.stat().st_mode
        folder.chmod(stat.S_IRUSR | stat.S_IXUSR | stat.S_IRGRP | stat.S_IXGRP | stat.S_IROTH | stat.S_IXOTH)
        try:
            yield folder
        finally:
            folder.chmod(mode)
        return
    if shutil.which("mount") is None:
        pytest.skip("root needs mount(8) for a read-only folder")
    _mount("--bind", str(folder), str(folder))
    try:
        _mount("-o", "remount,bind,ro", str(folder), str(folder))
        yield folder
    finally:
        _unmount(folder)


@contextmanager
def small_disk(folder: Path, size_bytes: int) -> Iterator[Path]:
    """A tmpfs of `size_bytes` mounted on `folder` (created); unmounted afterwards."""
    _need_root_mount()
    folder.mkdir(parents=True, exist_ok=True)
    _mount("-t", "tmpfs", "-o", f"size={size_bytes}", "tmpfs", str(folder))
    try:
        yield folder
    finally:
        _unmount(folder)


def grow(folder: Path, size_bytes: int) -> None:
    """Resize a small_disk in place (its files stay): "space was freed"."""
    _mount("-o", f"remount,size={size_bytes}", str(folder))
