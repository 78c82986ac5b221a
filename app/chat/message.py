"""One message of the chat view: a role label, a reasoning model's Thinking block
(app/chat/thinking.py), the text rendered as Markdown in pieces (app/chat/chunking.py, one
borderless browser each, so a streaming answer re-renders only its last piece) and actions (Copy;
Edit on the last user message; Regenerate and Continue on the last answer, which the view shows).
"""

from __future__ import annotations

from collections.abc import Callable

from PySide6.QtCore import Qt, QUrl, Signal
from PySide6.QtGui import QGuiApplication
from PySide6.QtWidgets import QFrame, QHBoxLayout, QLabel, QToolButton, QVBoxLayout, QWidget

from app.chat.body import MessageBody
from app.chat.chunking import Chunker, Piece
from app.chat.markdown import MarkdownPalette, code_blocks, render
from app.chat.thinking import ThinkingBlock


class MessageWidget(QFrame):
    """One message. Signals: edit_clicked(), regenerate_clicked(), continue_clicked().

    `can_continue`: an answer cut by the token limit (the view offers Continue on the last one);
    `thinking`: the Thinking block of an answer with reasoning (None without)."""

    edit_clicked = Signal()
    regenerate_clicked = Signal()
    continue_clicked = Signal()

    def __init__(self, role: str, text: str, palette: MarkdownPalette, complete: bool = True,
                 parent: QWidget | None = None, reasoning: str = "", reasoning_seconds: float | None = None) -> None:
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
        self.thinking: ThinkingBlock | None = None
        self._auto_close = False  # the block opened as the reasoning streamed: the answer's start closes it
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
        self.bodies: list[MessageBody] = []
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
        if reasoning:  # closed above an answer; open when it is all there is
            self._add_thinking(reasoning, reasoning_seconds).set_open(not text)
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
    def body(self) -> MessageBody:
        """The first body (the whole text for short messages)."""
        return self.bodies[0]

    def _new_body(self) -> MessageBody:
        body = MessageBody(self)
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

    @property
    def reasoning(self) -> str:
        return self.thinking.text if self.thinking is not None else ""

    def _add_thinking(self, text: str = "", seconds: float | None = None) -> ThinkingBlock:
        block = ThinkingBlock(text, seconds, self)
        layout = self.layout()
        assert isinstance(layout, QVBoxLayout)
        layout.insertWidget(1, block)  # under the role label, above the answer
        self.thinking = block
        self._hide_empty_body()
        return block

    def append_reasoning(self, delta: str) -> None:
        """Streamed reasoning: the Thinking block shows it, open until the answer begins."""
        if not delta:
            return
        if self.thinking is None:
            self._add_thinking()
            self.open_thinking()
        self.set_placeholder("")
        assert self.thinking is not None
        self.thinking.append(delta)

    def open_thinking(self) -> None:
        """Show the reasoning while it streams; the answer's first text closes it."""
        if self.thinking is not None:
            self.thinking.set_open(True)
            self._auto_close = True

    def set_thinking(self, seconds: float | None) -> None:
        """How long the model thought (None: it still does)."""
        if self.thinking is not None:
            self.thinking.set_seconds(seconds)

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
            if self._auto_close and self.thinking is not None:
                self._auto_close = False
                self.thinking.set_open(False)  # the answer began: the reasoning folds away
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
        self._hide_empty_body()

    def _hide_empty_body(self) -> None:
        """Under a Thinking block, an answer without text yet shows no empty body."""
        if self.bodies:
            self.bodies[0].setVisible(self.thinking is None or bool(self._pieces and self._pieces[0].text))

    def set_note(self, note: str) -> None:
        self.note.setText(note)

    def set_placeholder(self, text: str) -> None:
        """Say in the message what an answer without text waits for ("" : nothing); its first
        text takes the place."""
        self.placeholder.setText(text)
        self.placeholder.setVisible(bool(text) and not self.text and not self.reasoning)

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
