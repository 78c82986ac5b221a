"""One-line fields that give way in a chosen order, for the status bar.

`ElidedLabel` asks for its text's width but can take less, ending in "…" (its tooltip has the
text in full); `set_text(text, short)` gives it a shorter wording to show before it elides.

`FieldRow` lays widgets out in one line: a left group from the left edge, a right group against
the right edge, free space between. While everything fits, every field has its full width. When
the row is narrower, fields give way one step at a time in the order `give_way` sets ("short":
its shorter wording; "min": down to a few characters; a plain QLabel is then clipped), so a
long model name yields before the time to first token does; a field never named there keeps its
width. Empty or hidden fields take no room; a field's new text or visibility lays the row out
again. Its minimum width is every field at its last step, so it never widens a window.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from PySide6.QtCore import QEvent, QSize, Qt
from PySide6.QtGui import QPainter, QPaintEvent, QResizeEvent
from PySide6.QtWidgets import QLabel, QSizePolicy, QWidget

SPACING = 6
MIN_TEXT = "0000…"


class ElidedLabel(QLabel):
    """A one-line label that shrinks below its text's width by eliding it (see the module);
    `keep_width`: it never does (a short figure); `elide`: where the "…" goes (ElideLeft keeps a
    figure at the end in sight)."""

    def __init__(self, text: str = "", parent: QWidget | None = None, keep_width: bool = False,
                 elide: Qt.TextElideMode = Qt.TextElideMode.ElideRight) -> None:
        super().__init__(text, parent)
        self.keep_width = keep_width
        self.elide = elide
        self.short = ""
        self.setSizePolicy(QSizePolicy.Policy.Preferred, QSizePolicy.Policy.Preferred)

    def set_text(self, text: str, short: str = "") -> None:
        """`text`, or where it does not fit, `short` (a shorter wording of it) before eliding."""
        self.short = short
        self.setText(text)
        self.update()

    def width_for(self, text: str) -> int:
        """The width this label needs to show `text` whole (its margins and padding included)."""
        return self.sizeHint().width() - self.fontMetrics().horizontalAdvance(self.text()) + \
            self.fontMetrics().horizontalAdvance(text)

    def minimumSizeHint(self) -> QSize:  # noqa: N802
        hint = super().minimumSizeHint()
        if self.keep_width:
            return hint
        return QSize(min(hint.width(), self.width_for(MIN_TEXT)), hint.height())

    def shown_text(self) -> str:
        """The text as painted at the label's current width ("…" where it is cut)."""
        metrics, width = self.fontMetrics(), self.contentsRect().width()
        text = self.text()
        if metrics.horizontalAdvance(text) > width and self.short:
            text = self.short
        return metrics.elidedText(text, self.elide, width)

    def paintEvent(self, event: QPaintEvent) -> None:  # noqa: N802
        painter = QPainter(self)
        painter.setPen(self.palette().color(self.foregroundRole()))
        painter.drawText(self.contentsRect(), int(self.alignment() | Qt.AlignmentFlag.AlignVCenter), self.shown_text())


def _width(widget: QWidget, step: str) -> int:
    """`widget`'s width in full ("full"), at its shorter wording ("short") or at its least ("min")."""
    if isinstance(widget, ElidedLabel):
        if not widget.text():
            return 0
        full = widget.sizeHint().width()
        if step == "short":
            return min(full, widget.width_for(widget.short)) if widget.short else full
        return full if step == "full" else min(full, widget.minimumSizeHint().width())
    full = min(widget.sizeHint().width(), widget.maximumWidth())
    if step != "min":
        return full
    if isinstance(widget, QLabel):  # a plain label (another module's): clipped to a few characters
        return min(full, widget.fontMetrics().horizontalAdvance(MIN_TEXT) + widget.contentsMargins().left()
                   + widget.contentsMargins().right())
    return min(widget.minimumSizeHint().width(), widget.maximumWidth())


class FieldRow(QWidget):
    """The row (see the module): `add_left`, `add_right`, then `give_way`; `relayout()` after a
    field's text changed or it was shown or hidden."""

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self._left: list[QWidget] = []
        self._right: list[QWidget] = []
        self._steps: list[tuple[QWidget, str]] = []
        self.setSizePolicy(QSizePolicy.Policy.Expanding, QSizePolicy.Policy.Fixed)

    def add_left(self, *widgets: QWidget) -> None:
        self._add(self._left, widgets)

    def add_right(self, *widgets: QWidget) -> None:
        self._add(self._right, widgets)

    def _add(self, group: list[QWidget], widgets: Iterable[QWidget]) -> None:
        for widget in widgets:
            widget.setParent(self)
            group.append(widget)

    def give_way(self, steps: Sequence[tuple[QWidget, str]]) -> None:
        """The order in which fields yield room: (field, "short" | "min"), first first."""
        self._steps = list(steps)
        self.relayout()

    def _shown(self) -> list[QWidget]:
        return [w for w in self._left + self._right if not w.isHidden() and _width(w, "full") > 0]

    def _widths(self, room: int) -> dict[QWidget, int]:
        """Each shown field's width in a row `room` wide (see the module)."""
        shown = self._shown()
        widths = {w: _width(w, "full") for w in shown}
        total = sum(widths.values()) + SPACING * max(0, len(shown) - 1)
        last: QWidget | None = None
        for widget, step in self._steps:
            if total <= room:
                break
            if widget in widths:
                narrower = min(widths[widget], _width(widget, step))
                total -= widths[widget] - narrower
                widths[widget], last = narrower, widget
        if last is not None and total < room:  # the last field to give way takes back what is spare
            widths[last] = min(_width(last, "full"), widths[last] + room - total)
        return widths

    def sizeHint(self) -> QSize:  # noqa: N802
        shown = self._shown()
        return QSize(sum(_width(w, "full") for w in shown) + SPACING * max(0, len(shown) - 1), self._height())

    def minimumSizeHint(self) -> QSize:  # noqa: N802
        widths = self._widths(0)
        return QSize(sum(widths.values()) + SPACING * max(0, len(widths) - 1), self._height())

    def _height(self) -> int:
        return max((w.sizeHint().height() for w in self._left + self._right), default=0)

    def relayout(self) -> None:
        self.updateGeometry()
        self._place()

    def event(self, event: QEvent) -> bool:
        if event.type() == QEvent.Type.LayoutRequest:  # a field's text changed, or it was shown or hidden
            self.relayout()
        return super().event(event)

    def resizeEvent(self, event: QResizeEvent) -> None:  # noqa: N802
        super().resizeEvent(event)
        self._place()

    def _place(self) -> None:
        widths = self._widths(self.width())
        height = self.height()
        x = 0
        for widget in self._left:
            if widget in widths:
                widget.setGeometry(x, 0, widths[widget], height)
                x += widths[widget] + SPACING
        x = self.width()
        for widget in reversed(self._right):
            if widget in widths:
                x -= widths[widget]
                widget.setGeometry(x, 0, widths[widget], height)
                x -= SPACING
