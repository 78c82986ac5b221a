"""The architecture's import rules, checked in fresh interpreters: the engine never imports Qt
or the app (STYLE.md), and the commands that load no model never import torch."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def python(code: str, **env: str) -> str:
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO,
                         env={**os.environ, **env})
    return out.stdout.strip().splitlines()[-1]


def test_no_engine_module_imports_qt_or_the_app() -> None:
    code = (
        "import importlib, json, pkgutil, sys, engine\n"
        "names = [m.name for m in pkgutil.walk_packages(engine.__path__, 'engine.')]\n"
        "for name in names:\n"
        "    importlib.import_module(name)\n"
        "bad = sorted(m for m in sys.modules if m.startswith(('PySide6', 'PyQt', 'shiboken')) or m == 'app'\n"
        "             or m.startswith('app.'))\n"
        "print(json.dumps([len(names), bad]))"
    )
    count, bad = json.loads(python(code))
    assert count > 40 and bad == []


def test_help_and_models_load_no_torch(tmp_path: Path) -> None:
    code = (
        "import contextlib, io, json, sys\n"
        "from engine.cli import main\n"
        "with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):\n"
        "    codes = [main(['--help']), main(['generate', '--help']), main(['bench', 'plan', '--help']),\n"
        f"             main(['models', 'list', '--json', '--models-dir', {str(tmp_path)!r}]),\n"
        "             main(['generate', '--budget', 'x'])]\n"
        "print(json.dumps([codes, sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers'))]))"
    )
    codes, heavy = json.loads(python(code, SPECCHAT_DATA_DIR=str(tmp_path)))
    assert codes == [0, 0, 0, 0, 2] and heavy == []


def test_the_launcher_opens_the_app_only_without_arguments() -> None:
    from app.launcher import opens_app

    assert opens_app([]) and opens_app(["-v"])
    assert not opens_app(["chat"]) and not opens_app(["--help"]) and not opens_app(["--version"])
    out = subprocess.run([sys.executable, "-m", "engine"], capture_output=True, text=True, cwd=REPO)
    assert out.returncode == 0 and "usage: specchat" in out.stdout  # the engine alone never opens a window


def test_the_product_never_imports_the_test_model_builders() -> None:
    """engine.testing (random models, the GGUF writer) is for tests and benchmarks: no other
    engine module imports it, at any level, except the benchmark commands (engine/cli/bench*)."""
    import ast

    engine_dir = REPO / "engine"
    offenders = []
    for path in sorted(engine_dir.rglob("*.py")):
        rel = path.relative_to(REPO).with_suffix("")
        name = ".".join(rel.parts)
        if name.startswith("engine.testing") or name.startswith("engine.cli.bench"):
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            modules = ([a.name for a in node.names] if isinstance(node, ast.Import)
                       else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            if any(m == "engine.testing" or m.startswith("engine.testing.") for m in modules):
                offenders.append(name)
    assert offenders == []
