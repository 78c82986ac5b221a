"""app/'s rooms (app/__init__.py): each package imports only the rooms below it, the workers and
the state touch no widget, the turn controller no Qt at all, no module grows past 450 lines,
and every package is in the wheel (pyproject's [tool.setuptools] packages). Read with `ast`:
every import counts, those inside functions too."""

from __future__ import annotations

import ast
from pathlib import Path

import tomllib

REPO = Path(__file__).resolve().parents[2]
APP = REPO / "app"
SHELL = "shell"  # app/'s own modules: they may import every room
ALLOWED: dict[str, set[str]] = {
    "state": set(),
    "workers": {"state"},
    "widgets": {"state"},
    "chat": {"state", "workers", "widgets"},
    "models": {"state", "workers", "widgets"},
    "settings": {"state", "workers", "widgets", "models"},
    "wizard": {"state", "workers", "widgets", "models"},
}
MAX_LINES = 450


def _room(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 2 or (len(parts) == 2 and parts[1] in ALLOWED) else SHELL


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted(APP.rglob("*.py")):
        parts = list(path.relative_to(REPO).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module)
            names |= {f"{node.module}.{a.name}" for a in node.names}
    return names


def test_each_room_imports_only_the_rooms_below_it() -> None:
    modules = _modules()
    wrong = []
    for name, path in modules.items():
        room = _room(name)
        if room == SHELL:
            continue
        for target in _imports(path):
            if target.split(".")[0] == "app" and target in modules:
                other = _room(target)
                if other != room and other not in ALLOWED[room]:
                    wrong.append(f"{name} -> {target}")
    assert wrong == []


def test_the_state_and_the_workers_touch_no_widget_and_the_turn_controller_no_qt() -> None:
    modules = _modules()
    widgets = [name for name, path in modules.items() if _room(name) in ("state", "workers")
               and any(i.startswith("PySide6.QtWidgets") or i.startswith("PySide6.QtGui") for i in _imports(path))]
    assert widgets == []
    assert not any(i.startswith("PySide6") for i in _imports(modules["app.chat.turn"]))


def test_no_module_is_longer_than_the_limit() -> None:
    long = {name: n for name, path in _modules().items()
            if (n := len(path.read_text(encoding="utf-8").splitlines())) > MAX_LINES}
    assert long == {}


def test_every_package_is_in_the_wheel() -> None:
    """A subpackage missing from the list installs without its files (pip install ., the
    installer's wheel): the app would fail at its first import there, never in a checkout."""
    listed = set(tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))
                 ["tool"]["setuptools"]["packages"])
    packages = {".".join(p.parent.relative_to(REPO).parts) for p in APP.rglob("__init__.py")}
    assert packages - listed == set()


def test_every_package_states_its_contract() -> None:
    quiet = [name for name, path in _modules().items() if path.name == "__init__.py"
             and len(ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"))) or "") < 200]
    assert quiet == []
