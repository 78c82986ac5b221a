"""The pinned PySide6 must not leak references to None from void calls.

PySide6 6.12.0 on Python 3.11 dropped one reference to None per call of a method returning
nothing (QLabel.setText, processEvents, ...): minutes of streaming tokens then ended in
"Fatal Python error: none_dealloc". pyproject.toml pins a release without the bug; this test
fails if a future pin brings it back.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import tomllib
from PySide6.QtWidgets import QLabel


def test_void_calls_keep_none_alive(qtbot) -> None:  # type: ignore[no-untyped-def]
    label = QLabel()
    qtbot.addWidget(label)
    before = sys.getrefcount(None)
    for i in range(2000):
        label.setText(str(i))
    # other code may take a few references meanwhile; a leak would lose 2000
    assert sys.getrefcount(None) > before - 100


def test_an_unexpected_qt_warning_fails_a_test(pytester: pytest.Pytester) -> None:
    """The suite's own pytest settings (pyproject.toml) make a Qt warning a failure, except the
    offscreen platform's size-hint notice."""
    options = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())
    ini = options["tool"]["pytest"]["ini_options"]
    pytester.makeini("[pytest]\n" + "\n".join(
        f"{key} = {' '.join(value) if isinstance(value, list) else value}"
        for key, value in ini.items() if key.startswith("qt_")))
    pytester.makepyfile(
        "from PySide6.QtCore import qWarning\n"
        "def test_warns(qtbot):\n"
        "    qWarning('something the app did wrong')\n"
        "def test_offscreen_notice(qtbot):\n"
        "    qWarning('This plugin does not support propagateSizeHints()')\n")
    result = pytester.runpytest_subprocess()  # pytest-qt loads as an installed plugin
    result.assert_outcomes(passed=1, failed=1)
