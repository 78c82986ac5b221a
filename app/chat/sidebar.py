"""The conversation list: new, search (titles and message text), rename, delete, export to
Markdown or JSON. It reads and writes the ConversationStore itself and tells the chat page
which conversation to show. An export leaves a thinking model's reasoning out unless the
export menu's "Include the model's reasoning" is ticked (for this session).

Conversations are grouped under date headings (Today, Yesterday, Previous 7 days, Previous 30
days, then by month), as ChatGPT, LM Studio and Jan list them; each tooltip has the exact time.
The one being answered carries a "✎" mark before its title (a long title is cut at its end, so the
mark stays in sight) and says so in its tooltip. A click is handed on after the list has
finished its own handling of it, so the list is never rebuilt under the click (which used to
leave the highlight on the wrong row).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from datetime import date, datetime, timedelta
from pathlib import Path

from PySide6.QtCore import QPoint, Qt, QTimer, Signal
from PySide6.QtGui import QAction, QFont
from PySide6.QtWidgets import (
    QHBoxLayout,
    QLineEdit,
    QListWidget,
    QListWidgetItem,
    QMenu,
    QPushButton,
    QToolButton,
    QVBoxLayout,
    QWidget,
)

from app.state.conversations import ConversationStore, export_file_name
from app.state.export import export_json, export_markdown
from app.widgets.dialogs import Dialogs

WRITING = "✎ "  # before the title: a long title is elided at its end, never the mark
WRITING_TIP = "An answer is being written in this conversation."


def date_group(when: float, today: date | None = None) -> str:
    """The heading a conversation last active at `when` (epoch seconds) is listed under."""
    day = datetime.fromtimestamp(when).date()
    today = today or date.today()
    if day >= today:
        return "Today"
    if day == today - timedelta(days=1):
        return "Yesterday"
    if day > today - timedelta(days=7):
        return "Previous 7 days"
    if day > today - timedelta(days=30):
        return "Previous 30 days"
    return day.strftime("%B %Y")


class Sidebar(QWidget):
    """Signals: conversation_selected(int) (0 = none left); conversation_deleted(int);
    new_requested(); exported(str) (the file written)."""

    conversation_selected = Signal(int)
    conversation_deleted = Signal(int)
    new_requested = Signal()
    exported = Signal(str)

    def __init__(self, store: ConversationStore, parent: QWidget | None = None, dialogs: Dialogs | None = None) -> None:
        super().__init__(parent)
        self.store = store
        self.dialogs = dialogs or Dialogs.over(self)
        self._writing = 0
        layout = QVBoxLayout(self)
        layout.setContentsMargins(8, 8, 4, 8)
        self.new_button = QPushButton("New chat")
        self.new_button.setAccessibleName("New chat")
        self.new_button.setToolTip("Start a new conversation (Ctrl+N)")
        self.new_button.clicked.connect(self.new_requested)
        layout.addWidget(self.new_button)
        self.search = QLineEdit()
        self.search.setPlaceholderText("Search (Ctrl+F)")
        self.search.setToolTip("Search the titles and messages of every conversation (Ctrl+F)")
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
        self.list.setContextMenuPolicy(Qt.ContextMenuPolicy.CustomContextMenu)
        self.list.customContextMenuRequested.connect(self._on_list_context_menu)
        self.list.currentItemChanged.connect(self._on_list_current_changed)
        layout.addWidget(self.list, 1)
        row = QHBoxLayout()
        row.setSpacing(2)
        self.rename_button = self._tool("Rename", "Rename the selected conversation", self.rename_current)
        self.delete_button = self._tool("Delete", "Delete the selected conversation", self.delete_current)
        self.export_button = self._tool("Export", "Export the selected conversation", None)
        self.include_reasoning = QAction("Include the model's reasoning", self)
        self.include_reasoning.setCheckable(True)
        self.include_reasoning.setToolTip("Exports leave a thinking model's reasoning out unless this is ticked")
        menu = QMenu(self.export_button)
        menu.addAction("As Markdown…", lambda: self.export_current("md"))
        menu.addAction("As JSON…", lambda: self.export_current("json"))
        menu.addSeparator()
        menu.addAction(self.include_reasoning)
        self.export_button.setMenu(menu)
        self.export_button.setPopupMode(QToolButton.ToolButtonPopupMode.InstantPopup)
        for button in (self.rename_button, self.delete_button, self.export_button):
            row.addWidget(button)
        row.addStretch(1)
        layout.addLayout(row)
        margins = layout.contentsMargins()
        # never narrower than its buttons: below that they elided to "R…e D…e" (the list elides instead)
        self.setMinimumWidth(max(150, row.sizeHint().width() + margins.left() + margins.right()))
        self._quiet = False

    def _tool(self, text: str, tip: str, slot: Callable[[], None] | None) -> QToolButton:
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
            heading = ""
            for conv in self.store.conversations(self.search.text()):
                group = date_group(conv.updated)
                if group != heading:
                    heading = group
                    self.list.addItem(self._heading(group))
                writing = conv.id == self._writing
                item = QListWidgetItem(WRITING + conv.title if writing else conv.title)
                item.setData(Qt.ItemDataRole.UserRole, conv.id)
                when = time.strftime('%d %b %Y, %H:%M', time.localtime(conv.updated))
                item.setToolTip(f"{conv.title}\nlast message {when}" + (f"\n{WRITING_TIP}" if writing else ""))
                if writing:
                    item.setData(Qt.ItemDataRole.AccessibleTextRole, f"{conv.title}, {WRITING_TIP}")
                self.list.addItem(item)
                if conv.id == current:
                    self.list.setCurrentItem(item)
            if not current:
                self.list.setCurrentRow(-1)  # no conversation is current
        finally:
            self._quiet = False

    def _heading(self, text: str) -> QListWidgetItem:
        item = QListWidgetItem(text)
        item.setFlags(Qt.ItemFlag.NoItemFlags)  # not selectable: arrows and clicks pass it by
        font = QFont(self.list.font())
        font.setBold(True)
        font.setPointSizeF(max(6.0, font.pointSizeF() * 0.85))
        item.setFont(font)
        item.setData(Qt.ItemDataRole.AccessibleTextRole, f"{text}:")
        return item

    def conversation_items(self) -> list[QListWidgetItem]:
        """The conversation rows (headings left out)."""
        items = (self.list.item(i) for i in range(self.list.count()))
        return [item for item in items if item.data(Qt.ItemDataRole.UserRole) is not None]

    def current_id(self) -> int:
        item = self.list.currentItem()
        value = item.data(Qt.ItemDataRole.UserRole) if item is not None else None
        return int(value) if value is not None else 0

    def select(self, conversation_id: int) -> None:
        """Highlight `conversation_id` (0: none) without emitting; rebuilds only if it is not listed."""
        if conversation_id == self.current_id() and (conversation_id or self.list.currentItem() is None):
            return
        match = next((i for i in self.conversation_items() if i.data(Qt.ItemDataRole.UserRole) == conversation_id), None)
        if match is None and conversation_id:
            self.refresh(select=conversation_id)
            return
        self._quiet = True
        try:
            if match is None:
                self.list.setCurrentRow(-1)
            else:
                self.list.setCurrentItem(match)
        finally:
            self._quiet = False

    def set_writing(self, conversation_id: int) -> None:
        """Mark the conversation an answer is being written in (0: none)."""
        self._writing = conversation_id
        self.refresh()

    def _on_list_current_changed(self, current: QListWidgetItem | None, _previous: object) -> None:
        if self._quiet or current is None:
            return
        chosen = current.data(Qt.ItemDataRole.UserRole)
        if chosen is not None:  # after the list is done with the click: the page may rebuild it
            QTimer.singleShot(0, lambda: self.conversation_selected.emit(int(chosen)))

    def _on_list_context_menu(self, pos: QPoint) -> None:
        item = self.list.itemAt(pos)
        if item is None or item.data(Qt.ItemDataRole.UserRole) is None:
            return
        menu = QMenu(self)
        menu.addAction("Rename…", self.rename_current)
        menu.addAction("Export as Markdown…", lambda: self.export_current("md"))
        menu.addAction("Export as JSON…", lambda: self.export_current("json"))
        menu.addAction(self.include_reasoning)
        menu.addSeparator()
        menu.addAction("Delete", self.delete_current)
        menu.exec(self.list.mapToGlobal(pos))

    # ---- actions -------------------------------------------------------------------------
    def rename_current(self) -> None:
        conv = self.store.get(self.current_id())
        if conv is None:
            return
        title = self.dialogs.ask_text("Rename conversation", "Title:", conv.title)
        if title is not None and title.strip():
            self.rename(conv.id, title)

    def rename(self, conversation_id: int, title: str) -> None:
        self.store.rename(conversation_id, title)
        self.refresh()

    def delete_current(self) -> None:
        conv = self.store.get(self.current_id())
        if conv is None:
            return
        if not self.dialogs.confirm("Delete conversation", f"Delete “{conv.title}” and all its messages?"):
            return
        items = self.conversation_items()
        row = next((n for n, i in enumerate(items) if i.data(Qt.ItemDataRole.UserRole) == conv.id), 0)
        self.store.delete(conv.id)
        self.conversation_deleted.emit(conv.id)
        self.refresh(select=0)
        items = self.conversation_items()
        if items:
            self.list.setCurrentItem(items[min(row, len(items) - 1)])  # -> conversation_selected
        else:
            self.conversation_selected.emit(0)

    def export_current(self, kind: str) -> None:
        conv = self.store.get(self.current_id())
        if conv is None:
            return
        suffix = "md" if kind == "md" else "json"
        name = export_file_name(conv.title, suffix)
        path = self.dialogs.ask_save_path("Export conversation", Path.home() / name,
                                          "Markdown (*.md)" if kind == "md" else "JSON (*.json)")
        if path is not None:
            export_conversation(self.store, conv.id, path, kind, reasoning=self.include_reasoning.isChecked())
            self.exported.emit(str(path))


def export_conversation(store: ConversationStore, conversation_id: int, path: Path, kind: str,
                        reasoning: bool = False) -> None:
    """Write one conversation to `path` as Markdown ("md") or JSON ("json"); a thinking model's
    reasoning only with `reasoning`."""
    if kind == "md":
        path.write_text(export_markdown(store, conversation_id, reasoning), encoding="utf-8")
    else:
        path.write_text(json.dumps(export_json(store, conversation_id, reasoning), ensure_ascii=False, indent=2),
                        encoding="utf-8")
