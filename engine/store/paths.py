"""Where models live: the SpecChat models folder, the standard Hugging Face cache, the hub URL.

Every function reads the environment when called (never at import), so tests and the app can
point them elsewhere with environment variables or explicit arguments. Nothing here creates
folders or touches the network.
"""

from __future__ import annotations

import os
import re
from pathlib import Path, PurePosixPath, PureWindowsPath

from engine import paths
from engine.errors import UnsupportedModel

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


def hub_offline() -> str | None:
    """The variable that puts the Hugging Face tools offline (HF_HUB_OFFLINE, or transformers'
    older TRANSFORMERS_OFFLINE), spelled as set, e.g. "HF_HUB_OFFLINE=1"; None when online.
    Read now, with huggingface_hub's own notion of a true value."""
    for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        value = os.environ.get(name, "")
        if value.strip().upper() in ("1", "ON", "YES", "TRUE"):
            return f"{name}={value}"
    return None


def is_repo_id(spec: str) -> bool:
    """True for `owner/name` as the hub spells repo ids (no revision, no file)."""
    return bool(_REPO_ID.match(spec)) and ".." not in spec


def repo_slug(repo_id: str) -> str:
    """Folder name for a repo inside the models folder: `owner--name`."""
    return repo_id.replace("/", "--")


def check_file_name(name: str, owner: str) -> str:
    """A file name from an untrusted listing (a hub repo's file list, an Ollama manifest, an
    archive): returned when it is a plain relative path ("model.safetensors", "q4/model.gguf");
    UnsupportedModel naming `owner` when it could point outside its folder (absolute, a drive,
    "..", empty or "." parts, backslashes, control characters)."""
    parts = name.split("/")
    unsafe = (
        not name or "\\" in name or ":" in name or any(ord(c) < 32 for c in name)
        or PurePosixPath(name).is_absolute() or PureWindowsPath(name).drive
        or any(part in ("", ".", "..") for part in parts)
    )
    if unsafe:
        raise UnsupportedModel(
            f"{owner} lists a file named {name!r}, which points outside the model's own folder. "
            "SpecChat refuses to download anything from it; the repository may be malicious."
        )
    return name


def inside(root: Path, name: str, owner: str) -> Path:
    """`root / name` after check_file_name, and only if it resolves inside `root` (a symlink
    planted in the folder cannot lead a write elsewhere either)."""
    path = root / check_file_name(name, owner)
    try:
        escapes = not path.resolve().is_relative_to(root.resolve())
    except RuntimeError:  # a symlink loop on the way (Python < 3.13 raises this from resolve)
        escapes = True
    if escapes:
        raise UnsupportedModel(f"{owner}: the file {name!r} would be written outside {root}; refused.")
    return path
