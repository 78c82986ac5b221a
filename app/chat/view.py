"""The conversation as a column of message widgets, with streaming Markdown.

Each message is a `MessageWidget` (app/chat/message.py): a role label, a thinking model's
reasoning in a Thinking block (open while the reasoning streams, closed once the answer begins),
the body (borderless QTextBrowsers sized to their content, Markdown rendered by
app.chat.markdown) and actions. While an answer streams, text arrives in small chunks (already
split into reasoning and answer by the turn controller); the view renders what arrived at most
every RENDER_INTERVAL_MS (longer when a render took long, so rendering never takes more than
about a quarter of the GUI thread), and only the message's open piece (app.chat.chunking): the
work per update does not grow with the answer. Before each render it calls `before_render(text)`
with the answer's text: the chat page saves the text (and the reasoning, at least what is shown)
there, so whatever the window has shown is already in the database.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from PySide6.QtCore import Qt, QTimer, Signal
from PySide6.QtGui import QResizeEvent
from PySide6.QtWidgets import QFrame, QScrollArea, QSizePolicy, QVBoxLayout, QWidget

from app.chat.body import MessageBody
from app.chat.markdown import LIGHT, MarkdownPalette
from app.chat.message import MessageWidget
from app.chat.turn import Ending, Progress

__all__ = ("ChatView", "MessageWidget")

RENDER_INTERVAL_MS = 50
RENDER_BUSY_FACTOR = 3  # the next render waits at least this many times the last one's duration


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
        self._pending_reasoning = ""
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
        warm = MessageBody(self._inner)
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

    def add_message(self, role: str, text: str, complete: bool = True, reasoning: str = "",
                    reasoning_seconds: float | None = None) -> MessageWidget:
        """A message at the bottom; `reasoning` (an answer's): in a closed Thinking block above it."""
        widget = MessageWidget(role, text, self._palette, complete, self._inner, reasoning, reasoning_seconds)
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
    def begin_answer(self, text: str = "", reasoning: str = "", thinking: float | None = None) -> MessageWidget:
        """A new answer at the bottom that streams (`text`, `reasoning`: what it holds already;
        `thinking`: how long it thought, None while it still does)."""
        widget = self.add_message("assistant", text, reasoning=reasoning, reasoning_seconds=thinking)
        if not text:  # still thinking: the reasoning streams on, open
            widget.open_thinking()
        return self.resume_answer(widget)

    def resume_answer(self, widget: MessageWidget) -> MessageWidget:
        """Stream into `widget` (the last answer: Continue), after the text it shows."""
        widget.set_note("writing…")
        widget.can_continue = False
        self._streaming = widget
        self._stream_text = widget.text
        self._pending = ""
        self._pending_reasoning = ""
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
        self._pending_reasoning = ""

    def append_answer(self, chunk: str) -> None:
        self._stream_text += chunk
        self._pending += chunk
        if not self._timer.isActive():
            self._timer.start()

    def append_reasoning(self, chunk: str) -> None:
        """Reasoning of the streaming answer: shown with its next render."""
        self._pending_reasoning += chunk
        if chunk and not self._timer.isActive():
            self._timer.start()

    def set_thinking(self, seconds: float | None) -> None:
        """How long the streaming answer's model thought (None: it still does)."""
        if self._streaming is not None:
            self._streaming.set_thinking(seconds)

    @property
    def answer_text(self) -> str:
        return self._stream_text

    def flush(self) -> None:
        """Render the streaming answer now (the timer calls this every RENDER_INTERVAL_MS)."""
        self._timer.stop()
        widget = self._streaming
        if widget is None or not (self._pending or self._pending_reasoning):
            return
        started = time.perf_counter()
        text, delta, thought = self._stream_text, self._pending, self._pending_reasoning
        self._pending = self._pending_reasoning = ""
        if self.before_render is not None:
            self.before_render(text)
        widget.append_reasoning(thought)
        widget.append(delta)
        self.rendered.emit(text)
        spent_ms = (time.perf_counter() - started) * 1000
        self._timer.setInterval(max(RENDER_INTERVAL_MS, int(RENDER_BUSY_FACTOR * spent_ms)))

    def show_progress(self, progress: Progress) -> None:
        """A chunk of the streaming answer (the turn controller's): its reasoning and its text,
        shown with the next render; the answer's start says how long the model thought."""
        self.append_reasoning(progress.delta.reasoning)
        self.append_answer(progress.delta.content)
        if progress.done_thinking:
            self.set_thinking(progress.thinking)

    def finish_answer(self, ending: Ending) -> None:
        """The streaming answer ended as `ending` says (the text the split held back shown first)."""
        self.append_reasoning(ending.tail.reasoning)
        self.append_answer(ending.tail.content)
        self.end_answer(ending.note, ending.complete, ending.can_continue, ending.thinking)

    def end_answer(self, note: str = "", complete: bool = True, can_continue: bool = False,
                   thinking: float | None = None) -> None:
        """The streaming answer ended; `thinking`: how long its model thought (None: it did not)."""
        self.flush()
        if self._streaming is not None:
            if thinking is not None:
                self._streaming.set_thinking(thinking)
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
