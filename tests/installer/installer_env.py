"""Paths and the user environment for the installer's tests (imported by conftest.py and
the tests; `specchat_setup` lives in installer/, outside the wheel, so it is put on sys.path)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
INSTALLER = REPO / "installer"
sys.path.insert(0, str(INSTALLER))

USER_VARS = ("SPECCHAT_DATA_DIR", "SPECCHAT_CACHE_DIR", "SPECCHAT_MODELS_DIR", "XDG_DATA_HOME",
             "XDG_CONFIG_HOME", "XDG_CACHE_HOME", "XDG_DATA_DIRS")


def user_env(home: Path) -> dict[str, str]:
    """An environment for a user whose home is `home` (a fresh Linux account, as far as the
    installer and the app can tell); pip's own settings are kept."""
    env = {k: v for k, v in os.environ.items() if k not in USER_VARS}
    env["HOME"] = str(home)
    env["PYTHONPATH"] = str(INSTALLER)
    env["QT_QPA_PLATFORM"] = "offscreen"
    return env
