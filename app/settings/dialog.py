"""Settings: sampling defaults, engine options, appearance, system prompts, and this computer.

Every field edits a copy of the current `Preferences`; OK saves it into the `PreferencesStore`
(whose `changed` signal tells the main window), Cancel drops it. The Engine tab starts with what
actually runs (`running`, read from the loaded model: its format, where its layers live, the
decoding mode, the measured speed), since the fields below are requests that apply at the next
load and that a GGUF, a CPU or a pair without a draft may not follow to the letter. The "This
computer" tab (hardware_tab.py) benchmarks and plots; the Server, Engines and Hugging Face tabs
are their own modules too. The models folder is chosen through the injected `dialogs`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from PySide6.QtCore import Qt
from PySide6.QtGui import QCloseEvent, QKeySequence, QShortcut
from PySide6.QtWidgets import (
    QAbstractItemView,
    QCheckBox,
    QComboBox,
    QDialog,
    QDialogButtonBox,
    QDoubleSpinBox,
    QFormLayout,
    QHBoxLayout,
    QHeaderView,
    QLabel,
    QLineEdit,
    QPushButton,
    QSpinBox,
    QTableWidget,
    QTableWidgetItem,
    QTabWidget,
    QVBoxLayout,
    QWidget,
)

from app.settings.engines_tab import EnginesTab
from app.settings.hardware_tab import HardwareTab
from app.settings.hub_tab import HubTab
from app.settings.server_tab import ServerTab
from app.settings.tips import TIPS
from app.state.preferences import Preferences
from app.state.preferences_store import PreferencesStore
from app.state.running import RunningPair
from app.widgets.dialogs import Dialogs
from app.widgets.mnemonics import give_buddies
from engine.store import load_catalog

CHOICE_LABELS: dict[str, list[tuple[str, str]]] = {
    "device": [("auto", "Automatic (GPU if present)"), ("cuda", "GPU (CUDA)"), ("cpu", "CPU only")],
    "quant": [("none", "None: as stored (GPU 16-bit, CPU 32-bit, GGUF blocks)"),
              ("nf4", "NF4 (4-bit) for 16-bit checkpoints")],
    "offload": [("auto", "Automatic (as many layers on the GPU as fit)"), ("none", "None (all on the GPU)"),
                ("all", "All layers streamed from RAM")],
    "tree_mode": [("specexec", "Speculative: the draft's trees, or draft-free without a draft"),
                  ("autoregressive", "Plain decoding (one token per pass)")],
    "theme": [("system", "Follow the system"), ("light", "Light"), ("dark", "Dark")],
}


def _spin(low: int, high: int, name: str, special: str = "") -> QSpinBox:
    box = QSpinBox()
    box.setRange(low, high)
    box.setAccessibleName(name)
    if special:
        box.setSpecialValueText(special)
    return box


def _dspin(low: float, high: float, step: float, decimals: int, name: str, special: str = "") -> QDoubleSpinBox:
    box = QDoubleSpinBox()
    box.setRange(low, high)
    box.setSingleStep(step)
    box.setDecimals(decimals)
    box.setAccessibleName(name)
    if special:
        box.setSpecialValueText(special)
    return box


def _combo(field: str, name: str) -> QComboBox:
    box = QComboBox()
    box.setAccessibleName(name)
    for value, label in CHOICE_LABELS[field]:
        box.addItem(label, value)
    return box


class SettingsDialog(QDialog):
    """Edit the preferences; OK saves them. `benchmark_options` go to measure_hardware (tests pass a
    quick layer shape)."""

    def __init__(self, store: PreferencesStore, parent: QWidget | None = None, *,
                 benchmark_options: Mapping[str, Any] | None = None, running: RunningPair | None = None,
                 dialogs: Dialogs | None = None) -> None:
        super().__init__(parent)
        self.setWindowTitle("Settings")
        self.setAccessibleName("Settings")
        self._store = store
        self._prefs = store.load()
        self._catalog = load_catalog()
        self._running = running
        self.dialogs = dialogs or Dialogs.over(self)
        self.hardware = HardwareTab(self._catalog, self._prefs, running, benchmark_options)

        self.tabs = QTabWidget()
        self.tabs.setAccessibleName("Settings sections")
        self.tabs.addTab(self._sampling_tab(), "&Sampling")
        self.tabs.addTab(self._engine_tab(), "&Engine")
        self.tabs.addTab(self._appearance_tab(), "&Appearance")
        self.tabs.addTab(self._prompts_tab(), "S&ystem prompts")
        self.tabs.addTab(self.hardware, "This &computer")
        # tabs in their own modules: show_preferences(prefs) fills them, values() is what they own
        self.server_tab, self.engines_tab, self.hub_tab = ServerTab(running=running), EnginesTab(), HubTab()
        self._own_tabs = (self.server_tab, self.engines_tab, self.hub_tab)
        for tab in self._own_tabs:
            self.tabs.addTab(tab, tab.title)
        # every tab title in full, never "Hug…" nor behind scroll arrows: the dialog is as wide as they are
        self.tabs.tabBar().setElideMode(Qt.TextElideMode.ElideNone)
        self.tabs.setUsesScrollButtons(False)
        self.finished.connect(self.engines_tab.shutdown)
        self.buttons = QDialogButtonBox(
            QDialogButtonBox.StandardButton.Ok | QDialogButtonBox.StandardButton.Cancel
            | QDialogButtonBox.StandardButton.RestoreDefaults)
        for which, name in ((QDialogButtonBox.StandardButton.Ok, "Save settings"),
                            (QDialogButtonBox.StandardButton.Cancel, "Discard changes"),
                            (QDialogButtonBox.StandardButton.RestoreDefaults, "Restore default settings")):
            self.buttons.button(which).setAccessibleName(name)
        self.buttons.accepted.connect(self.accept)
        self.buttons.rejected.connect(self.reject)
        self.buttons.button(QDialogButtonBox.StandardButton.RestoreDefaults).clicked.connect(self.restore_defaults)
        layout = QVBoxLayout(self)
        layout.addWidget(self.tabs)
        layout.addWidget(self.buttons)
        for index in range(self.tabs.count()):  # Alt+1..5 jump between sections
            QShortcut(QKeySequence(f"Alt+{index + 1}"), self).activated.connect(
                lambda i=index: self.tabs.setCurrentIndex(i))
        for name, tip in TIPS.items():
            getattr(self, name).setToolTip(tip)
        give_buddies(self)  # "API &key:" beside a row of widgets showed its "&"
        self.resize(max(820, self.minimumSizeHint().width()), 640)
        self.show_preferences(self._prefs)

    # ---- tabs ------------------------------------------------------------------------------
    def _sampling_tab(self) -> QWidget:
        self.temperature = _dspin(0.0, 2.0, 0.05, 2, "Temperature", "0 (greedy)")
        self.top_p = _dspin(0.0, 1.0, 0.01, 2, "Top-p")
        self.top_k = _spin(0, 1000, "Top-k", "off")
        self.min_p = _dspin(0.0, 1.0, 0.01, 2, "Min-p", "off")
        self.repetition_penalty = _dspin(1.0, 2.0, 0.01, 2, "Repetition penalty", "off")
        self.max_new_tokens = _spin(1, 32768, "Maximum new tokens")
        self.context_length = _spin(256, 131072, "Context length")
        self.context_length.setSingleStep(256)
        form = QFormLayout()
        for label, widget in (("&Temperature:", self.temperature), ("Top-&p:", self.top_p), ("Top-&k:", self.top_k),
                              ("&Min-p:", self.min_p), ("&Repetition penalty:", self.repetition_penalty),
                              ("Max &new tokens:", self.max_new_tokens), ("Conte&xt length:", self.context_length)):
            form.addRow(label, widget)
        note = QLabel("Defaults for new messages. Temperature 0 always picks the most likely token.")
        note.setWordWrap(True)
        return _page(form, note)

    def _engine_tab(self) -> QWidget:
        self.device = _combo("device", "Device")
        self.quant = _combo("quant", "Quantisation")
        self.offload = _combo("offload", "Offload")
        self.budget_auto = QCheckBox("&Automatic (the planner picks it for this computer)")
        self.budget_auto.setAccessibleName("Automatic tree budget")
        self.budget = _spin(1, 4096, "Tree budget")
        self.budget.setValue(64)
        self.budget_auto.toggled.connect(lambda on: self.budget.setEnabled(not on))
        budget_row = QHBoxLayout()
        budget_row.addWidget(self.budget_auto)
        budget_row.addWidget(self.budget)
        self.max_depth = _spin(1, 128, "Maximum tree depth")
        self.tree_mode = _combo("tree_mode", "Decoding mode")
        self.keep_draft = QCheckBox("&Keep the draft on where it is measured slower")
        self.keep_draft.setAccessibleName("Keep the draft on")
        self.keep_draft.setToolTip("SpecChat measures each conversation with and without the draft model and turns "
                                   "the draft off while it is the slower (trying it again now and then). Tick to "
                                   "keep it on, for instance to compare speeds yourself.")
        mode_label = QLabel("&Mode:")
        mode_label.setBuddy(self.tree_mode)
        mode_row = QVBoxLayout()
        mode_row.addWidget(self.tree_mode)
        mode_row.addWidget(self.keep_draft)
        self.models_dir = QLineEdit()
        self.models_dir.setAccessibleName("Models folder")
        self.models_dir.setPlaceholderText(str(Preferences().models_path()))
        browse = QPushButton("&Browse…")
        browse.setAccessibleName("Choose the models folder")
        browse.clicked.connect(self._on_browse_clicked)
        folder_row = QHBoxLayout()
        folder_row.addWidget(self.models_dir, 1)
        folder_row.addWidget(browse)
        budget_label = QLabel("Tree &budget:")
        budget_label.setBuddy(self.budget)
        folder_label = QLabel("Models &folder:")
        folder_label.setBuddy(self.models_dir)
        self.kv_ram_gb = _dspin(0.0, 1024.0, 0.5, 1, "Conversation memory in RAM")
        self.kv_ram_gb.setSuffix(" GB")
        self.kv_ram_gb.setToolTip("Recent conversations keep what the model has read of them, so their next "
                                  "message is answered without reading the history again. This much RAM holds "
                                  "them; the oldest leave first (to disk, below).")
        self.kv_disk_gb = _dspin(0.0, 10_000.0, 1.0, 0, "Saved conversations on disk")
        self.kv_disk_gb.setSuffix(" GB")
        self.kv_disk_gb.setToolTip("Long conversations are saved here when SpecChat closes, so they continue "
                                   "after a restart without reading them again. 0 saves nothing.")
        self.running_label = QLabel()
        self.running_label.setAccessibleName("What runs now")
        self.running_label.setWordWrap(True)
        self.running_label.setTextFormat(Qt.TextFormat.RichText)
        self.running_label.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.running_label.setText(f"<b>Running now:</b> {self._running.summary('<br>')}" if self._running is not None
                                   else "<b>Running now:</b> no model is loaded.")
        form = QFormLayout()
        form.addRow(self.running_label)
        for label, item in (("&Device:", self.device), ("&Quantisation:", self.quant), ("&Offload:", self.offload),
                            (budget_label, budget_row), ("Max tree &depth:", self.max_depth),
                            (mode_label, mode_row), (folder_label, folder_row),
                            ("Conversation &memory:", self.kv_ram_gb), ("Sa&ved conversations:", self.kv_disk_gb)):
            form.addRow(label, item)
        note = QLabel("The fields are requests: they apply the next time the pair is loaded, as far as the model "
                      "allows (the line above says what runs). An empty models folder uses the default.")
        note.setWordWrap(True)
        return _page(form, note)

    def _appearance_tab(self) -> QWidget:
        self.theme = _combo("theme", "Theme")
        self.font_size = _spin(7, 32, "Font size")
        self.font_size.setSuffix(" pt")
        form = QFormLayout()
        form.addRow("&Theme:", self.theme)
        form.addRow("&Font size:", self.font_size)
        return _page(form)

    def _prompts_tab(self) -> QWidget:
        self.presets = QTableWidget(0, 2)
        self.presets.setAccessibleName("System prompt presets")
        self.presets.setHorizontalHeaderLabels(["Name", "System prompt"])
        self.presets.horizontalHeader().setSectionResizeMode(1, QHeaderView.ResizeMode.Stretch)
        self.presets.verticalHeader().setVisible(False)
        self.presets.setSelectionBehavior(QAbstractItemView.SelectionBehavior.SelectRows)
        add = QPushButton("&Add")
        add.setAccessibleName("Add a system prompt")
        add.clicked.connect(lambda: self._add_preset("New prompt", "You are a helpful assistant."))
        remove = QPushButton("&Remove")
        remove.setAccessibleName("Remove the selected system prompt")
        remove.clicked.connect(self._on_remove_preset_clicked)
        buttons = QHBoxLayout()
        buttons.addWidget(add)
        buttons.addWidget(remove)
        buttons.addStretch(1)
        tab = QWidget()
        layout = QVBoxLayout(tab)
        layout.addWidget(QLabel("Double-click a cell to edit. The chat's prompt menu lists these."))
        layout.addWidget(self.presets)
        layout.addLayout(buttons)
        return tab

    # ---- values ----------------------------------------------------------------------------
    def show_preferences(self, prefs: Preferences) -> None:
        for name in ("temperature", "top_p", "min_p", "repetition_penalty", "kv_ram_gb", "kv_disk_gb"):
            getattr(self, name).setValue(getattr(prefs, name))
        for name in ("top_k", "max_new_tokens", "context_length", "max_depth", "font_size"):
            getattr(self, name).setValue(getattr(prefs, name))
        for name in CHOICE_LABELS:
            box: QComboBox = getattr(self, name)
            box.setCurrentIndex(max(0, box.findData(getattr(prefs, name))))
        self.budget_auto.setChecked(prefs.budget == 0)
        self.budget.setEnabled(prefs.budget != 0)
        if prefs.budget:
            self.budget.setValue(prefs.budget)
        self.keep_draft.setChecked(prefs.keep_draft)
        self.models_dir.setText(prefs.models_dir)
        self.presets.setRowCount(0)
        for title, text in prefs.system_presets:
            self._add_preset(title, text)
        for tab in self._own_tabs:
            tab.show_preferences(prefs)

    def preferences(self) -> Preferences:
        """The preferences as the widgets now show them (fields not shown here are kept)."""
        presets = []
        for row in range(self.presets.rowCount()):
            cells = [self.presets.item(row, col) for col in (0, 1)]
            title, text = ((c.text() if c is not None else "") for c in cells)
            title = title.strip()
            if title:
                presets.append((title, text))
        values: dict[str, Any] = {name: getattr(self, name).value() for name in (
            "temperature", "top_p", "min_p", "repetition_penalty", "top_k", "max_new_tokens", "context_length",
            "max_depth", "font_size", "kv_ram_gb", "kv_disk_gb")}
        values.update({name: getattr(self, name).currentData() for name in CHOICE_LABELS})
        values["budget"] = 0 if self.budget_auto.isChecked() else self.budget.value()
        values["keep_draft"] = self.keep_draft.isChecked()
        values["models_dir"] = self.models_dir.text().strip()
        values["system_presets"] = tuple(presets) or Preferences().system_presets
        for tab in self._own_tabs:
            values.update(tab.values())
        return replace(self._store.load(), **values)

    def restore_defaults(self) -> None:
        self.show_preferences(Preferences())

    def accept(self) -> None:
        self._store.save(self.preferences())
        self.hardware.shutdown()
        super().accept()

    def reject(self) -> None:
        self.hardware.shutdown()
        super().reject()

    def closeEvent(self, event: QCloseEvent) -> None:
        self.hardware.shutdown()
        super().closeEvent(event)

    def _add_preset(self, title: str, text: str) -> None:
        row = self.presets.rowCount()
        self.presets.insertRow(row)
        self.presets.setItem(row, 0, QTableWidgetItem(title))
        self.presets.setItem(row, 1, QTableWidgetItem(text))

    def _on_remove_preset_clicked(self) -> None:
        rows = sorted({i.row() for i in self.presets.selectedIndexes()}, reverse=True)
        for row in rows:
            self.presets.removeRow(row)

    def _on_browse_clicked(self) -> None:
        folder = self.dialogs.ask_folder("Models folder", self.models_dir.text())
        if folder is not None:
            self.models_dir.setText(str(folder))


def _page(form: QFormLayout, note: QLabel | None = None) -> QWidget:
    page = QWidget()
    layout = QVBoxLayout(page)
    fields = QWidget()
    fields.setLayout(form)
    fields.setMaximumWidth(720)  # long fields on a wide dialog are hard to read
    layout.addWidget(fields)
    if note is not None:
        note.setAlignment(Qt.AlignmentFlag.AlignLeft)
        layout.addWidget(note)
    layout.addStretch(1)
    return page
