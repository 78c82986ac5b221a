"""The settings' plot: predicted tokens per second against the tree budget (QtCharts).

Plain data in (`[(budget, tok_s), ...]` from `engine.planning.planner.predict_curve`), nothing computed
here. With no curve (no hardware profile yet, or a pair the planner cannot price) the chart is
replaced by a line of text saying what to do.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from PySide6.QtCharts import (
    QChart,
    QChartView,
    QLineSeries,
    QLogValueAxis,
    QScatterSeries,
    QValueAxis,
)
from PySide6.QtCore import QPointF, Qt
from PySide6.QtGui import QPainter
from PySide6.QtWidgets import QLabel, QStackedLayout, QWidget


def label_format(top: float) -> str:
    """A tick label format with enough decimals for values up to `top`: below 0.05 tok/s (a 70B
    pair on a CPU) "%.1f" printed "0.0" on every tick."""
    if top >= 10:
        return "%.0f"
    if top >= 1 or top <= 0:
        return "%.1f"
    return f"%.{math.ceil(-math.log10(top)) + 1}f"


class BudgetPlot(QWidget):
    """A line of predicted tok/s per budget, with the chosen budget marked."""

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setAccessibleName("Predicted speed by tree budget")
        # the budget is the draft tokens one pass checks, not the tokens it keeps (the status bar's
        # "tokens/pass"): the two used to share a name
        self.setToolTip("Tree budget: how many draft tokens the big model checks in one pass over its weights. "
                        "A pass keeps only those it agrees with (the status bar's tokens/pass). Bigger trees keep "
                        "more per pass but make each pass slower; the peak is the fastest budget.")
        self._chart = QChart()
        self._chart.legend().hide()
        self._chart.setTitle("Predicted tokens per second by tree budget")
        self._chart.setMargins(self._chart.margins())
        self._view = QChartView(self._chart)
        self._view.setRenderHint(QPainter.RenderHint.Antialiasing)
        self._view.setAccessibleName("Predicted speed chart")
        self._message = QLabel()
        self._message.setAlignment(Qt.AlignmentFlag.AlignCenter)
        self._message.setWordWrap(True)
        self._message.setAccessibleName("Prediction status")
        self._stack = QStackedLayout(self)
        self._stack.addWidget(self._message)
        self._stack.addWidget(self._view)
        self._points: list[tuple[int, float]] = []
        self.set_message("Run “Benchmark this computer” to see predictions.")

    @property
    def points(self) -> list[tuple[int, float]]:
        return list(self._points)

    def set_message(self, text: str) -> None:
        self._points = []
        self._message.setText(text)
        self._stack.setCurrentWidget(self._message)

    def message(self) -> str:
        return self._message.text() if self._stack.currentWidget() is self._message else ""

    def set_curve(self, points: Sequence[tuple[int, float]], chosen: int | None = None, title: str = "") -> None:
        points = [(int(b), float(t)) for b, t in points if b > 0]
        if not points:
            self.set_message("The planner has no prediction for this pair.")
            return
        self._points = points
        chart = self._chart
        chart.removeAllSeries()
        for axis in chart.axes():
            chart.removeAxis(axis)
        if title:
            chart.setTitle(title)
        line = QLineSeries()
        line.setName("predicted tok/s")
        for budget, tok_s in points:
            line.append(QPointF(budget, tok_s))
        chart.addSeries(line)
        x_axis = QLogValueAxis() if max(b for b, _ in points) / min(b for b, _ in points) >= 16 else QValueAxis()
        x_axis.setTitleText("tree budget")  # explained in the tooltip: a longer title was cut
        low, high = min(b for b, _ in points), max(b for b, _ in points)
        if isinstance(x_axis, QLogValueAxis):
            x_axis.setBase(2.0)
            x_axis.setRange(low / 1.25, high * 1.25)  # room for the marker at either end
        else:
            pad = max(1.0, 0.05 * (high - low))
            x_axis.setRange(max(0.0, low - pad), high + pad)
        x_axis.setLabelFormat("%d")
        y_axis = QValueAxis()
        y_axis.setTitleText("tok/s")  # short: "tokens per second" was cut on a small chart
        top = max(t for _, t in points)
        y_axis.setRange(0.0, top * 1.2 if top > 0 else 1.0)
        y_axis.setLabelFormat(label_format(top * 1.2))
        chart.addAxis(x_axis, Qt.AlignmentFlag.AlignBottom)
        chart.addAxis(y_axis, Qt.AlignmentFlag.AlignLeft)
        line.attachAxis(x_axis)
        line.attachAxis(y_axis)
        if chosen is not None:
            near = min(points, key=lambda p: abs(p[0] - chosen))
            mark = QScatterSeries()
            mark.setName("chosen budget")
            mark.setMarkerSize(11.0)
            mark.append(QPointF(near[0], near[1]))
            chart.addSeries(mark)
            mark.attachAxis(x_axis)
            mark.attachAxis(y_axis)
        self._stack.setCurrentWidget(self._view)
