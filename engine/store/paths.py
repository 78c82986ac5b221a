"""Where models live: the SpecChat models folder, the standard Hugging Face cache, the hub URL.

Every function reads the environment when called (never at import), so tests and the app can
point them elsewhere with environment variables or explicit arguments. Nothing here creates
folders or touches the network.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from engine import paths

DEFAULT_ENDPOINT = "https://huggingface.co"
_REPO_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,95}/[A-Za-z0-9][A-Za-z0-9_.\-]{0,95}$")


def default_models_dir() -> Path:
    """$SPECCHAT_MODELS_DIR, else `<user data dir>/specchat/models` (movable: pass another).
    One definition for the whole app: engine.paths."""
    return paths.models_dir()


def hf_hub_cache_dir() -> Path:
    """The standard Hugging Face hub cache, resolved the way huggingface_hub resolves it."""
    for name in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        value = os.environ.get(name)
        if value:
            return Path(value).expanduser()
    hf_home = os.environ.get("HF_HOME")
    if hf_home:
        return Path(hf_home).expanduser() / "hub"
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "huggingface" / "hub"


def hub_endpoint() -> str:
    """$HF_ENDPOINT (read now, unlike huggingface_hub.constants), else https://huggingface.co."""
    return os.environ.get("HF_ENDPOINT", DEFAULT_ENDPOINT).rstrip("/")


def is_repo_id(spec: str) -> bool:
    """True for `owner/name` as the hub spells repo ids (no revision, no file)."""
    return bool(_REPO_ID.match(spec)) and ".." not in spec


def repo_slug(repo_id: str) -> str:
    """Folder name for a repo inside the models folder: `owner--name`."""
    return repo_id.replace("/", "--")

