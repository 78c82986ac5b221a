"""The models page's active pair: target and draft combo boxes over the local models, a "Use
this pair" button, and the line that says what runs (or what is chosen, not loaded yet).

The draft combo offers the engine's own choices first: "Automatic (recommended)" (the engine
picks: engine.decoding.draft_choice), "None (draft-free)" and "Self-draft" (a low-bit copy of
the target's offloaded layers), then every local model but the chosen target (a model cannot
draft for itself; it used to be offered, and choosing it silently meant no draft). A preference
that is not on this computer stays listed, marked "(not downloaded)".

What this does not do: save anything (the page does, on `use_requested`) or know the starter's
folder (the page gives the names as the combos list them).
"""

from __future__ import annotations

from PySide6.QtCore import Signal
from PySide6.QtWidgets import QComboBox, QGroupBox, QHBoxLayout, QLabel, QPushButton, QVBoxLayout, QWidget

NO_DRAFT = "None (draft-free)"
# the engine's own draft choices, as the combo lists them -> as the preferences store them
# ("" is no draft, as it always was; engine.decoding.pair.parse_draft_spec reads the rest)
DRAFT_CHOICES = {"Automatic (recommended)": "auto", NO_DRAFT: "", "Self-draft": "self"}


class PairBox(QGroupBox):
    """Signals: use_requested(str, str): target and draft ("" = none) as the combos name them."""

    use_requested = Signal(str, str)

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__("Active pair", parent)
        self._names: list[str] = []
        self.target_combo = QComboBox()
        self.target_combo.setAccessibleName("Active target model")
        self.target_combo.setObjectName("target")
        self.target_combo.currentIndexChanged.connect(self._on_target_combo_changed)
        self.draft_combo = QComboBox()
        self.draft_combo.setAccessibleName("Active draft model")
        self.draft_combo.setToolTip("What guesses ahead for the target, which checks the guesses several tokens "
                                    "per pass. Automatic: the engine picks the fastest of the model's own heads, "
                                    "a self-draft, the catalog's draft model and none, and the status bar says "
                                    "why. None: draft-free. Self-draft: a low-bit copy of the target's "
                                    "offloaded layers. Or a small model of the same family.")
        for combo in (self.target_combo, self.draft_combo):  # long names elide: the page fits half a screen
            combo.setSizeAdjustPolicy(QComboBox.SizeAdjustPolicy.AdjustToMinimumContentsLengthWithIcon)
            combo.setMinimumContentsLength(14)
        self.use_button = QPushButton("&Use this pair")
        self.use_button.setAccessibleName("Use the chosen target and draft")
        self.use_button.clicked.connect(self._on_use_clicked)
        self.active_label = QLabel()
        self.active_label.setAccessibleName("Active pair")
        self.active_label.setWordWrap(True)
        target_label = QLabel("&Target:")
        target_label.setBuddy(self.target_combo)
        draft_label = QLabel("&Draft:")
        draft_label.setBuddy(self.draft_combo)
        column = QVBoxLayout(self)
        row = QHBoxLayout()
        for w in (target_label, self.target_combo, draft_label, self.draft_combo, self.use_button):
            row.addWidget(w)
        row.addStretch(1)
        column.addLayout(row)
        column.addWidget(self.active_label)

    def show_pair(self, names: list[str], target: str, draft: str, line: str, tip: str) -> None:
        """The local models' names, the preferred target and draft (as the combos name them),
        and the line under the combos (rich text) with its tooltip."""
        self._names = list(names)
        _fill_combo(self.target_combo, self._names, target)
        self._fill_draft_combo(draft)
        self.active_label.setText(line)
        self.active_label.setToolTip(tip)
        self.use_button.setEnabled(self.target_combo.count() > 0)

    def _on_target_combo_changed(self, _index: int) -> None:
        self._fill_draft_combo(self.draft_combo.currentData() or "")

    def _fill_draft_combo(self, current: str) -> None:
        target = self.target_combo.currentData() or ""
        names = [n for n in self._names if n != target]
        _fill_combo(self.draft_combo, [*DRAFT_CHOICES, *names], current if current != target else "")

    def _on_use_clicked(self) -> None:
        target = self.target_combo.currentData() or ""
        draft = self.draft_combo.currentData() or ""
        if target:
            self.use_requested.emit(target, "" if draft == target else draft)


def _fill_combo(combo: QComboBox, names: list[str], current: str) -> None:
    combo.blockSignals(True)
    combo.clear()
    for name in names:
        combo.addItem(name, DRAFT_CHOICES.get(name, name) if combo.objectName() != "target" else name)
    if current and current not in names and current not in DRAFT_CHOICES.values():
        combo.addItem(f"{current} (not downloaded)", current)
    combo.setCurrentIndex(max(combo.findData(current), 0))
    combo.blockSignals(False)
