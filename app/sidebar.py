"""The conversation list: new, search (titles and message text), rename, delete, export to
Markdown or JSON. It reads and writes the ConversationStore itself and tells the chat page
which conversation to show."""

from __future__ import annotations

import json
from pathlib import Path

from PySide6.QtCore import QPoint, Qt, QTimer, Signal
from PySide6.QtWidgets import (
    QFileDialog,
    QHBoxLayout,
    QInputDialog,
    QLineEdit,
    QListWidget,
    QListWidgetItem,
    QMenu,
    QMessageBox,
    QPushButton,
    QToolButton,
    QVBoxLayout,
    QWidget,
)

from .conversations import ConversationStore


class Sidebar(QWidget):
    """Signals: conversation_selected(int) (0 = none left); new_requested()."""

    conversation_selected = Signal(int)
    new_requested = Signal()

    def __init__(self, store: ConversationStore, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.store = store
        layout = QVBoxLayout(self)
        layout.setContentsMargins(8, 8, 4, 8)
        self.new_button = QPushButton("New chat")
        self.new_button.setAccessibleName("New chat")
        self.new_button.setToolTip("Start a new conversation (Ctrl+N)")
        self.new_button.clicked.connect(self.new_requested)
        layout.addWidget(self.new_button)
        self.search = QLineEdit()
        self.search.setPlaceholderText("Search conversations (Ctrl+F)")
        self.search.setAccessibleName("Search conversations")
        self.search.setClearButtonEnabled(True)
        self._search_timer = QTimer(self)
        self._search_timer.setSingleShot(True)
        self._search_timer.setInterval(150)
        self._search_timer.timeout.connect(self.refresh)
        self.search.textChanged.connect(lambda _text: self._search_timer.start())
        layout.addWidget(self.search)
        self.list = QListWidget()
        self.list.setAccessibleName("Conversations")
        self.list.setObjectName("conversationList")
        self.list.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        self.list.setTextElideMode(Qt.TextElideMode.ElideRight)
        self.list.setUniformItemSizes(True)
        self.list.setContextMenuPolicy(Qt.ContextMenuPolicy.CustomContextMenu)
        self.list.customContextMenuRequested.connect(self._on_list_context_menu)
        self.list.currentItemChanged.connect(self._on_list_current_changed)
        layout.addWidget(self.list, 1)
        row = QHBoxLayout()
        self.rename_button = self._tool("Rename", "Rename the selected conversation", self.rename_current)
        self.delete_button = self._tool("Delete", "Delete the selected conversation", self.delete_current)
        self.export_button = self._tool("Export", "Export the selected conversation", None)
        menu = QMenu(self.export_button)
        menu.addAction("As Markdown…", lambda: self.export_current("md"))
        menu.addAction("As JSON…", lambda: self.export_current("json"))
        self.export_button.setMenu(menu)
        self.export_button.setPopupMode(QToolButton.ToolButtonPopupMode.InstantPopup)
        for button in (self.rename_button, self.delete_button, self.export_button):
            row.addWidget(button)
        row.addStretch(1)
        layout.addLayout(row)
        self._quiet = False

    def _tool(self, text: str, tip: str, slot) -> QToolButton:  # type: ignore[no-untyped-def]
        button = QToolButton(self)
        button.setText(text)
        button.setToolTip(tip)
        button.setAccessibleName(tip)
        if slot is not None:
            button.clicked.connect(slot)
        return button

    # ---- list ----------------------------------------------------------------------------
    def refresh(self, select: int | None = None) -> None:
        """Reload the list (keeping or setting the selection) without emitting a selection."""
        current = self.current_id() if select is None else select
        self._quiet = True
        try:
            self.list.clear()
            for conv in self.store.conversations(self.search.text()):
                item = QListWidgetItem(conv.title)
                item.setData(Qt.ItemDataRole.UserRole, conv.id)
                item.setToolTip(conv.title)
                self.list.addItem(item)
                if conv.id == current:
                    self.list.setCurrentItem(item)
        finally:
            self._quiet = False

    def current_id(self) -> int:
        item = self.list.currentItem()
        return int(item.data(Qt.ItemDataRole.UserRole)) if item is not None else 0

    def select(self, conversation_id: int) -> None:
        self.refresh(select=conversation_id)

    def _on_list_current_changed(self, current: QListWidgetItem | None, _previous: object) -> None:
        if not self._quiet and current is not None:
            self.conversation_selected.emit(int(current.data(Qt.ItemDataRole.UserRole)))

    def _on_list_context_menu(self, pos: QPoint) -> None:
        if self.list.itemAt(pos) is None:
            return
        menu = QMenu(self)
        menu.addAction("Rename…", self.rename_current)
        menu.addAction("Export as Markdown…", lambda: self.export_current("md"))
        menu.addAction("Export as JSON…", lambda: self.export_current("json"))
        menu.addSeparator()
        menu.addAction("Delete", self.delete_current)
        menu.exec(self.list.mapToGlobal(pos))

    # ---- actions -------------------------------------------------------------------------
    def rename_current(self) -> None:
        conv = self.store.get(self.current_id())
        if conv is None:
            return
        title, ok = QInputDialog.getText(self, "Rename conversation", "Title:", text=conv.title)
        if ok and title.strip():
            self.store.rename(conv.id, title)
            self.refresh()

    def delete_current(self) -> None:
        conv = self.store.get(self.current_id())
        if conv is None:
            return
        answer = QMessageBox.question(self, "Delete conversation", f"Delete “{conv.title}” and all its messages?")
        if answer != QMessageBox.StandardButton.Yes:
            return
        row = self.list.currentRow()
        self.store.delete(conv.id)
        self.refresh(select=0)
        if self.list.count():
            self.list.setCurrentRow(min(row, self.list.count() - 1))
        else:
            self.conversation_selected.emit(0)

    def export_current(self, kind: str) -> None:
        conv = self.store.get(self.current_id())
        if conv is None:
            return
        suffix = "md" if kind == "md" else "json"
        safe = "".join(c if c.isalnum() or c in " -_" else "_" for c in conv.title).strip() or "conversation"
        path, _ = QFileDialog.getSaveFileName(self, "Export conversation", str(Path.home() / f"{safe}.{suffix}"),
                                              "Markdown (*.md)" if kind == "md" else "JSON (*.json)")
        if path:
            export_conversation(self.store, conv.id, Path(path), kind)


def export_conversation(store: ConversationStore, conversation_id: int, path: Path, kind: str) -> None:
    """Write one conversation to `path` as Markdown ("md") or JSON ("json")."""
    if kind == "md":
        path.write_text(store.export_markdown(conversation_id), encoding="utf-8")
    else:
        path.write_text(json.dumps(store.export_json(conversation_id), ensure_ascii=False, indent=2), encoding="utf-8")
