"""Where SpecChat keeps its files. Every function takes an explicit override (tests pass
tmp_path); environment variables let a user or CI move the folders without code changes."""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import platformdirs

from engine.errors import MalformedInput
from engine.untrusted import read_json_file

log = logging.getLogger(__name__)

APP_NAME = "specchat"


def data_dir() -> Path:
    """User data: conversations, hardware profile, the models folder by default."""
    env = os.environ.get("SPECCHAT_DATA_DIR")
    return Path(env) if env else Path(platformdirs.user_data_dir(APP_NAME, appauthor=False))


def cache_dir() -> Path:
    """Rebuildable files: the starter model's wheel and converted folders, test models."""
    env = os.environ.get("SPECCHAT_CACHE_DIR")
    return Path(env) if env else Path(platformdirs.user_cache_dir(APP_NAME, appauthor=False))


def log_dir() -> Path:
    """The app's log files (the platform's log folder: ~/.local/state/specchat/log on Linux,
    %LOCALAPPDATA%\\specchat\\Logs on Windows, ~/Library/Logs/specchat on macOS)."""
    env = os.environ.get("SPECCHAT_LOG_DIR")
    return Path(env) if env else Path(platformdirs.user_log_dir(APP_NAME, appauthor=False))


def settings_file() -> Path:
    """The settings the app and the CLI share (today: the models folder), a small JSON file in
    the platform's config folder; SPECCHAT_CONFIG_DIR moves it."""
    env = os.environ.get("SPECCHAT_CONFIG_DIR")
    folder = Path(env) if env else Path(platformdirs.user_config_dir(APP_NAME, appauthor=False))
    return folder / "settings.json"


SETTINGS_MAX_BYTES = 1024 * 1024  # the file holds a few short strings


def shared_settings() -> dict[str, object]:
    """The shared settings file's object ({} when it is missing, or not what we write: a file
    another program or a hand edit left there is read as data only, within bounds, never
    trusted further: a folder, FIFO or device of that name, deep nesting, or a huge file is
    ignored with a log line)."""
    path = settings_file()
    try:
        data = read_json_file(path, what="the shared settings file", max_bytes=SETTINGS_MAX_BYTES)
    except FileNotFoundError:
        return {}
    except (OSError, MalformedInput) as exc:
        log.info("ignoring %s: %s", path, getattr(exc, "user_message", None) or exc)
        return {}
    return data if isinstance(data, dict) else {}


def shared_setting(name: str) -> str:
    """A string from the shared settings file ("" when unset, or when the file is missing or
    not what we write)."""
    value = shared_settings().get(name)
    return value if isinstance(value, str) else ""


def set_shared_setting(name: str, value: str) -> None:
    """Write one string into the shared settings file ("" removes it), atomically: through a
    new temporary file (created exclusively, so nothing already there is opened) renamed over
    it. OSError when the folder cannot be written."""
    path = settings_file()
    data = shared_settings()
    if (data.get(name) or "") == value:
        return
    if value:
        data[name] = value
    else:
        data.pop(name, None)
    write_json_atomic(path, data)


def write_json_atomic(path: Path, data: object, *, indent: int | None = 1, durable: bool = False) -> None:
    """Write JSON so that a reader, a crash or another process writing the same file at once
    sees the old file or the new one, never half of one: through a temporary file of its own
    (created exclusively, so nothing already there is opened) renamed over it. `durable`: on
    the disk before the rename (fsync), for files whose loss costs more than a moment's wait.
    OSError when the folder cannot be written."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(json.dumps(data, indent=indent) + ("\n" if indent is not None else ""))
            if durable:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def models_dir() -> Path:
    """SPECCHAT_MODELS_DIR, else the folder chosen in the app (the shared settings file, so the
    CLI downloads where the app looks), else the data folder's models/."""
    env = os.environ.get("SPECCHAT_MODELS_DIR")
    if env:
        return Path(env).expanduser()
    chosen = shared_setting("models_dir")
    if chosen and Path(chosen).expanduser().is_absolute():
        return Path(chosen).expanduser()
    return data_dir() / "models"


def resource(name: str) -> Path:
    """A file shipped in resources/ (the catalog, icons), wherever SpecChat is installed from.

    A wheel installs resources/ as the package `specchat_resources` (a frozen build bundles it
    the same way); a bare source checkout (no install at all) reads the folder beside `engine/`.
    The package's own folder is used, never importlib.resources' view of it, which is not a
    real path when the package is found as a namespace."""
    try:
        import specchat_resources

        root = Path(specchat_resources.__file__).resolve().parent
    except (ModuleNotFoundError, TypeError):  # TypeError: a namespace package has no __file__
        root = Path(__file__).resolve().parents[1] / "resources"
    return root / name


def publish_folder(final: Path, build: Callable[[Path], None]) -> Path:
    """Build a folder atomically: `build(tmp)` fills a temporary sibling of `final`, which is
    then renamed into place, so an interrupted build never leaves a half folder that looks
    finished. When another process published `final` first, its folder is kept (it is as good
    as ours) and ours is dropped; so is ours when `build` fails."""
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=final.parent, prefix=".build-"))
    try:
        build(tmp)
        if not final.exists():
            os.replace(tmp, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final
