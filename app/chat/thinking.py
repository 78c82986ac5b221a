"""A thinking model's reasoning above its answer: a "Thinking (12 s)" header that opens and
closes the text under it. The chat view opens it while the reasoning streams and closes it once
when the answer begins; a click on the header toggles it; a stored answer's shows closed.

The reasoning is plain text (the model's notes, not a document to format), appended as it
streams, so an update costs what it adds, never the whole reasoning again.

What this does not do: split reasoning from the answer (app/chat/reasoning.py) or time it (the
turn controller).
"""

from __future__ import annotations

from PySide6.QtCore import Qt, Signal
from PySide6.QtGui import QTextCursor
from PySide6.QtWidgets import QFrame, QToolButton, QVBoxLayout, QWidget

from app.chat.body import MessageBody
from app.state.export import thinking_title


class ThinkingBlock(QFrame):
    """The reasoning of one answer, open or closed.

    Signals:
        toggled(bool): the user opened (True) or closed it.
    """

    toggled = Signal(bool)

    def __init__(self, text: str = "", seconds: float | None = None, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setObjectName("thinking")
        layout = QVBoxLayout(self)
        layout.setContentsMargins(8, 2, 0, 4)
        layout.setSpacing(0)
        self.header = QToolButton(self)
        self.header.setObjectName("thinkingHeader")
        self.header.setToolButtonStyle(Qt.ToolButtonStyle.ToolButtonTextBesideIcon)
        self.header.setAutoRaise(True)
        self.header.setCursor(Qt.CursorShape.PointingHandCursor)
        self.header.clicked.connect(self._on_header_clicked)
        layout.addWidget(self.header, 0, Qt.AlignmentFlag.AlignLeft)
        self.body = MessageBody(self)
        self.body.setObjectName("thinkingBody")
        self.body.setAccessibleName("The model's reasoning")
        layout.addWidget(self.body)
        self._text = [text]
        self.body.setPlainText(text)
        self._seconds = seconds
        self.set_open(False)
        self.set_seconds(seconds)

    @property
    def text(self) -> str:
        if len(self._text) > 1:
            self._text = ["".join(self._text)]
        return self._text[0]

    @property
    def is_open(self) -> bool:
        return not self.body.isHidden()

    @property
    def title(self) -> str:
        return self.header.text()

    def append(self, delta: str) -> None:
        """More reasoning: added at the end of what is shown."""
        if not delta:
            return
        self._text.append(delta)
        cursor = QTextCursor(self.body.document())
        cursor.movePosition(QTextCursor.MoveOperation.End)
        cursor.insertText(delta)

    def set_seconds(self, seconds: float | None) -> None:
        """How long the model thought (None: it still does)."""
        self._seconds = seconds
        self.header.setText(thinking_title(seconds))
        self._describe()

    def set_open(self, open_: bool) -> None:
        self.body.setVisible(open_)
        self.header.setArrowType(Qt.ArrowType.DownArrow if open_ else Qt.ArrowType.RightArrow)
        self._describe()

    def toggle(self) -> None:
        self.set_open(not self.is_open)

    def _describe(self) -> None:
        action = "hide" if self.is_open else "show"
        self.header.setAccessibleName(f"{self.header.text()}: {action} the model's reasoning")
        self.header.setToolTip(f"Click to {action} what the model thought before answering")

    def _on_header_clicked(self) -> None:
        self.toggle()
        self.toggled.emit(self.is_open)
