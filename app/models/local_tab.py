"""The models page's "On this computer" tab: the local models with their sizes (LM Studio's and
Ollama's GGUFs too, used where they are), what is wrong with any of them, and import, remove and
download by repo id.

A model whose files are not whole (engine.store.integrity.model_damage: a header that does not
parse, a file shorter than its tensors, a shard the index names but the folder lacks) is marked
in its row and named under the table as `specchat models list` names it: "X is damaged: why.
Download it again." The other apps' models that could not be read are named there too.

What this does not do: import, remove or download (the page does, on its signals), or read
the disk (the page gives the models and what is wrong with them). File choosers are the
injected `dialogs`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

from PySide6.QtCore import Signal
from PySide6.QtGui import QBrush, QColor, QKeySequence, QShortcut
from PySide6.QtWidgets import (
    QHBoxLayout,
    QHeaderView,
    QLabel,
    QLineEdit,
    QPushButton,
    QTableWidget,
    QVBoxLayout,
    QWidget,
)

from app.models.tables import fill_local, selected_key, table_defaults
from app.widgets.dialogs import Dialogs
from engine.store import LocalModel
from engine.store.registry import FOUND_SOURCES

DAMAGED_COLOUR = "#b3261e"
GGUF_FILTER = "GGUF models (*.gguf);;All files, e.g. an Ollama blob (*)"


def damage_line(model: LocalModel, why: str) -> str:
    """The line that names a damaged model and what to do (as `specchat models list` says it)."""
    return f"{model.model_id} is damaged: {why}. Download it again."


class LocalTab(QWidget):
    """Signals: import_requested(object): a Path to import; remove_requested(object): the
    selected LocalModel; download_requested(str): a repo id typed in."""

    import_requested = Signal(object)
    remove_requested = Signal(object)
    download_requested = Signal(str)

    def __init__(self, dialogs: Dialogs, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.dialogs = dialogs
        self._models: list[LocalModel] = []
        self.table = QTableWidget(0, 4)
        self.table.setAccessibleName("Local models")
        self.table.setHorizontalHeaderLabels(["Name", "Source", "Size", "Location"])
        table_defaults(self.table)
        self.table.horizontalHeader().setSectionResizeMode(3, QHeaderView.ResizeMode.Stretch)
        self.table.itemSelectionChanged.connect(self.update_buttons)
        import_folder = QPushButton("Import &folder…")
        import_folder.setAccessibleName("Import a Hugging Face model folder")
        import_folder.clicked.connect(self.import_folder)
        self.problems_label = QLabel()
        self.problems_label.setWordWrap(True)
        self.problems_label.setAccessibleName("Problems with local models")
        self.problems_label.hide()
        import_gguf = QPushButton("Import .&gguf…")
        import_gguf.setAccessibleName("Import a GGUF file")
        import_gguf.clicked.connect(self._on_import_gguf_clicked)
        self.remove_button = QPushButton("Re&move…")
        self.remove_button.setAccessibleName("Remove the selected model")
        self.remove_button.clicked.connect(self._on_remove_clicked)
        QShortcut(QKeySequence.StandardKey.Delete, self.table).activated.connect(self._on_remove_clicked)
        self.repo_edit = QLineEdit()
        self.repo_edit.setPlaceholderText("owner/name or owner/name:FILE.gguf")
        self.repo_edit.setAccessibleName("Hugging Face repo id to download")
        self.repo_edit.returnPressed.connect(self._on_repo_download_clicked)
        repo_button = QPushButton("Download &repo")
        repo_button.setAccessibleName("Download the repo id")
        repo_button.clicked.connect(self._on_repo_download_clicked)
        buttons = QHBoxLayout()
        for w in (import_folder, import_gguf, self.remove_button):
            buttons.addWidget(w)
        buttons.addStretch(1)
        buttons.addWidget(self.repo_edit, 1)
        buttons.addWidget(repo_button)
        layout = QVBoxLayout(self)
        layout.addWidget(self.table)
        layout.addWidget(self.problems_label)
        layout.addLayout(buttons)

    def fill(self, models: Sequence[LocalModel], damage: Mapping[Path, str], problems: Sequence[str]) -> None:
        """The models (damaged ones marked: `damage` by path), and the other apps' `problems`."""
        self._models = list(models)
        fill_local(self.table, self._models)
        lines = []
        for row, model in enumerate(self._models):
            why = damage.get(model.path)
            if why:
                lines.append(damage_line(model, why))
                items = [self.table.item(row, col) for col in range(self.table.columnCount())]
                for item in items:
                    assert item is not None  # fill_local set every cell
                    item.setForeground(QBrush(QColor(DAMAGED_COLOUR)))
                    item.setToolTip(lines[-1])
                source = items[1]
                assert source is not None
                source.setText(f"{source.text()} · damaged")
        lines += problems
        self.problems_label.setText("\n".join(f"⚠ {line}" for line in lines))
        self.problems_label.setVisible(bool(lines))
        self.update_buttons()

    def selected_local(self) -> LocalModel | None:
        name = selected_key(self.table)
        return next((m for m in self._models if m.model_id == name), None) if name is not None else None

    def update_buttons(self) -> None:
        local = self.selected_local()  # LM Studio's and Ollama's own models are removed in those apps
        self.remove_button.setEnabled(local is not None and local.source not in FOUND_SOURCES)

    def import_folder(self) -> None:
        folder = self.dialogs.ask_folder("Import a Hugging Face model folder", "")
        if folder is not None:
            self.import_requested.emit(folder)

    def _on_import_gguf_clicked(self) -> None:
        path = self.dialogs.ask_open_path("Import a GGUF file", GGUF_FILTER)
        if path is not None:
            self.import_requested.emit(path)

    def _on_remove_clicked(self) -> None:
        model = self.selected_local()
        if model is not None:
            self.remove_requested.emit(model)

    def _on_repo_download_clicked(self) -> None:
        spec = self.repo_edit.text().strip()
        if spec:
            self.download_requested.emit(spec)
            self.repo_edit.clear()
