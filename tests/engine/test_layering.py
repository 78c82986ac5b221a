"""The engine never imports Qt (STYLE.md): checked in a fresh interpreter."""

from __future__ import annotations

import subprocess
import sys


def test_engine_imports_no_qt() -> None:
    code = (
        "import sys, engine.generation, engine.loading, engine.store, engine.bench, engine.testmodels\n"
        "bad = sorted(m for m in sys.modules if m.startswith(('PySide6', 'PyQt', 'shiboken')))\n"
        "print(','.join(bad))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""
