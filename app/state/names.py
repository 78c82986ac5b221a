"""How the app names a model and a path in one line of a status field or a message: a model
spec (catalog id, repo id or path) by its last part, a path inside a sentence by its last part
(the full text goes in the tooltip). Plain functions, no Qt."""

from __future__ import annotations

import re
from pathlib import Path


def short_paths(text: str) -> str:
    """`text` with every file path cut to its last part ("loading /home/…/models/x on cpu" ->
    "loading x on cpu"): a raw path in a status line says little and cuts the rest off."""
    return _PATH.sub(lambda m: re.split(r"[\\/]", m.group(0).rstrip("\\/"))[-1] or m.group(0), text)


_PATH = re.compile(r"(?:[A-Za-z]:[\\/]|/)[^\s]*[\\/][^\s]+")


def short_name(spec: str) -> str:
    """A model spec (catalog id, repo id or path) as a short readable name."""
    if not spec:
        return ""
    path = Path(spec)
    if path.is_absolute() or spec.startswith(("~", ".")):
        return path.stem if path.suffix.lower() == ".gguf" else path.name
    return spec.rsplit("/", 1)[-1]
