"""One download's row on the models page, and how a download is confirmed.

`DownloadRow` shows a model's name, progress bar and status line with pause/resume and cancel
(Retry and Clear once it ended); it drives a `DownloadQueue` and reacts to nothing else.

`Confirm` is how the models page and the wizard ask before a download that deserves a second
look (recommend.download_warning: a pair that does not fit, a large download, more than the
free disk space): a callable (title, text) -> bool, injected, so tests answer it without a
dialog. `confirm_with_dialog(parent)` is the app's: a Yes/No question, No by default.
"""

from __future__ import annotations

from collections.abc import Callable

from PySide6.QtCore import Qt, Signal
from PySide6.QtWidgets import (
    QFrame,
    QHBoxLayout,
    QLabel,
    QMessageBox,
    QProgressBar,
    QPushButton,
    QVBoxLayout,
    QWidget,
)

from app.workers.download_worker import DownloadQueue, describe_progress, progress_fraction
from engine.types import DownloadProgress

Confirm = Callable[[str, str], bool]  # (title, text) -> go ahead?


def confirm_with_dialog(parent: QWidget | None) -> Confirm:
    """A Yes/No question box over `parent`; No is the default (Enter does not start 45 GB)."""
    def ask(title: str, text: str) -> bool:
        answer = QMessageBox.question(parent, title, text,
                                      QMessageBox.StandardButton.Yes | QMessageBox.StandardButton.No,
                                      QMessageBox.StandardButton.No)
        return answer == QMessageBox.StandardButton.Yes

    return ask


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
