"""The models page's two tables as plain functions: the catalog (one row per pair, with its fit
badge, the speed measured here or predicted, what runs and what downloads) and the local models.

Rows carry their key (pair id, model id) as column 0's UserRole data; `selected_key` reads it
back. Nothing here decides anything: app/models/recommend.py words the rows, app/models/page.py owns
the tables and reacts to them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from PySide6.QtCore import Qt
from PySide6.QtGui import QBrush, QColor
from PySide6.QtWidgets import QAbstractItemView, QHeaderView, QTableWidget, QTableWidgetItem

from app.models.recommend import PairOption
from engine.store import LocalModel
from engine.store.registry import FOUND_SOURCES
from engine.units import format_bytes

# fit and speed first: at half a screen the last columns need scrolling
CATALOG_COLUMNS = ("Pair", "Fit", "Speed here", "Target", "Format", "Draft", "Download", "On disk", "About")
COL_PAIR, COL_FORMAT, COL_FIT, COL_SPEED, COL_DRAFT, COL_ABOUT = (
    CATALOG_COLUMNS.index(c) for c in ("Pair", "Format", "Fit", "Speed here", "Draft", "About"))
FIT_COLOURS = {"fits": "#1e7d32", "slow": "#b26a00", "too big": "#b3261e", "unknown": "#666666"}
SOURCE_WORDS = {"hub": "downloaded", "import": "imported", "pypi-wheel": "PyPI wheel", "hf-cache": "HF cache",
                **FOUND_SOURCES}


def table_defaults(table: QTableWidget) -> None:
    table.setSelectionBehavior(QAbstractItemView.SelectionBehavior.SelectRows)
    table.setSelectionMode(QAbstractItemView.SelectionMode.SingleSelection)
    table.setEditTriggers(QAbstractItemView.EditTrigger.NoEditTriggers)
    table.verticalHeader().setVisible(False)
    table.setAlternatingRowColors(True)
    table.horizontalHeader().setSectionResizeMode(QHeaderView.ResizeMode.ResizeToContents)
    table.horizontalHeader().setStretchLastSection(True)
    table.setMinimumHeight(110)  # a few rows stay visible in a small window


def fill_catalog(table: QTableWidget, options: Sequence[PairOption], is_local: Callable[[str], bool]) -> None:
    """One row per pair: the tooltips give the speed's basis (measured here, or the prior) and
    where the target comes from."""
    table.setRowCount(len(options))
    for row, option in enumerate(options):
        needed = [m for m in (option.target, option.draft) if m]
        on_disk = [m for m in needed if is_local(m)]
        disk = "yes" if len(on_disk) == len(needed) else (f"{len(on_disk)} of {len(needed)}" if on_disk else "no")
        cells = [option.title, option.fit_label, option.speed_text(), option.target, option.target_format,
                 draft_text(option), format_bytes(option.download_bytes), disk, option.description]
        for col, text in enumerate(cells):
            item = QTableWidgetItem(text)
            item.setData(Qt.ItemDataRole.UserRole, option.pair_id)
            if col in (COL_PAIR, COL_SPEED, COL_ABOUT):
                item.setToolTip(option.reason or option.description)
            if col == COL_FORMAT:
                item.setToolTip(option.target_source)
            if col == COL_DRAFT and option.draft_role == "head":
                item.setToolTip(f"An EAGLE-3 head trained for {option.target}: one decoder layer that drafts from the "
                                "target's hidden states. It runs only with that target; it is downloaded beside it.")
            if col == COL_FIT:
                item.setForeground(QBrush(QColor("#ffffff")))
                item.setBackground(QBrush(QColor(FIT_COLOURS.get(option.fit, "#666666"))))
                item.setTextAlignment(Qt.AlignmentFlag.AlignCenter)
                item.setToolTip(option.reason or option.fit_label)
            table.setItem(row, col, item)


def draft_text(option: PairOption) -> str:
    """The Draft cell: the draft's id, marked when it is an EAGLE-3 head; "—" for none."""
    if not option.draft:
        return "—"
    return f"{option.draft} (EAGLE-3 head)" if option.draft_role == "head" else option.draft


def fill_local(table: QTableWidget, models: Sequence[LocalModel]) -> None:
    table.setRowCount(len(models))
    for row, model in enumerate(models):
        size = format_bytes(model.size_bytes) + ("" if model.owns_files else " (not copied)")
        source = SOURCE_WORDS.get(model.source, model.source) + (f" · {model.detail}" if model.detail else "")
        for col, text in enumerate([model.model_id, source, size, str(model.path)]):
            item = QTableWidgetItem(text)
            item.setData(Qt.ItemDataRole.UserRole, model.model_id)
            table.setItem(row, col, item)


def selected_key(table: QTableWidget) -> str | None:
    """The key (UserRole data of column 0) of a table's selected row, or None."""
    model = table.selectionModel()
    rows = model.selectedRows() if model is not None else []
    item = table.item(rows[0].row(), 0) if rows else None
    return item.data(Qt.ItemDataRole.UserRole) if item is not None else None
