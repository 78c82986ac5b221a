"""The row above the messages: the conversation's system prompt, a menu of saved presets, and
a button that saves the prompt as a preset (its name asked through the injected dialogs). The
presets live in the preferences (`system_presets`); the first one is a new conversation's
prompt."""

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

from app.state.preferences_store import PreferencesStore
from app.widgets.dialogs import Dialogs


class SystemPromptRow(QWidget):
    """Signals: edited(str) (the prompt was typed or a preset chosen)."""

    edited = Signal(str)

    def __init__(self, preferences: PreferencesStore, parent: QWidget | None = None,
                 dialogs: Dialogs | None = None) -> None:
        super().__init__(parent)
        self.preferences = preferences
        self.dialogs = dialogs or Dialogs.over(self)
        self._row = row = QHBoxLayout(self)
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

    def add_leading(self, widget: QWidget) -> None:
        """A widget at the row's start (the chat page's engine menu)."""
        self._row.insertWidget(0, widget)

    def reload(self) -> None:
        """List the presets the preferences hold now."""
        self.presets.clear()
        self.presets.addItem("Presets…", None)
        for name, text in self.preferences.load().system_presets:
            self.presets.addItem(name, text)

    def default_prompt(self) -> str:
        """A new conversation's system prompt: the first preset's."""
        presets = self.preferences.load().system_presets
        return presets[0][1] if presets else ""

    def save_preset(self, name: str, text: str) -> None:
        """Save `text` as the preset `name` (replacing one of that name) and list it."""
        presets = tuple(p for p in self.preferences.load().system_presets if p[0] != name) + ((name, text),)
        self.preferences.update(system_presets=presets)
        self.reload()

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
            self.save_preset(name.strip(), text)
