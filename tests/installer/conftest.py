"""Fixtures for the installer's tests."""

from __future__ import annotations

import os

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")  # the test of a running app starts Qt

from collections.abc import Iterator  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
from installer_env import USER_VARS  # noqa: E402


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A fresh home folder, also set in this process (for code that runs in the test)."""
    folder = tmp_path / "home"
    folder.mkdir()
    for var in USER_VARS:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HOME", str(folder))
    yield folder
