"""The message box under the chat: Enter sends, Shift+Enter starts a new line; Send turns into
Stop while an answer is being written (Esc stops too, from the main window's shortcut). In edit
mode a bar above the box says that sending replaces the last exchange, with a way out."""

from __future__ import annotations

from PySide6.QtCore import Qt, Signal
from PySide6.QtGui import QKeyEvent
from PySide6.QtWidgets import (
    QFrame,
    QHBoxLayout,
    QLabel,
    QPlainTextEdit,
    QPushButton,
    QSizePolicy,
    QToolButton,
    QVBoxLayout,
    QWidget,
)

PLACEHOLDER = "Message — Enter sends, Shift+Enter adds a line"


class _Input(QPlainTextEdit):
    submitted = Signal()

    def keyPressEvent(self, event: QKeyEvent) -> None:  # noqa: N802
        enter = event.key() in (Qt.Key.Key_Return, Qt.Key.Key_Enter)
        if enter and not event.modifiers() & (Qt.KeyboardModifier.ShiftModifier | Qt.KeyboardModifier.AltModifier):
            self.submitted.emit()
            return
        super().keyPressEvent(event)


class Composer(QWidget):
    """Signals: send_requested(str) with the text (stripped, non-empty); stop_requested();
    edit_cancelled() (the edit bar's Cancel, or Esc while editing)."""

    send_requested = Signal(str)
    stop_requested = Signal()
    edit_cancelled = Signal()

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        column = QVBoxLayout(self)
        column.setContentsMargins(12, 6, 12, 10)
        column.setSpacing(4)
        self.edit_bar = QFrame()
        self.edit_bar.setObjectName("editBar")
        self.edit_bar.setAccessibleName("Editing the last message")
        bar = QHBoxLayout(self.edit_bar)
        bar.setContentsMargins(8, 3, 3, 3)
        self.edit_label = QLabel("Editing your last message: sending replaces it and the answer after it.")
        self.edit_label.setWordWrap(True)
        bar.addWidget(self.edit_label, 1)
        self.cancel_edit_button = QToolButton()
        self.cancel_edit_button.setText("Cancel edit")
        self.cancel_edit_button.setAccessibleName("Cancel the edit")
        self.cancel_edit_button.setToolTip("Keep the message as it was (Esc)")
        self.cancel_edit_button.clicked.connect(self.edit_cancelled)
        bar.addWidget(self.cancel_edit_button)
        self.edit_bar.hide()
        column.addWidget(self.edit_bar)
        layout = QHBoxLayout()
        column.addLayout(layout)
        self.input = _Input(self)
        self.input.setPlaceholderText(PLACEHOLDER)
        self.input.setAccessibleName("Message")
        self.input.setAccessibleDescription("Type a message. Enter sends it, Shift+Enter adds a new line.")
        self.input.setTabChangesFocus(True)
        self.input.setSizePolicy(QSizePolicy.Policy.Expanding, QSizePolicy.Policy.Fixed)
        self.input.setFixedHeight(self.input.fontMetrics().lineSpacing() * 3 + 16)
        self.input.submitted.connect(self._submit)
        layout.addWidget(self.input, 1)
        self.send_button = QPushButton("Send")
        self.send_button.setAccessibleName("Send message")
        self.send_button.setToolTip("Send (Enter)")
        self.send_button.setDefault(True)
        self.send_button.clicked.connect(self._submit)
        self.stop_button = QPushButton("Stop")
        self.stop_button.setAccessibleName("Stop the answer")
        self.stop_button.setToolTip("Stop the answer (Esc)")
        self.stop_button.clicked.connect(self.stop_requested)
        self.stop_button.hide()
        layout.addWidget(self.send_button)
        layout.addWidget(self.stop_button)
        self._busy = False
        self._can_send = True

    def _submit(self) -> None:
        text = self.input.toPlainText().strip()
        if not text or self._busy or not self._can_send:
            return
        self.input.clear()
        self.send_requested.emit(text)

    def set_busy(self, busy: bool) -> None:
        """While an answer streams: Stop instead of Send (typing the next message stays possible)."""
        self._busy = busy
        self.send_button.setVisible(not busy)
        self.stop_button.setVisible(busy)

    def set_can_send(self, can: bool, reason: str = "") -> None:
        """No model loaded yet: sending is off and the placeholder says why."""
        self._can_send = can
        self.send_button.setEnabled(can)
        self.input.setPlaceholderText(reason or PLACEHOLDER)
        # QPlainTextEdit repaints only when the placeholder appears or disappears, not when its
        # text changes while shown: without this the box kept saying "Loading the model…"
        self.input.viewport().update()

    def set_editing(self, editing: bool) -> None:
        self.edit_bar.setVisible(editing)
        self.send_button.setText("Send edit" if editing else "Send")

    @property
    def editing(self) -> bool:
        return not self.edit_bar.isHidden()

    def set_text(self, text: str) -> None:
        self.input.setPlainText(text)
        self.input.setFocus()
        cursor = self.input.textCursor()
        cursor.movePosition(cursor.MoveOperation.End)
        self.input.setTextCursor(cursor)
