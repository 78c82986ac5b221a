"""The row above the messages: the conversation's system prompt, a menu of saved presets, and
a button that saves the prompt as a preset (its name asked in a small dialog)."""

from __future__ import annotations

from PySide6.QtCore import Signal
from PySide6.QtWidgets import (
    QComboBox,
    QHBoxLayout,
    QLabel,
    QLineEdit,
    QToolButton,
    QWidget,
)

from app.widgets.dialogs import Dialogs


class SystemPromptRow(QWidget):
    """Signals: edited(str) (the prompt was typed or a preset chosen); save_requested(str, str)
    (name, text of a new preset)."""

    edited = Signal(str)
    save_requested = Signal(str, str)

    def __init__(self, parent: QWidget | None = None, dialogs: Dialogs | None = None) -> None:
        super().__init__(parent)
        self.dialogs = dialogs or Dialogs.over(self)
        row = QHBoxLayout(self)
        row.setContentsMargins(12, 8, 12, 4)
        label = QLabel("System")  # short: the row must fit a half-screen window; the box says the rest
        label.setToolTip("Instructions the model reads before the conversation")
        row.addWidget(label)
        self.edit = QLineEdit()
        self.edit.setAccessibleName("System prompt")
        self.edit.setPlaceholderText("System prompt: how the assistant should behave in this conversation")
        self.edit.setMinimumWidth(80)
        self.edit.editingFinished.connect(lambda: self.edited.emit(self.edit.text()))
        label.setBuddy(self.edit)
        row.addWidget(self.edit, 1)
        self.presets = QComboBox()
        self.presets.setAccessibleName("System prompt presets")
        self.presets.setToolTip("Use a saved system prompt")
        self.presets.setSizeAdjustPolicy(QComboBox.SizeAdjustPolicy.AdjustToMinimumContentsLengthWithIcon)
        self.presets.setMinimumContentsLength(6)
        self.presets.activated.connect(self._on_presets_activated)
        row.addWidget(self.presets)
        self.save_button = QToolButton()
        self.save_button.setText("Save…")
        self.save_button.setToolTip("Save this system prompt as a preset")
        self.save_button.setAccessibleName("Save the system prompt as a preset")
        self.save_button.clicked.connect(self._on_save_clicked)
        row.addWidget(self.save_button)

    def set_presets(self, presets: tuple[tuple[str, str], ...]) -> None:
        self.presets.clear()
        self.presets.addItem("Presets…", None)
        for name, text in presets:
            self.presets.addItem(name, text)

    def _on_presets_activated(self, index: int) -> None:
        text = self.presets.itemData(index)
        if text is not None:
            self.edit.setText(str(text))
            self.edited.emit(self.edit.text())
        self.presets.setCurrentIndex(0)

    def _on_save_clicked(self) -> None:
        text = self.edit.text().strip()
        if not text:
            return
        name = self.dialogs.ask_text("Save system prompt", "Preset name:", "")
        if name is not None and name.strip():
            self.save_requested.emit(name.strip(), text)
