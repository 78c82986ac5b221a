"""The models page's active pair: target and draft combo boxes over the local models, a "Use
this pair" button, and the line that says what runs (or what is chosen, not loaded yet).

The draft combo offers, in groups: "Automatic (recommended)" (the engine picks:
engine.decoding.draft_choice) and "None (draft-free)"; the heads the chosen target brings (its
checkpoint's MTP/NextN layers, EAGLE-3 heads and Gemma 4 assistants beside it:
engine.decoding.draft_menu, through the page's `heads_for`), a head that cannot draft for it
listed greyed out with why in its tooltip; the self-draft, sized to the memory left or at 4, 3 or
2 bits (a low-bit copy of the target's offloaded layers); then every local model but the chosen
target and its heads (a model cannot draft for itself; it used to be offered, and choosing it
silently meant no draft). A preference that is not on this computer stays listed, marked
"(not downloaded)".

What this does not do: save anything (the page does, on `use_requested`) or know the starter's
folder (the page gives the names as the combos list them).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from PySide6.QtCore import Qt, Signal
from PySide6.QtGui import QStandardItemModel
from PySide6.QtWidgets import QComboBox, QGroupBox, QHBoxLayout, QLabel, QPushButton, QVBoxLayout, QWidget

from engine.decoding.draft_menu import DraftEntry, self_entries

NO_DRAFT = "None (draft-free)"
# the engine's own draft choices, as the combo lists them -> as the preferences store them
# ("" is no draft, as it always was; engine.decoding.pair.parse_draft_spec reads the rest)
DRAFT_CHOICES = {"Automatic (recommended)": "auto", NO_DRAFT: "", **{e.label: e.spec for e in self_entries()}}
HeadsFor = Callable[[str], list[DraftEntry]]  # a target as the combo names it -> the heads it brings


class PairBox(QGroupBox):
    """Signals: use_requested(str, str): target and draft ("" = none) as the combos name them."""

    use_requested = Signal(str, str)

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__("Active pair", parent)
        self._names: list[str] = []
        self.heads_for: HeadsFor = lambda _target: []
        self.target_combo = QComboBox()
        self.target_combo.setAccessibleName("Active target model")
        self.target_combo.setObjectName("target")
        self.target_combo.currentIndexChanged.connect(self._on_target_combo_changed)
        self.draft_combo = QComboBox()
        self.draft_combo.setAccessibleName("Active draft model")
        self.draft_combo.setToolTip("What guesses ahead for the target, which checks the guesses several tokens "
                                    "per pass. Automatic: the engine picks the fastest of the model's own heads, "
                                    "a self-draft, the catalog's draft model and none, and the status bar says "
                                    "why. None: draft-free. Then the heads this model brings (MTP layers in its "
                                    "files, EAGLE-3 heads or assistants beside it), a self-draft (a low-bit copy "
                                    "of the target's offloaded layers; it needs layers offloaded to pay), or a "
                                    "small model of the same family.")
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
        # a choice the new target does not offer (the old target's head) goes back to automatic
        self._fill_draft_combo(self.draft_combo.currentData() or "", keep_missing=False)

    def _fill_draft_combo(self, current: str, keep_missing: bool = True) -> None:
        target = self.target_combo.currentData() or ""
        heads = self.heads_for(target) if target else []
        folders = {Path(h.spec).name for h in heads if h.spec != "mtp"}
        groups = [[DraftEntry("auto", "Automatic (recommended)"), DraftEntry("", NO_DRAFT)], heads, self_entries(),
                  [DraftEntry(n, n) for n in self._names if n != target and n not in folders]]
        current = current if current != target else ""
        combo = self.draft_combo
        combo.blockSignals(True)
        combo.clear()
        for group in (g for g in groups if g):
            if combo.count():
                combo.insertSeparator(combo.count())
            for entry in group:
                _add_entry(combo, entry)
        if current and combo.findData(current) < 0 and not keep_missing:
            current = "auto"
        if current and combo.findData(current) < 0:
            missing = "MTP head (not in this model's files)" if current == "mtp" else f"{current} (not downloaded)"
            combo.addItem(missing, current)
        combo.setCurrentIndex(max(combo.findData(current), 0))
        combo.blockSignals(False)

    def _on_use_clicked(self) -> None:
        target = self.target_combo.currentData() or ""
        draft = self.draft_combo.currentData() or ""
        if target:
            self.use_requested.emit(target, "" if draft == target else draft)


def _add_entry(combo: QComboBox, entry: DraftEntry) -> None:
    """One draft; a head that cannot draft for the target greyed out, its reason as the tooltip."""
    combo.addItem(entry.label + (" (cannot be used)" if entry.problem else ""), entry.spec)
    index = combo.count() - 1
    if entry.problem:
        combo.setItemData(index, f"It cannot draft for this model: {entry.problem}.", Qt.ItemDataRole.ToolTipRole)
        model = combo.model()
        if isinstance(model, QStandardItemModel):
            item = model.item(index)
            item.setEnabled(False)
    elif entry.spec not in ("auto", "") and Path(entry.spec).is_absolute():
        combo.setItemData(index, entry.spec, Qt.ItemDataRole.ToolTipRole)


def _fill_combo(combo: QComboBox, names: list[str], current: str) -> None:
    combo.blockSignals(True)
    combo.clear()
    for name in names:
        combo.addItem(name, name)
    if current and current not in names:
        combo.addItem(f"{current} (not downloaded)", current)
    combo.setCurrentIndex(max(combo.findData(current), 0))
    combo.blockSignals(False)
