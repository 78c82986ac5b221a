"""Settings > Engines: OpenAI-compatible servers a conversation can run on instead of the local
model (vLLM, llama.cpp's server, TGI, LM Studio, another SpecChat).

Add a server (name, URL, API key), press "List models" to ask it what it serves (in the remote
worker thread: the dialog never waits on the network); its models then appear in the chat's
engine menu. Like every settings tab it edits a copy: `show_preferences(prefs)` fills it,
`values()` gives the field it owns; `shutdown()` ends its worker thread when the dialog closes.
"""

from __future__ import annotations

from PySide6.QtCore import Slot
from PySide6.QtWidgets import (
    QAbstractItemView,
    QHBoxLayout,
    QHeaderView,
    QLabel,
    QPushButton,
    QTableWidget,
    QTableWidgetItem,
    QVBoxLayout,
    QWidget,
)

from app.state.preferences import Preferences
from app.state.remote_engines import RemoteEngineEntry, dump_engines, parse_engines
from app.workers.remote_worker import RemoteHost

NAME, URL, KEY, MODELS = range(4)


class EnginesTab(QWidget):
    """The Engines settings tab (see the module docstring)."""

    title = "E&ngines"

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self._host: RemoteHost | None = None
        self._listing: dict[int, int] = {}  # request id -> row being listed
        self.table = QTableWidget(0, 4)
        self.table.setAccessibleName("Remote engines")
        self.table.setHorizontalHeaderLabels(["Name", "URL", "API key", "Models"])
        self.table.horizontalHeader().setSectionResizeMode(URL, QHeaderView.ResizeMode.Stretch)
        self.table.horizontalHeader().setSectionResizeMode(MODELS, QHeaderView.ResizeMode.Stretch)
        self.table.verticalHeader().setVisible(False)
        self.table.setSelectionBehavior(QAbstractItemView.SelectionBehavior.SelectRows)
        self.add_button = QPushButton("&Add server")
        self.add_button.setAccessibleName("Add a server")
        self.add_button.clicked.connect(lambda: self.add_engine(RemoteEngineEntry("gpu-box", "http://gpu-box:8000/v1")))
        self.list_button = QPushButton("&List models")
        self.list_button.setAccessibleName("List the selected server's models")
        self.list_button.setToolTip("Ask the selected server which models it serves (GET /v1/models)")
        self.list_button.clicked.connect(self.list_selected)
        self.remove_button = QPushButton("&Remove")
        self.remove_button.setAccessibleName("Remove the selected server")
        self.remove_button.clicked.connect(self._on_remove_clicked)
        buttons = QHBoxLayout()
        for button in (self.add_button, self.list_button, self.remove_button):
            buttons.addWidget(button)
        buttons.addStretch(1)
        self.status = QLabel("")
        self.status.setAccessibleName("Engines status")
        self.status.setWordWrap(True)
        intro = QLabel("Servers that speak OpenAI's API: vLLM, llama.cpp's server, TGI, LM Studio or another "
                       "SpecChat (`specchat serve`). Double-click a cell to edit it; the URL usually ends in /v1 "
                       "(vLLM: http://HOST:8000/v1). After listing its models, choose one for a conversation in "
                       "the menu above the chat.")
        intro.setWordWrap(True)
        layout = QVBoxLayout(self)
        layout.addWidget(intro)
        layout.addWidget(self.table, 1)
        layout.addLayout(buttons)
        layout.addWidget(self.status)

    # ---- values -------------------------------------------------------------------------------
    def show_preferences(self, prefs: Preferences) -> None:
        self.table.setRowCount(0)
        for entry in parse_engines(prefs.remote_engines):
            self.add_engine(entry)

    def values(self) -> dict[str, object]:
        return {"remote_engines": dump_engines(self.entries())}

    def entries(self) -> tuple[RemoteEngineEntry, ...]:
        out = []
        for row in range(self.table.rowCount()):
            name, url, key = (self._text(row, col) for col in (NAME, URL, KEY))
            models = tuple(m.strip() for m in self._text(row, MODELS).split(",") if m.strip())
            if name and url:
                out.append(RemoteEngineEntry(name, url, key, models))
        return tuple(out)

    def add_engine(self, entry: RemoteEngineEntry) -> int:
        row = self.table.rowCount()
        self.table.insertRow(row)
        for col, text in ((NAME, entry.name), (URL, entry.url), (KEY, entry.api_key), (MODELS, ", ".join(entry.models))):
            self.table.setItem(row, col, QTableWidgetItem(text))
        self.table.selectRow(row)
        return row

    def _text(self, row: int, col: int) -> str:
        item = self.table.item(row, col)
        return item.text().strip() if item is not None else ""

    def _on_remove_clicked(self) -> None:
        row = self.table.currentRow()
        if row >= 0:
            self.table.removeRow(row)
            self._listing = {rid: r - (r > row) for rid, r in self._listing.items() if r != row}

    # ---- listing models -------------------------------------------------------------------------
    def list_selected(self) -> None:
        row = self.table.currentRow()
        if row < 0:
            self.status.setText("Select a server first.")
            return
        if self._host is None:
            self._host = RemoteHost(self)
            self._host.worker.models_listed.connect(self._on_worker_models_listed)
            self._host.worker.models_failed.connect(self._on_worker_models_failed)
        request_id = self._host.list_models(self._text(row, URL), self._text(row, KEY))
        self._listing[request_id] = row
        self.status.setText(f"Asking {self._text(row, NAME)} for its models…")

    @Slot(int, object)
    def _on_worker_models_listed(self, request_id: int, models: tuple[str, ...]) -> None:
        row = self._listing.pop(request_id, None)
        if row is None or row >= self.table.rowCount():
            return
        self.table.setItem(row, MODELS, QTableWidgetItem(", ".join(models)))
        name = self._text(row, NAME)
        self.status.setText(f"{name} serves {len(models)} model{'s' if len(models) != 1 else ''}: "
                            f"{', '.join(models) or 'none'}." if models else f"{name} serves no models.")

    @Slot(int, str)
    def _on_worker_models_failed(self, request_id: int, message: str) -> None:
        if self._listing.pop(request_id, None) is not None:
            self.status.setText(message)

    def shutdown(self) -> None:
        if self._host is not None:
            self._host.shutdown()
