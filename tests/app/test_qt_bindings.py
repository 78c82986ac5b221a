"""The pinned PySide6 must not leak references to None from void calls.

PySide6 6.12.0 on Python 3.11 dropped one reference to None per call of a method returning
nothing (QLabel.setText, processEvents, ...): minutes of streaming tokens then ended in
"Fatal Python error: none_dealloc". pyproject.toml pins a release without the bug; this test
fails if a future pin brings it back.
"""

from __future__ import annotations

import sys

from PySide6.QtWidgets import QLabel


def test_void_calls_keep_none_alive(qtbot) -> None:  # type: ignore[no-untyped-def]
    label = QLabel()
    qtbot.addWidget(label)
    before = sys.getrefcount(None)
    for i in range(2000):
        label.setText(str(i))
    # other code may take a few references meanwhile; a leak would lose 2000
    assert sys.getrefcount(None) > before - 100
