"""The conversation as a column of message widgets, with streaming Markdown.

Each message is a `MessageWidget`: a role label, the body (a borderless QTextBrowser sized to
its content, Markdown rendered by app.chat.markdown) and actions (Copy; Edit on the last user
message; Regenerate on the last answer). While an answer streams, text arrives in small chunks;
the view renders what arrived at most every RENDER_INTERVAL_MS (longer when a render took long,
so rendering never takes more than about a quarter of the GUI thread), and only the message's
open piece (app.chat.chunking): the work per update does not grow with the answer. Before each
render it calls `before_render(text)`: the chat page saves the text there, so whatever the
window has shown is already in the database.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from PySide6.QtCore import QSize, Qt, QTimer, QUrl, Signal
from PySide6.QtGui import QGuiApplication, QResizeEvent
from PySide6.QtWidgets import (
    QFrame,
    QHBoxLayout,
    QLabel,
    QScrollArea,
    QSizePolicy,
    QTextBrowser,
    QToolButton,
    QVBoxLayout,
    QWidget,
)

from app.chat.chunking import Chunker, Piece
from app.chat.markdown import LIGHT, MarkdownPalette, code_blocks, render

RENDER_INTERVAL_MS = 50
RENDER_BUSY_FACTOR = 3  # the next render waits at least this many times the last one's duration


class _Body(QTextBrowser):
    """A QTextBrowser without scroll bars whose height follows its document."""

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setObjectName("messageBody")
        self.setOpenLinks(False)
        self.setOpenExternalLinks(False)
        self.setVerticalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        self.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        self.setFrameShape(QFrame.Shape.NoFrame)
        self.setSizePolicy(QSizePolicy.Policy.Expanding, QSizePolicy.Policy.Fixed)
        self.setTextInteractionFlags(Qt.TextInteractionFlag.TextBrowserInteraction)
        self.document().setDocumentMargin(2)
        self.document().contentsChanged.connect(self._fit)

    def _fit(self) -> None:
        doc = self.document()
        doc.setTextWidth(self.viewport().width())
        height = int(doc.size().height()) + 4
        if height != self.height():
            self.setFixedHeight(height)

    def resizeEvent(self, event: QResizeEvent) -> None:  # noqa: N802
        super().resizeEvent(event)
        self._fit()

    def sizeHint(self) -> QSize:  # noqa: N802
        return QSize(200, self.height())


class MessageWidget(QFrame):
    """One message. Signals: edit_clicked(), regenerate_clicked(), continue_clicked().

    `can_continue`: an answer cut by the token limit (the view offers Continue on the last one)."""

    edit_clicked = Signal()
    regenerate_clicked = Signal()
    continue_clicked = Signal()

    def __init__(self, role: str, text: str, palette: MarkdownPalette, complete: bool = True,
                 parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.role = role
        self._parts = [text]
        self.complete = complete
        self.can_continue = False
        self._palette = palette
        self.setObjectName("message")
        self.setProperty("role", role)
        who = "You" if role == "user" else "Assistant"
        self.setAccessibleName(f"{who} message")
        layout = QVBoxLayout(self)
        layout.setContentsMargins(12, 8, 12, 6)
        layout.setSpacing(2)
        header = QHBoxLayout()
        self.role_label = QLabel(who)
        self.role_label.setObjectName("messageRole")
        header.addWidget(self.role_label)
        self.note = QLabel("")
        self.note.setObjectName("messageNote")
        header.addWidget(self.note)
        header.addStretch(1)
        layout.addLayout(header)
        # The text is rendered in pieces (app.chat.chunking), one borderless browser each, so a
        # streaming answer re-renders and re-lays out only its last piece.
        # in an answer that has no text yet: what it waits for (set_placeholder)
        self.placeholder = QLabel("")
        self.placeholder.setObjectName("messageNote")
        self.placeholder.setAccessibleName("Waiting")
        self.placeholder.setWordWrap(True)
        font = self.placeholder.font()
        font.setItalic(True)
        self.placeholder.setFont(font)
        self.placeholder.hide()
        layout.addWidget(self.placeholder)
        self._bodies_layout = QVBoxLayout()
        self._bodies_layout.setSpacing(0)
        layout.addLayout(self._bodies_layout)
        self.bodies: list[_Body] = []
        self._pieces: list[Piece] = []
        self._chunker = Chunker()
        self.render_count = 0  # Markdown renders, and the characters they read (tests count them)
        self.rendered_chars = 0
        actions = QHBoxLayout()
        actions.setSpacing(4)
        self.copy_button = self._action("Copy", "Copy this message as Markdown", self._copy)
        self.edit_button = self._action("Edit", "Edit this message and send it again", self.edit_clicked.emit)
        self.regenerate_button = self._action("Regenerate", "Write this answer again", self.regenerate_clicked.emit)
        self.continue_button = self._action("Continue", "Write on from where the token limit cut this answer",
                                            self.continue_clicked.emit)
        for button in (self.copy_button, self.edit_button, self.regenerate_button, self.continue_button):
            actions.addWidget(button)
        actions.addStretch(1)
        layout.addLayout(actions)
        self.edit_button.hide()
        self.regenerate_button.hide()
        self.continue_button.hide()
        self.set_text(text, complete)

    def _action(self, text: str, tip: str, slot: Callable[[], None]) -> QToolButton:
        button = QToolButton(self)
        button.setObjectName("messageAction")
        button.setText(text)
        button.setToolTip(tip)
        button.setAccessibleName(f"{text} message" if text == "Copy" else text)
        button.setCursor(Qt.CursorShape.PointingHandCursor)
        button.clicked.connect(slot)
        return button

    @property
    def body(self) -> _Body:
        """The first body (the whole text for short messages)."""
        return self.bodies[0]

    def _new_body(self) -> _Body:
        body = _Body(self)
        who = "You" if self.role == "user" else "Assistant"
        body.setAccessibleName(f"{who} message text")
        index = len(self.bodies)
        body.anchorClicked.connect(lambda url, i=index: self._on_body_anchor_clicked(i, url))
        self._bodies_layout.addWidget(body)
        self.bodies.append(body)
        return body

    @property
    def text(self) -> str:
        if len(self._parts) > 1:
            self._parts = ["".join(self._parts)]
        return self._parts[0]

    def set_text(self, text: str, complete: bool | None = None, force: bool = False) -> None:
        """Show `text` (cut into pieces afresh); pieces that did not change keep their rendering."""
        self._parts = [text]
        if complete is not None:
            self.complete = complete
        self._chunker = Chunker()
        if self.role == "user":
            pieces = [Piece(text)]
        else:
            self._chunker.feed(text)
            pieces = self._chunker.pieces()
        self._show(pieces, 0 if force else self._same_prefix(pieces))

    def append(self, delta: str) -> None:
        """Add streamed text: renders the pieces it closed and the open one, nothing before."""
        if delta:
            self.set_placeholder("")
        self._parts.append(delta)
        first = len(self._chunker.closed)
        self._chunker.feed(delta)
        self._show(self._chunker.pieces(), first)

    def _same_prefix(self, pieces: list[Piece]) -> int:
        same = 0
        while same < min(len(pieces), len(self._pieces)) and pieces[same] == self._pieces[same]:
            same += 1
        return same

    def _show(self, pieces: list[Piece], first: int) -> None:
        """Render pieces[first:] (the earlier ones are shown already) and drop extra bodies."""
        for i in range(first, len(pieces)):
            piece = pieces[i]
            body = self.bodies[i] if i < len(self.bodies) else self._new_body()
            if self.role == "user":
                body.setPlainText(piece.text)
            else:
                source = piece.markdown()
                self.render_count += 1
                self.rendered_chars += len(source)
                body.setHtml(render(source, self._palette, bool(piece.reopen), bool(piece.close)) if source else "")
        for body in self.bodies[len(pieces):]:
            body.setParent(None)
            body.deleteLater()
        del self.bodies[len(pieces):]
        self._pieces = pieces

    def set_note(self, note: str) -> None:
        self.note.setText(note)

    def set_placeholder(self, text: str) -> None:
        """Say in the message what an answer without text waits for ("" : nothing); its first
        text takes the place."""
        self.placeholder.setText(text)
        self.placeholder.setVisible(bool(text) and not self.text)

    def set_palette(self, palette: MarkdownPalette) -> None:
        self._palette = palette
        self.set_text(self.text, force=True)

    def _code_block(self, piece: int, index: int) -> str | None:
        """Code block `index` of piece `piece`, joined with its continuations in later pieces."""
        if not 0 <= piece < len(self._pieces):
            return None
        blocks = code_blocks(self._pieces[piece].markdown())
        if not 0 <= index < len(blocks):
            return None
        code = blocks[index]
        while index == len(blocks) - 1 and self._pieces[piece].close and piece + 1 < len(self._pieces):
            piece, index = piece + 1, 0
            blocks = code_blocks(self._pieces[piece].markdown())
            if not blocks:
                break
            code += blocks[0]
        return code

    def _copy(self) -> None:
        QGuiApplication.clipboard().setText(self.text)

    def _on_body_anchor_clicked(self, chunk: int, url: QUrl) -> None:
        if url.scheme() == "copy":
            code = self._code_block(chunk, int(url.path() or -1))
            if code is not None:
                QGuiApplication.clipboard().setText(code)
        elif url.scheme() in ("http", "https"):
            from PySide6.QtGui import QDesktopServices

            QDesktopServices.openUrl(url)


class ChatView(QScrollArea):
    """The messages of one conversation.

    Signals:
        edit_requested(): Edit on the last user message.
        regenerate_requested(): Regenerate on the last answer.
        continue_requested(): Continue on the last answer (cut by the token limit).
        rendered(str): the streaming answer's text just shown (after `before_render`).
    """

    edit_requested = Signal()
    regenerate_requested = Signal()
    continue_requested = Signal()
    rendered = Signal(str)

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setAccessibleName("Conversation")
        self.setWidgetResizable(True)
        self.setFrameShape(QFrame.Shape.NoFrame)
        self.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        self._inner = QWidget()
        self._inner.setObjectName("chatColumn")
        self._layout = QVBoxLayout(self._inner)
        self._layout.setContentsMargins(16, 12, 16, 12)
        self._layout.setSpacing(10)
        self._layout.addStretch(1)
        self.setWidget(self._inner)
        self._messages: list[MessageWidget] = []
        self._palette = LIGHT
        self._streaming: MessageWidget | None = None
        self._stream_text = ""
        self._pending = ""  # arrived since the last render
        self._busy = False
        self._timer = QTimer(self)
        self._timer.setSingleShot(True)
        self._timer.setInterval(RENDER_INTERVAL_MS)
        self._timer.timeout.connect(self.flush)
        self.before_render: Callable[[str], None] | None = None
        self._stick_to_bottom = True
        self.verticalScrollBar().rangeChanged.connect(self._on_range_changed)
        self.verticalScrollBar().valueChanged.connect(self._on_scrolled)
        # PySide6 builds ~80 Python enum classes on the first viewport() of a text browser
        # (~0.1 s): pay that now, not when the first answer starts streaming.
        warm = _Body(self._inner)
        warm.setPlainText(" ")
        warm.setParent(None)
        warm.deleteLater()

    # ---- content -------------------------------------------------------------------------
    @property
    def messages(self) -> list[MessageWidget]:
        return list(self._messages)

    def clear(self) -> None:
        self._timer.stop()
        self._streaming = None
        for widget in self._messages:
            widget.setParent(None)
            widget.deleteLater()
        self._messages.clear()
        self._stick_to_bottom = True

    def add_message(self, role: str, text: str, complete: bool = True) -> MessageWidget:
        widget = MessageWidget(role, text, self._palette, complete, self._inner)
        widget.edit_clicked.connect(self.edit_requested)
        widget.regenerate_clicked.connect(self.regenerate_requested)
        widget.continue_clicked.connect(self.continue_requested)
        if role == "user":
            widget.setSizePolicy(QSizePolicy.Policy.Preferred, QSizePolicy.Policy.Maximum)
        self._layout.insertWidget(self._layout.count() - 1, widget)
        self._messages.append(widget)
        if not complete and role == "assistant":
            widget.set_note("stopped")
        self._update_actions()
        return widget

    def remove_from(self, index: int) -> None:
        """Drop message `index` and every later one."""
        for widget in self._messages[index:]:
            widget.setParent(None)
            widget.deleteLater()
        del self._messages[index:]
        self._update_actions()

    def set_palette(self, palette: MarkdownPalette) -> None:
        self._palette = palette
        for widget in self._messages:
            widget.set_palette(palette)

    def set_editing(self, index: int | None) -> None:
        """Mark the message at `index` as the one being edited (None: none)."""
        for i, m in enumerate(self._messages):
            if i == index:
                m.set_note("editing")
            elif m.note.text() == "editing":
                m.set_note("")

    def set_busy(self, busy: bool) -> None:
        self._busy = busy
        self._update_actions()

    def _update_actions(self) -> None:
        busy = self._busy
        last_user = max((i for i, m in enumerate(self._messages) if m.role == "user"), default=-1)
        last = len(self._messages) - 1
        for i, m in enumerate(self._messages):
            m.edit_button.setVisible(i == last_user and not busy)
            m.regenerate_button.setVisible(i == last and m.role == "assistant" and not busy)
            m.continue_button.setVisible(i == last and m.can_continue and not busy)

    # ---- streaming -----------------------------------------------------------------------
    def begin_answer(self, text: str = "") -> MessageWidget:
        """A new answer at the bottom that streams (`text`: what it holds already)."""
        return self.resume_answer(self.add_message("assistant", text))

    def resume_answer(self, widget: MessageWidget) -> MessageWidget:
        """Stream into `widget` (the last answer: Continue), after the text it shows."""
        widget.set_note("writing…")
        widget.can_continue = False
        self._streaming = widget
        self._stream_text = widget.text
        self._pending = ""
        self._stick_to_bottom = True
        self._update_actions()
        return widget

    def set_waiting(self, text: str) -> None:
        """What the streaming answer waits for, in its bubble while it has no text ("": nothing)."""
        if self._streaming is not None:
            self._streaming.set_placeholder(text if not self._stream_text else "")

    def detach_answer(self) -> None:
        """Stop streaming into the view (the answer goes on elsewhere); text not yet rendered is
        dropped here, its owner keeps it."""
        self._timer.stop()
        self._streaming = None
        self._pending = ""

    def append_answer(self, chunk: str) -> None:
        self._stream_text += chunk
        self._pending += chunk
        if not self._timer.isActive():
            self._timer.start()

    @property
    def answer_text(self) -> str:
        return self._stream_text

    def flush(self) -> None:
        """Render the streaming answer now (the timer calls this every RENDER_INTERVAL_MS)."""
        self._timer.stop()
        widget = self._streaming
        if widget is None or not self._pending:
            return
        started = time.perf_counter()
        text, delta = self._stream_text, self._pending
        self._pending = ""
        if self.before_render is not None:
            self.before_render(text)
        widget.append(delta)
        self.rendered.emit(text)
        spent_ms = (time.perf_counter() - started) * 1000
        self._timer.setInterval(max(RENDER_INTERVAL_MS, int(RENDER_BUSY_FACTOR * spent_ms)))

    def end_answer(self, note: str = "", complete: bool = True, can_continue: bool = False) -> None:
        self.flush()
        if self._streaming is not None:
            self._streaming.set_placeholder("")
            self._streaming.complete = complete
            self._streaming.can_continue = can_continue
            self._streaming.set_note(note)
        self._streaming = None
        self._update_actions()

    # ---- scrolling -------------------------------------------------------------------------
    def _on_scrolled(self, value: int) -> None:
        bar = self.verticalScrollBar()
        self._stick_to_bottom = value >= bar.maximum() - 24

    def _on_range_changed(self, _min: int, maximum: int) -> None:
        if self._stick_to_bottom:
            self.verticalScrollBar().setValue(maximum)

    def scroll_to_bottom(self) -> None:
        self._stick_to_bottom = True
        self.verticalScrollBar().setValue(self.verticalScrollBar().maximum())

    def resizeEvent(self, event: QResizeEvent) -> None:  # noqa: N802
        super().resizeEvent(event)
        if self._stick_to_bottom:
            QTimer.singleShot(0, self.scroll_to_bottom)
