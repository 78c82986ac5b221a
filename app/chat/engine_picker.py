"""The menu above the chat that picks the engine a conversation runs on: the local model, or a
model on one of the servers in Settings > Engines (app/state/remote_engines.py). The choice is the
conversation's (ConversationStore.set_engine); a choice whose server or model is no longer in
the settings stays shown, marked, so the conversation says what it ran on."""

from __future__ import annotations

from PySide6.QtCore import Signal
from PySide6.QtWidgets import QComboBox, QWidget

from app.state.preferences import Preferences
from app.state.remote_engines import LOCAL, decode_choice, encode_choice, parse_engines


class EnginePicker(QComboBox):
    """Signals: choice_changed(str): the user picked another engine ('' = the local model)."""

    choice_changed = Signal(str)

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setAccessibleName("Engine")
        self.setToolTip("Where this conversation's answers come from: the model loaded here, or a model on a "
                        "server added in Settings > Engines")
        self.setSizeAdjustPolicy(QComboBox.SizeAdjustPolicy.AdjustToContents)
        self.activated.connect(lambda _index: self.choice_changed.emit(self.choice()))
        self.reload(Preferences())

    def reload(self, prefs: Preferences) -> None:
        """The menu's entries from the settings; the current choice is kept."""
        current = self.choice() if self.count() else LOCAL
        self.blockSignals(True)
        self.clear()
        self.addItem("Local model", LOCAL)
        for entry in parse_engines(prefs.remote_engines):
            for model in entry.models:
                self.addItem(f"{entry.name}: {model}", encode_choice(entry.name, model))
        self.blockSignals(False)
        self.set_choice(current)

    def choice(self) -> str:
        data = self.currentData()
        return data if isinstance(data, str) else LOCAL

    def set_choice(self, choice: str) -> None:
        index = self.findData(choice)
        if index < 0:
            picked = decode_choice(choice)
            if picked is None:
                index = 0
            else:
                self.addItem(f"{picked[0]}: {picked[1]} (not in Settings)", choice)
                index = self.count() - 1
        self.setCurrentIndex(index)
        self.setVisible(self.count() > 1)  # with no servers in the settings the menu would say nothing
