"""The app's own dialogs (app/widgets/dialogs.py, `Dialogs.over`), answered as a user does:
the other tests inject plain functions, so these are the only ones that open real Qt dialogs."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from PySide6.QtCore import Qt, QTimer
from PySide6.QtWidgets import QApplication, QInputDialog, QMessageBox, QWidget
from pytestqt.qtbot import QtBot

from app.widgets.dialogs import Dialogs


def when_shown(act: Callable[[QWidget], None], tries: int = 250) -> None:
    """Run `act` on the modal dialog once it is up (polled from its own event loop)."""
    def poll(left: int) -> None:
        box = QApplication.activeModalWidget()
        if box is not None:
            act(box)
        elif left:
            QTimer.singleShot(20, lambda: poll(left - 1))

    QTimer.singleShot(0, lambda: poll(tries))


def test_the_rename_box_has_room_for_a_title_and_enter_never_confirms_a_deletion(qtbot: QtBot) -> None:
    parent = QWidget()
    qtbot.addWidget(parent)
    dialogs = Dialogs.over(parent)
    widths: list[int] = []

    def rename(box: QWidget) -> None:
        assert isinstance(box, QInputDialog) and box.textValue() == "Apples"
        widths.append(box.width())
        box.setTextValue("Fruit talk")
        box.accept()

    when_shown(rename)
    assert dialogs.ask_text("Rename conversation", "Title:", "Apples") == "Fruit talk"
    assert widths[0] >= 400  # room for a title, not 20 characters
    when_shown(lambda box: box.reject())
    assert dialogs.ask_text("Rename conversation", "Title:", "Apples") is None  # Cancel

    def enter(box: QWidget) -> None:
        assert isinstance(box, QMessageBox) and "Delete “Apples”" in box.text()
        qtbot.keyClick(box, Qt.Key.Key_Return)

    when_shown(enter)
    assert dialogs.confirm("Delete conversation", "Delete “Apples” and all its messages?") is False

    def yes(box: QWidget) -> None:
        assert isinstance(box, QMessageBox)
        box.button(QMessageBox.StandardButton.Yes).click()

    when_shown(yes)
    assert dialogs.confirm("Delete conversation", "Delete “Apples”?") is True


def test_a_cancelled_file_chooser_is_none(qtbot: QtBot, tmp_path: Path) -> None:
    parent = QWidget()
    qtbot.addWidget(parent)
    dialogs = Dialogs.over(parent)
    when_shown(lambda box: box.reject())
    assert dialogs.ask_save_path("Export conversation", tmp_path / "a.md", "Markdown (*.md)") is None
