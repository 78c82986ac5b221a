"""The log file: written where the platform keeps logs, rotated, named in every error banner."""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from pytestqt.qtbot import QtBot

from app.state import logfile
from app.widgets.status import ErrorBanner


@pytest.fixture
def isolated_root() -> Iterator[logging.Logger]:
    root = logging.getLogger()
    handlers, level, hook = list(root.handlers), root.level, sys.excepthook
    yield root
    for handler in root.handlers:
        if handler not in handlers:
            handler.close()
    root.handlers[:] = handlers
    root.setLevel(level)
    sys.excepthook = hook


def test_the_log_goes_to_the_platform_folder_rotates_and_is_named_in_errors(
        qtbot: QtBot, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, isolated_root: logging.Logger) -> None:
    monkeypatch.setenv("SPECCHAT_LOG_DIR", str(tmp_path / "logs"))
    settings = logfile.LogFileSettings(max_bytes=4_000)
    path = logfile.install_log_file(settings=settings)
    assert path == tmp_path / "logs" / "specchat.log" and logfile.current_log_file() == path
    try:
        raise RuntimeError("the worker fell over")
    except RuntimeError:
        logging.getLogger("app.workers.engine_worker").exception("generation failed")
    logging.getLogger("engine.store").info("downloaded %s", "starter")
    text = path.read_text(encoding="utf-8")
    assert "generation failed" in text and "RuntimeError: the worker fell over" in text  # with its traceback
    assert "downloaded starter" in text

    for i in range(200):
        logging.getLogger("app").info("line %d %s", i, "x" * 40)
    assert (tmp_path / "logs" / "specchat.log.1").is_file()
    assert len(list((tmp_path / "logs").iterdir())) <= 1 + settings.backups

    banner = ErrorBanner()
    qtbot.addWidget(banner)
    banner.show_message("The model could not be loaded.")
    assert banner.message == "The model could not be loaded."
    assert str(path) in banner.log_label.text() and not banner.log_label.isHidden()


def test_an_unwritable_folder_means_no_log_file_not_a_crash(tmp_path: Path, isolated_root: logging.Logger) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    assert logfile.install_log_file(blocker / "logs") is None and logfile.current_log_file() is None
