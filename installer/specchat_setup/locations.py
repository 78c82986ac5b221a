"""Where SpecChat and its data live, per platform, without third-party packages.

The folders mirror what the installed app computes with platformdirs
(`platformdirs.user_data_dir("specchat", appauthor=False)` and the cache equivalent, see
engine/paths.py) and where Qt's QSettings("SpecChat", "SpecChat") keeps the preferences; a test
checks the data and cache folders against engine/paths.py.

    <data>/runtime/         everything the installer owns (removed by the uninstaller)
        venv/               the private Python environment with SpecChat and PyTorch
        icons/              the icon files the launchers point at
        specchat_setup/     a copy of this package, run by the uninstaller
        uninstall.sh|.ps1   the uninstaller
        install.json        the manifest: versions, choices, every launcher file created
        pip.log             pip's verbose log of the last install
    <data>/models/          downloaded models (user data: kept unless the user says otherwise)
    <data>/conversations.sqlite3, hardware_profile.json, ...  (user data)
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path

APP_NAME = "specchat"  # folder names, as in engine/paths.py
DISPLAY_NAME = "SpecChat"


def platform_name() -> str:
    """'linux', 'macos' or 'windows' (other Unixes are treated as Linux)."""
    if sys.platform.startswith("win"):
        return "windows"
    if sys.platform == "darwin":
        return "macos"
    return "linux"


def home() -> Path:
    return Path(os.path.expanduser("~"))


def _xdg(var: str, default: str) -> Path:
    value = os.environ.get(var, "").strip()
    return Path(value) if value and os.path.isabs(value) else home() / default


def data_dir(platform: str | None = None) -> Path:
    env = os.environ.get("SPECCHAT_DATA_DIR")
    if env:
        return Path(env)
    platform = platform or platform_name()
    if platform == "windows":
        return Path(os.environ.get("LOCALAPPDATA") or home() / "AppData" / "Local") / APP_NAME
    if platform == "macos":
        return home() / "Library" / "Application Support" / APP_NAME
    return _xdg("XDG_DATA_HOME", ".local/share") / APP_NAME


def cache_dir(platform: str | None = None) -> Path:
    env = os.environ.get("SPECCHAT_CACHE_DIR")
    if env:
        return Path(env)
    platform = platform or platform_name()
    if platform == "windows":
        return Path(os.environ.get("LOCALAPPDATA") or home() / "AppData" / "Local") / APP_NAME / "Cache"
    if platform == "macos":
        return home() / "Library" / "Caches" / APP_NAME
    return _xdg("XDG_CACHE_HOME", ".cache") / APP_NAME


def settings_files(platform: str | None = None) -> list[Path]:
    """The files Qt's QSettings("SpecChat", "SpecChat") writes (none on Windows: the registry,
    HKCU\\Software\\SpecChat, handled by the launchers module)."""
    platform = platform or platform_name()
    if platform == "macos":
        return [home() / "Library" / "Preferences" / "com.specchat.SpecChat.plist"]
    if platform == "linux":
        return [_xdg("XDG_CONFIG_HOME", ".config") / DISPLAY_NAME]
    return []


def chosen_models_folder(platform: str | None = None) -> Path | None:
    """The models folder picked in the app's settings, when it is not the default (Linux and
    macOS-with-INI only: the INI file QSettings writes on Linux; None elsewhere)."""
    import configparser

    for folder in settings_files(platform):
        ini = folder / f"{DISPLAY_NAME}.conf"
        parser = configparser.ConfigParser(interpolation=None)
        try:
            parser.read(ini, encoding="utf-8")
        except (OSError, configparser.Error):
            continue
        value = parser.get("preferences", "models_dir", fallback="").strip().strip('"')
        if value:
            return Path(value).expanduser()
    return None


@dataclass(frozen=True)
class Layout:
    """Every path the installer writes or the uninstaller removes, for one user."""

    platform: str
    data: Path
    cache: Path

    @classmethod
    def current(cls) -> Layout:
        platform = platform_name()
        return cls(platform, data_dir(platform), cache_dir(platform))

    @property
    def runtime(self) -> Path:
        return self.data / "runtime"

    @property
    def venv(self) -> Path:
        return self.runtime / "venv"

    @property
    def venv_bin(self) -> Path:
        return self.venv / ("Scripts" if self.platform == "windows" else "bin")

    def venv_program(self, name: str) -> Path:
        return self.venv_bin / (f"{name}.exe" if self.platform == "windows" else name)

    @property
    def python(self) -> Path:
        return self.venv_program("python")

    @property
    def gui_program(self) -> Path:
        return self.venv_program("specchat-gui")

    @property
    def cli_program(self) -> Path:
        return self.venv_program("specchat")

    @property
    def icons(self) -> Path:
        return self.runtime / "icons"

    @property
    def manifest(self) -> Path:
        return self.runtime / "install.json"

    @property
    def pip_log(self) -> Path:
        return self.runtime / "pip.log"

    @property
    def uninstaller(self) -> Path:
        return self.runtime / ("uninstall.ps1" if self.platform == "windows" else "uninstall.sh")

    @property
    def models(self) -> Path:
        env = os.environ.get("SPECCHAT_MODELS_DIR")
        return Path(env).expanduser() if env else self.data / "models"
