"""The questions the app asks, as injected callables: a widget that confirms a deletion, warns
about a failed import or asks for a file name calls its `Dialogs`, never QMessageBox or
QFileDialog itself. The app's are modal Qt dialogs over a parent (`Dialogs.over(parent)`); a
test passes plain functions that answer at once (tests/app/answers.py), so no test patches Qt's
dialog classes and none can hang on a dialog nobody closes.

Every callable returns what the user chose: True/False, the text, the path, or None when the
user cancelled.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from PySide6.QtWidgets import QFileDialog, QInputDialog, QMessageBox, QWidget

Confirm = Callable[[str, str], bool]  # (title, text) -> go ahead? (No is the default)
Warn = Callable[[str, str], None]  # (title, text): an error the user acknowledges
AskText = Callable[[str, str, str], "str | None"]  # (title, label, initial text) -> text, None: cancelled
AskSavePath = Callable[[str, Path, str], "Path | None"]  # (title, suggested path, name filter) -> path
AskOpenPath = Callable[[str, str], "Path | None"]  # (title, name filter) -> an existing file
AskFolder = Callable[[str, str], "Path | None"]  # (title, starting folder) -> a folder


@dataclass(frozen=True)
class Dialogs:
    """What a widget may ask the user (see the module docstring)."""

    confirm: Confirm
    warn: Warn
    ask_text: AskText
    ask_save_path: AskSavePath
    ask_open_path: AskOpenPath
    ask_folder: AskFolder

    @classmethod
    def over(cls, parent: QWidget | None) -> Dialogs:
        """Modal Qt dialogs over `parent`."""

        def confirm(title: str, text: str) -> bool:  # No by default: Enter never deletes or starts 45 GB
            answer = QMessageBox.question(parent, title, text,
                                          QMessageBox.StandardButton.Yes | QMessageBox.StandardButton.No,
                                          QMessageBox.StandardButton.No)
            return answer == QMessageBox.StandardButton.Yes

        def warn(title: str, text: str) -> None:
            QMessageBox.warning(parent, title, text)

        def ask_text(title: str, label: str, text: str) -> str | None:
            dialog = QInputDialog(parent)
            dialog.setWindowTitle(title)
            dialog.setLabelText(label)
            dialog.setTextValue(text)  # wide enough for the text it starts with
            dialog.resize(max(420, dialog.fontMetrics().horizontalAdvance(text) + 80), dialog.sizeHint().height())
            return dialog.textValue() if dialog.exec() else None

        def ask_save_path(title: str, suggested: Path, name_filter: str) -> Path | None:
            path, _ = QFileDialog.getSaveFileName(parent, title, str(suggested), name_filter)
            return Path(path) if path else None

        def ask_open_path(title: str, name_filter: str) -> Path | None:
            path, _ = QFileDialog.getOpenFileName(parent, title, "", name_filter)
            return Path(path) if path else None

        def ask_folder(title: str, start: str) -> Path | None:
            folder = QFileDialog.getExistingDirectory(parent, title, start)
            return Path(folder) if folder else None

        return cls(confirm, warn, ask_text, ask_save_path, ask_open_path, ask_folder)
