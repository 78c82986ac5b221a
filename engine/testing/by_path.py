"""A test helper module of another test folder, imported by its file path under its own module
name (test folders are not packages, and a file run alone has only its own folder on sys.path):
each such helper is loaded once per process, so every test that reaches it shares its objects
(a fake hub's classes, an EAGLE head writer)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType


def module_at(name: str, path: Path) -> ModuleType:
    """The module `name` from `path`, imported on first use and then the same object."""
    module = sys.modules.get(name)
    if module is None:
        spec = importlib.util.spec_from_file_location(name, path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return module
