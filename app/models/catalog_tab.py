"""The models page's "Catalog" tab: every catalog pair with its fit badge, the speed measured
here or predicted (app/models/recommend.py), what runs and what downloads; Download, Use and
Refresh.

What this does not do: download, choose or decide (the page does, on its signals); it only
knows which models are on this computer through the `is_local` it is given.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from PySide6.QtCore import Qt, Signal
from PySide6.QtWidgets import QHBoxLayout, QPushButton, QTableWidget, QVBoxLayout, QWidget

from app.models.recommend import PairOption
from app.models.tables import CATALOG_COLUMNS, fill_catalog, selected_key, table_defaults


class CatalogTab(QWidget):
    """Signals: download_requested(object), use_requested(object): the selected PairOption;
    refresh_requested()."""

    download_requested = Signal(object)
    use_requested = Signal(object)
    refresh_requested = Signal()

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self._options: list[PairOption] = []
        self._is_local: Callable[[str], bool] = lambda _m: False
        self.table = QTableWidget(0, len(CATALOG_COLUMNS))
        self.table.setAccessibleName("Catalog pairs")
        self.table.setHorizontalHeaderLabels(list(CATALOG_COLUMNS))
        table_defaults(self.table)
        self.table.itemSelectionChanged.connect(self.update_buttons)
        self.table.itemDoubleClicked.connect(lambda _item: self._on_use_clicked())
        self.download_button = QPushButton("Do&wnload")
        self.download_button.setAccessibleName("Download the selected pair")
        self.download_button.clicked.connect(self._on_download_clicked)
        self.use_button = QPushButton("Use &selected pair")
        self.use_button.setAccessibleName("Use the selected catalog pair")
        self.use_button.clicked.connect(self._on_use_clicked)
        refresh = QPushButton("&Refresh")
        refresh.setAccessibleName("Refresh the model lists")
        refresh.clicked.connect(self.refresh_requested)
        buttons = QHBoxLayout()
        buttons.addWidget(self.download_button)
        buttons.addWidget(self.use_button)
        buttons.addStretch(1)
        buttons.addWidget(refresh)
        layout = QVBoxLayout(self)
        layout.addWidget(self.table)
        layout.addLayout(buttons)

    def fill(self, options: Sequence[PairOption], is_local: Callable[[str], bool]) -> None:
        """Redraw the pairs, keeping the selection."""
        selected = self.selected_option()
        self._options, self._is_local = list(options), is_local
        fill_catalog(self.table, self._options, is_local)
        if selected is not None:
            self.select_pair(selected.pair_id)
        self.update_buttons()

    def selected_option(self) -> PairOption | None:
        pair_id = selected_key(self.table)
        return next((o for o in self._options if o.pair_id == pair_id), None) if pair_id is not None else None

    def select_pair(self, pair_id: str) -> None:
        for row in range(self.table.rowCount()):
            item = self.table.item(row, 0)
            if item is not None and item.data(Qt.ItemDataRole.UserRole) == pair_id:
                self.table.selectRow(row)
                return

    def missing(self, option: PairOption) -> list[str]:
        """The pair's models not on this computer."""
        return [m for m in (option.target, option.draft) if m and not self._is_local(m)]

    def update_buttons(self) -> None:
        option = self.selected_option()
        missing = option is not None and bool(self.missing(option))
        self.download_button.setEnabled(missing)
        self.use_button.setEnabled(option is not None and not missing)

    def _on_download_clicked(self) -> None:
        option = self.selected_option()
        if option is not None:
            self.download_requested.emit(option)

    def _on_use_clicked(self) -> None:
        option = self.selected_option()
        if option is not None and not self.missing(option):
            self.use_requested.emit(option)
