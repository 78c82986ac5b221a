"""The shared settings file (engine.paths) is read as data from outside (issue 26.3): a FIFO, a
folder, deep nesting or a huge file there reads as "no settings", at once; writing it goes
through a new temporary file, so nothing already there (a FIFO of the old temporary name) is
ever opened."""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from engine import paths


class Blocked(BaseException):
    """Raised by the timer: not an OSError (TimeoutError is one), so no `except OSError` in the
    code under test can swallow it."""


@pytest.fixture(autouse=True)
def _no_hang() -> Iterator[None]:
    def expire(signum: int, frame: object) -> None:
        raise Blocked("blocked for 20 s (a FIFO opened?)")

    old = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, 20, 20)  # again and again: each blocked read fails
    yield
    signal.setitimer(signal.ITIMER_REAL, 0)
    signal.signal(signal.SIGALRM, old)


@pytest.fixture
def settings(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("SPECCHAT_CONFIG_DIR", str(tmp_path / "config"))
    monkeypatch.delenv("SPECCHAT_MODELS_DIR", raising=False)
    monkeypatch.setenv("SPECCHAT_DATA_DIR", str(tmp_path / "data"))
    (tmp_path / "config").mkdir()
    return paths.settings_file()


@pytest.mark.parametrize("kind", ["fifo", "folder", "nested", "huge", "not UTF-8", "a list"])
def test_a_settings_file_that_is_not_ours_reads_as_no_settings(kind: str, settings: Path, tmp_path: Path) -> None:
    if kind == "fifo":
        os.mkfifo(settings)
    elif kind == "folder":
        settings.mkdir()
    elif kind == "nested":
        settings.write_text('{"models_dir": ' + "[" * 100_000 + "]" * 100_000 + "}")
    elif kind == "huge":
        with open(settings, "wb") as f:
            f.truncate(1 << 33)  # sparse 8 GiB
    elif kind == "not UTF-8":
        settings.write_bytes(b'{"models_dir": "\xff"}')
    else:
        settings.write_text(json.dumps([str(tmp_path)]))
    assert paths.shared_setting("models_dir") == ""
    assert paths.models_dir() == tmp_path / "data" / "models"


def test_writing_never_opens_what_is_already_there(settings: Path, tmp_path: Path) -> None:
    os.mkfifo(settings.with_name(f".{settings.name}.tmp"))  # the old fixed temporary name
    paths.set_shared_setting("models_dir", str(tmp_path / "models"))
    assert paths.shared_setting("models_dir") == str(tmp_path / "models")
    assert paths.models_dir() == tmp_path / "models"
    paths.set_shared_setting("models_dir", "")
    assert json.loads(settings.read_text()) == {}
    assert sorted(p.name for p in settings.parent.iterdir()) == [f".{settings.name}.tmp", settings.name]


def test_a_settings_path_that_is_a_folder_cannot_be_written(settings: Path) -> None:
    settings.mkdir()
    with pytest.raises(OSError):  # the app says so in its log (app/preferences.py)
        paths.set_shared_setting("models_dir", "/somewhere")
    assert settings.is_dir() and [p.name for p in settings.parent.iterdir()] == [settings.name]
