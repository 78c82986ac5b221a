"""The app's log file: a rotating file in the platform's log folder (engine.paths.log_dir), so
a failure in a build without a console (the Windows app) still leaves a trace. About (Settings)
and every error banner name it.

INFO and above go to the file (loads, downloads, failures: a bug's with its traceback, a
condition the user is told about in one line); the console keeps WARNING and above. Uncaught
exceptions are written to it too. How big it grows is `LogFileSettings`.
"""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass
from logging.handlers import RotatingFileHandler
from pathlib import Path
from types import TracebackType

from engine import paths

LOG_NAME = "specchat.log"


@dataclass(frozen=True)
class LogFileSettings:
    """max_bytes: the file's size before it rotates; backups: rotated files kept
    (specchat.log.1 .. .3: at most ~8 MB in all)."""

    max_bytes: int = 2_000_000
    backups: int = 3


class _AppLogHandler(RotatingFileHandler):
    """The app's log file handler: found again on the root logger by its type (the root logger
    is process-wide, so the handler on it is the one record of which file is in use)."""


def install_log_file(folder: Path | None = None, settings: LogFileSettings | None = None) -> Path | None:
    """Add the rotating file handler to the root logger; returns the file, or None when the
    folder cannot be written (the app then runs without one and says nothing about it)."""
    settings = settings or LogFileSettings()
    path = (folder or paths.log_dir()) / LOG_NAME
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        handler = _AppLogHandler(path, maxBytes=settings.max_bytes, backupCount=settings.backups,
                                      encoding="utf-8")
    except OSError as exc:
        logging.getLogger(__name__).warning("no log file at %s: %s", path, exc)
        return None
    handler.setLevel(logging.INFO)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(threadName)s %(name)s: %(message)s"))
    root = logging.getLogger()
    for existing in root.handlers:  # the console keeps its level
        if existing.level == logging.NOTSET:
            existing.setLevel(max(root.level, logging.WARNING))
    root.addHandler(handler)
    if root.level == logging.NOTSET or root.level > logging.INFO:
        root.setLevel(logging.INFO)
    previous = sys.excepthook

    def log_uncaught(kind: type[BaseException], value: BaseException, tb: TracebackType | None) -> None:
        logging.getLogger("app").critical("uncaught exception", exc_info=(kind, value, tb))
        previous(kind, value, tb)

    sys.excepthook = log_uncaught
    logging.getLogger(__name__).info("SpecChat started; this log: %s", path)
    return path


def current_log_file() -> Path | None:
    """The log file in use (None: none installed, as in tests)."""
    for handler in logging.getLogger().handlers:
        if isinstance(handler, _AppLogHandler):
            return Path(handler.baseFilename)
    return None
