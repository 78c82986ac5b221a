"""The settings' plot: predicted tokens per second against the tree budget (QtCharts).

Plain data in (`[(budget, tok_s), ...]` from `engine.planning.planner.predict_curve`, one point for
a model without a draft; the speed measured here, if any, as a dashed level), nothing computed
here. With neither a curve nor a measurement (no hardware profile yet, or a pair the planner
cannot price) the chart is replaced by a line of text saying what to do.
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
from PySide6.QtGui import QPainter, QPen
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
        self._measured: float | None = None
        self.set_message("Run “Benchmark this computer” to see predictions.")

    @property
    def points(self) -> list[tuple[int, float]]:
        return list(self._points)

    @property
    def measured(self) -> float | None:
        """The measured tok/s drawn as a level, or None."""
        return self._measured

    def title(self) -> str:
        return self._chart.title()

    def set_message(self, text: str) -> None:
        self._points, self._measured = [], None
        self._message.setText(text)
        self._stack.setCurrentWidget(self._message)

    def message(self) -> str:
        return self._message.text() if self._stack.currentWidget() is self._message else ""

    def set_curve(self, points: Sequence[tuple[int, float]], chosen: int | None = None, title: str = "",
                  measured: float | None = None) -> None:
        """The predicted points (the chosen budget marked) and, when given, the measured tok/s."""
        points = [(int(b), float(t)) for b, t in points if b > 0]
        if not points and measured is None:
            self.set_message("The planner has no prediction for this pair.")
            return
        if not points:  # measured only: a level across the usual budgets
            points_x = [1, 64]
        else:
            points_x = [b for b, _ in points]
        self._points = points
        self._measured = measured
        chart = self._chart
        chart.removeAllSeries()
        for axis in chart.axes():
            chart.removeAxis(axis)
        if title:
            chart.setTitle(title)
        line = QLineSeries() if len(points) > 1 else QScatterSeries()  # one point: a model without a draft
        line.setName("predicted tok/s")
        for budget, tok_s in points:
            line.append(QPointF(budget, tok_s))
        series = [line] if points else []
        low, high = min(points_x), max(points_x)
        x_axis = QLogValueAxis() if high / low >= 16 else QValueAxis()
        x_axis.setTitleText("tree budget")  # explained in the tooltip: a longer title was cut
        if isinstance(x_axis, QLogValueAxis):
            x_axis.setBase(2.0)
            x_range = (low / 1.25, high * 1.25)  # room for the marker at either end
        else:
            pad = max(1.0, 0.05 * (high - low))
            x_range = (max(0.0, low - pad), high + pad)
            if x_range[1] - x_range[0] <= 8:  # whole budgets only: "%d" on 4 ticks over 0..2 read "0 0 1 1 2"
                x_range = (float(int(x_range[0])), float(int(x_range[1] + 0.999)))
                x_axis.setTickCount(int(x_range[1] - x_range[0]) + 1)
        x_axis.setRange(*x_range)
        if measured is not None:  # a dashed level across the whole chart
            level = QLineSeries()
            level.setName("measured here")
            pen = QPen(Qt.GlobalColor.darkGreen)
            pen.setStyle(Qt.PenStyle.DashLine)
            pen.setWidthF(2.0)
            level.setPen(pen)
            level.append(QPointF(x_range[0], measured))
            level.append(QPointF(x_range[1], measured))
            series.append(level)
        for s in series:
            chart.addSeries(s)
        x_axis.setLabelFormat("%d")
        y_axis = QValueAxis()
        y_axis.setTitleText("tok/s")  # short: "tokens per second" was cut on a small chart
        top = max([t for _, t in points] + ([measured] if measured is not None else []))
        y_axis.setRange(0.0, top * 1.2 if top > 0 else 1.0)
        y_axis.setLabelFormat(label_format(top * 1.2))
        chart.addAxis(x_axis, Qt.AlignmentFlag.AlignBottom)
        chart.addAxis(y_axis, Qt.AlignmentFlag.AlignLeft)
        for s in series:
            s.attachAxis(x_axis)
            s.attachAxis(y_axis)
        if measured is not None or len(points) == 1:
            chart.legend().show()
        else:
            chart.legend().hide()
        if chosen is not None and points and len(points) > 1:
            near = min(points, key=lambda p: abs(p[0] - chosen))
            mark = QScatterSeries()
            mark.setName("chosen budget")
            mark.setMarkerSize(11.0)
            mark.append(QPointF(near[0], near[1]))
            chart.addSeries(mark)
            mark.attachAxis(x_axis)
            mark.attachAxis(y_axis)
        self._stack.setCurrentWidget(self._view)
