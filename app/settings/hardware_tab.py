"""Settings > This computer: the hardware benchmark (in a worker thread: progress bar, Stop),
the last saved profile, the planner's predicted tok/s against the tree budget for a pair (a
catalog pair, the loaded model with the starter among them, and what was measured here), and
which SpecChat this is and where it keeps its data and log.

What this does not do: edit preferences (it owns no field of them); the benchmark's result is
the saved hardware profile, read by everything that predicts.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from PySide6.QtCore import Qt
from PySide6.QtWidgets import (
    QComboBox,
    QHBoxLayout,
    QLabel,
    QPlainTextEdit,
    QProgressBar,
    QPushButton,
    QVBoxLayout,
    QWidget,
)

from app.models.recommend import load_profile, profile_lines
from app.settings.plot import BudgetPlot
from app.settings.plot_entries import PlotEntry, plot_entries
from app.state.logfile import current_log_file
from app.state.preferences import Preferences
from app.state.running import RunningPair
from app.workers.benchmark_worker import benchmark_runner
from engine.about import installation
from engine.store.catalog import Catalog


class HardwareTab(QWidget):
    """The "This computer" tab. `benchmark_options` go to measure_hardware (tests pass a quick
    layer shape); `shutdown()` stops a benchmark still running (the dialog closes)."""

    def __init__(self, catalog: Catalog, prefs: Preferences, running: RunningPair | None,
                 benchmark_options: Mapping[str, Any] | None = None, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self._catalog, self._prefs, self._running = catalog, prefs, running
        self._benchmark_options = dict(benchmark_options or {})
        self.runner = benchmark_runner(self)
        self.runner.progressed.connect(self._on_benchmark_progressed)
        self.runner.finished.connect(self._on_benchmark_finished)
        self.runner.failed.connect(self._on_benchmark_failed)
        self.runner.cancelled.connect(self._on_benchmark_cancelled)
        self.benchmark_button = QPushButton("&Benchmark this computer")
        self.benchmark_button.setAccessibleName("Benchmark this computer")
        self.benchmark_button.clicked.connect(self.start_benchmark)
        self.cancel_benchmark_button = QPushButton("Stop")
        self.cancel_benchmark_button.setAccessibleName("Stop the benchmark")
        self.cancel_benchmark_button.setEnabled(False)
        self.cancel_benchmark_button.clicked.connect(self.runner.cancel)
        self.benchmark_bar = QProgressBar()
        self.benchmark_bar.setRange(0, 1000)
        self.benchmark_bar.setAccessibleName("Benchmark progress")
        self.benchmark_status = QLabel("")
        self.benchmark_status.setAccessibleName("Benchmark status")
        self.profile_text = QPlainTextEdit()
        self.profile_text.setReadOnly(True)
        self.profile_text.setAccessibleName("Last hardware profile")
        self.profile_text.setMaximumHeight(130)
        self.plot_pair = QComboBox()
        self.plot_pair.setAccessibleName("Pair to predict")
        self._plot_entries: list[PlotEntry] = plot_entries(self._catalog, self._prefs, self._running)
        for entry in self._plot_entries:
            self.plot_pair.addItem(entry.label, entry.key)
        active = next((i for i, e in enumerate(self._plot_entries) if e.active), None)
        if active is not None:
            self.plot_pair.setCurrentIndex(active)
        self.plot_pair.currentIndexChanged.connect(lambda _i: self._update_plot())
        self.plot = BudgetPlot()
        self.plot.setMinimumHeight(240)
        row = QHBoxLayout()
        row.addWidget(self.benchmark_button)
        row.addWidget(self.cancel_benchmark_button)
        row.addWidget(self.benchmark_bar, 1)
        pair_row = QHBoxLayout()
        pair_label = QLabel("&Pair:")
        pair_label.setBuddy(self.plot_pair)
        pair_row.addWidget(pair_label)
        pair_row.addWidget(self.plot_pair, 1)
        layout = QVBoxLayout(self)
        layout.addLayout(row)
        layout.addWidget(self.benchmark_status)
        layout.addWidget(self.profile_text)
        layout.addLayout(pair_row)
        layout.addWidget(self.plot, 1)
        about = installation()
        log = current_log_file()
        self.about = QLabel(f"{about.summary()}\nInstalled in {about.prefix} · your data in {about.data}"
                            + (f"\nLog file: {log}" if log is not None else ""))
        self.about.setAccessibleName("SpecChat version and installation")
        self.about.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.about.setWordWrap(True)
        layout.addWidget(self.about)
        self._show_profile()

    def shutdown(self) -> None:
        self.runner.shutdown()

    # ---- benchmark -------------------------------------------------------------------------
    def start_benchmark(self) -> None:
        if self.runner.start(self._benchmark_options):
            self.benchmark_button.setEnabled(False)
            self.cancel_benchmark_button.setEnabled(True)
            self.benchmark_bar.setValue(0)
            self.benchmark_status.setText("Measuring… the computer may feel busy for a minute.")

    def _benchmark_done(self, text: str) -> None:
        self.benchmark_button.setEnabled(True)
        self.cancel_benchmark_button.setEnabled(False)
        self.benchmark_status.setText(text)

    def _on_benchmark_progressed(self, fraction: float, text: str) -> None:
        self.benchmark_bar.setValue(int(1000 * fraction))
        if text:
            self.benchmark_status.setText(text)

    def _on_benchmark_finished(self, _profile: object) -> None:
        self.benchmark_bar.setValue(1000)
        self._benchmark_done("Done: the profile below is saved and used for predictions.")
        self._show_profile()

    def _on_benchmark_failed(self, message: str) -> None:
        self._benchmark_done(f"The benchmark failed: {message}")

    def _on_benchmark_cancelled(self) -> None:
        self._benchmark_done("Stopped; the previous profile (if any) is kept.")

    def _show_profile(self) -> None:
        self.profile_text.setPlainText("\n".join(profile_lines(load_profile())))
        self._update_plot()

    def _update_plot(self) -> None:
        profile = load_profile()
        entry = next((e for e in self._plot_entries if e.key == self.plot_pair.currentData()), None)
        if entry is None:
            self.plot.set_message("No pair to predict.")
            return
        if profile is None and entry.measured is None:
            self.plot.set_message("Benchmark needed: press “Benchmark this computer” to see predicted speeds.")
            return
        quant = self._prefs.quant if self._prefs.quant != "none" else "auto"
        points, chosen = entry.curve(profile, quant)
        measured = entry.measured.tokens_per_second if entry.measured is not None else None
        self.plot.set_curve(points, chosen, title=entry.title(points), measured=measured)
