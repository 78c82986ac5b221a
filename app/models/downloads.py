"""The models page's downloads: one row per model (`DownloadRow`) in a scrolling box
(`DownloadsBox`).

A row shows a model's name, progress bar and status line with pause/resume and cancel (Retry
and Clear once it ended); it drives the `DownloadQueue` (app/workers/download_worker.py) and
reacts to nothing else. The box keeps the rows by model spec and says when there are none.

What this does not do: start downloads or confirm them (the page does, through its injected
dialogs).
"""

from __future__ import annotations

from PySide6.QtCore import Qt, Signal
from PySide6.QtWidgets import (
    QFrame,
    QGroupBox,
    QHBoxLayout,
    QLabel,
    QProgressBar,
    QPushButton,
    QScrollArea,
    QVBoxLayout,
    QWidget,
)

from app.workers.download_worker import DownloadQueue, describe_progress, progress_fraction
from engine.types import DownloadProgress


class DownloadRow(QFrame):
    """One download: name, progress bar, detail line, pause/resume and cancel.

    Signals:
        cleared(str): the user dismissed a finished row (spec).
        retry_requested(str): Retry on a failed or cancelled row (spec).
    """

    cleared = Signal(str)
    retry_requested = Signal(str)

    def __init__(self, spec: str, queue: DownloadQueue, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.spec = spec
        self._queue = queue
        self.setFrameShape(QFrame.Shape.StyledPanel)
        self.setAccessibleName(f"Download of {spec}")
        self.name = QLabel(f"<b>{spec}</b>")
        self.bar = QProgressBar()
        self.bar.setRange(0, 1000)
        self.bar.setAccessibleName(f"{spec} download progress")
        self.detail = QLabel("Waiting for its turn")
        self.detail.setWordWrap(True)  # an error line says what to do: all of it must show
        self.detail.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.detail.setAccessibleName(f"{spec} download status")
        self.pause_button = QPushButton("Pause")
        self.pause_button.setAccessibleName(f"Pause or resume {spec}")
        self.pause_button.clicked.connect(self._on_pause_clicked)
        self.cancel_button = QPushButton("Cancel")
        self.cancel_button.setAccessibleName(f"Cancel {spec}")
        self.cancel_button.clicked.connect(lambda: self._queue.cancel(self.spec))
        top = QHBoxLayout()
        top.addWidget(self.name, 1)
        top.addWidget(self.detail, 2)
        top.addWidget(self.pause_button)
        top.addWidget(self.cancel_button)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(8, 4, 8, 4)
        layout.addLayout(top)
        layout.addWidget(self.bar)
        self.state = "queued"

    def update_progress(self, event: DownloadProgress) -> None:
        self.state = event.state
        self.bar.setValue(int(1000 * progress_fraction(event)))
        self.detail.setText(describe_progress(event))
        self.pause_button.setText("Resume" if event.state == "paused" else "Pause")

    def finish(self, state: str, text: str) -> None:
        self.state = state
        if state == "done":
            self.bar.setValue(1000)
        self.detail.setText(text)
        self.detail.setToolTip(text)
        if state in ("failed", "cancelled"):  # Pause becomes Retry (the partial data is kept: it resumes)
            self.pause_button.setText("Retry")
            self.pause_button.setAccessibleName(f"Retry {self.spec}")
            self.pause_button.setToolTip("Download again, going on from what was already downloaded")
            self.pause_button.clicked.disconnect()
            self.pause_button.clicked.connect(lambda: self.retry_requested.emit(self.spec))
        else:
            self.pause_button.hide()
        self.cancel_button.setText("Clear")
        self.cancel_button.setAccessibleName(f"Clear {self.spec} from the list")
        self.cancel_button.clicked.disconnect()
        self.cancel_button.clicked.connect(lambda: self.cleared.emit(self.spec))

    def _on_pause_clicked(self) -> None:
        if self._queue.is_paused(self.spec):
            self._queue.resume(self.spec)
            self.pause_button.setText("Pause")
        else:
            self._queue.pause(self.spec)
            self.pause_button.setText("Resume")


class DownloadsBox(QGroupBox):
    """The download rows, by spec. Signals: retry_requested(str): Retry on a row (spec)."""

    retry_requested = Signal(str)

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__("Downloads", parent)
        self.setAccessibleName("Downloads")
        self.rows: dict[str, DownloadRow] = {}
        self._layout = QVBoxLayout()
        self._layout.setContentsMargins(0, 0, 0, 0)
        self.empty_label = QLabel("No downloads. Pick a pair in the catalog and press Download.")
        self.empty_label.setAccessibleName("No downloads")
        self._layout.addWidget(self.empty_label)
        self._layout.addStretch(1)
        inner = QWidget()
        inner.setLayout(self._layout)
        scroll = QScrollArea()
        scroll.setWidgetResizable(True)
        scroll.setFrameShape(QFrame.Shape.NoFrame)
        scroll.setWidget(inner)
        scroll.setMinimumHeight(60)
        QVBoxLayout(self).addWidget(scroll)

    def add(self, spec: str, queue: DownloadQueue) -> DownloadRow:
        """A new row for `spec` (replacing an ended one)."""
        old = self.rows.pop(spec, None)
        if old is not None:
            old.deleteLater()
        row = DownloadRow(spec, queue)
        row.cleared.connect(self._on_row_cleared)
        row.retry_requested.connect(self.retry_requested)
        self.rows[spec] = row
        self._layout.insertWidget(self._layout.count() - 1, row)
        self.empty_label.hide()
        return row

    def progress(self, event: DownloadProgress) -> None:
        row = self.rows.get(event.model_id)
        if row is not None:
            row.update_progress(event)

    def finish(self, spec: str, state: str, text: str) -> None:
        row = self.rows.get(spec)
        if row is not None:
            row.finish(state, text)

    def _on_row_cleared(self, spec: str) -> None:
        row = self.rows.pop(spec, None)
        if row is not None:
            row.deleteLater()
        self.empty_label.setVisible(not self.rows)
