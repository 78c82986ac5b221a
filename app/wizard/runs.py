"""The wizard's two measuring pages: the hardware benchmark and the short test run.

`RunnerPage` is a page whose step is one task on a TaskRunner (app/workers/benchmark_worker.py): a
progress bar, a status line and a Skip button; Next/Finish is enabled once the task is done,
failed or skipped. `BenchmarkPage` measures this computer; `CalibrationPage` loads the chosen
pair, generates a few tokens and says what it measured against what the benchmark predicted
(the run is recorded as this computer's first measurement of the pair). The pages reach the
wizard (app/wizard/first_run.py) for its runners, choice and preferences, as `Wizard` says.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal, Protocol

from PySide6.QtCore import Qt
from PySide6.QtWidgets import QLabel, QProgressBar, QPushButton, QVBoxLayout, QWizardPage

from app.models.recommend import PairOption, profile_lines
from app.state.names import short_paths
from app.state.preferences_store import PreferencesStore
from app.workers.benchmark_worker import CalibrationRequest, CalibrationResult, TaskRunner
from engine.planning.measured import format_rate
from engine.planning.profile import HardwareProfile

RunState = Literal["idle", "running", "done", "failed", "skipped"]


class Wizard(Protocol):
    """What the measuring pages use of the wizard (app/wizard/first_run.FirstRunWizard)."""

    benchmark: TaskRunner
    calibration: TaskRunner
    calibration_tokens: int
    store: PreferencesStore

    @property
    def benchmark_options(self) -> Mapping[str, Any]: ...

    def chosen(self) -> PairOption | None: ...

    def local_path(self, spec: str) -> Path | None: ...


def rich_label(text: str, name: str) -> QLabel:
    label = QLabel(text)
    label.setWordWrap(True)
    label.setAccessibleName(name)
    label.setTextFormat(Qt.TextFormat.RichText)
    return label


def progress_bar(name: str) -> QProgressBar:
    bar = QProgressBar()
    bar.setRange(0, 1000)
    bar.setAccessibleName(name)
    return bar


class RunnerPage(QWizardPage):
    """A page whose step is one task on a TaskRunner (the benchmark, the test run): a progress
    bar, a status line and a Skip button; Next/Finish is enabled once the task is done, failed
    or skipped. A start asked for while an earlier run is still stopping waits for it to end.
    Subclasses start the task in `initializePage` with `_run(arg)` and word its outcome."""

    def __init__(self, runner: TaskRunner, title: str, subtitle: str, what: str, skip_text: str) -> None:
        super().__init__()
        self.runner = runner
        self.setTitle(title)
        self.setSubTitle(subtitle)
        self.state: RunState = "idle"
        self._queued: object = None  # a run asked for while an earlier one was still stopping
        self._has_queued = False
        self.bar = progress_bar(f"{what} progress")
        self.status = rich_label("", f"{what} status")
        self.skip_button = QPushButton(skip_text)
        self.skip_button.setAccessibleName(skip_text.replace("&", ""))
        self.skip_button.clicked.connect(self.skip)
        self.body = QVBoxLayout(self)
        self.body.addWidget(self.bar)
        self.body.addWidget(self.status)
        runner.progressed.connect(self._on_runner_progressed)
        runner.finished.connect(self._on_runner_finished)
        runner.failed.connect(self._on_runner_failed)
        runner.cancelled.connect(self._on_runner_cancelled)

    def _finish_layout(self) -> None:
        self.body.addStretch(1)
        self.body.addWidget(self.skip_button, 0, Qt.AlignmentFlag.AlignLeft)

    # -- what subclasses word --
    def _done_text(self, result: object) -> str:
        raise NotImplementedError

    def _failed_text(self, message: str) -> str:
        raise NotImplementedError

    def _skipped_text(self) -> str:
        raise NotImplementedError

    # -- the task --
    def _run(self, arg: object) -> None:
        self.state = "running"
        self.bar.setRange(0, 0)  # busy until the task reports a fraction
        self.skip_button.setEnabled(True)
        self.skip_button.show()
        self.status.setText("Starting…")
        if not self.runner.start(arg):
            self._queued, self._has_queued = arg, True
        self.completeChanged.emit()

    def _fail(self, text: str) -> None:
        self.state = "failed"
        self._step_over()
        self.status.setText(text)
        self.completeChanged.emit()

    def _start_queued(self) -> bool:
        """An earlier run has just ended: start the one asked for meanwhile, if any."""
        if not self._has_queued:
            return False
        arg, self._queued, self._has_queued = self._queued, None, False
        self.runner.start(arg)
        return True

    def isComplete(self) -> bool:
        return self.state in ("done", "failed", "skipped")

    def cleanupPage(self) -> None:  # Back: stop what this page started
        if self.state == "running":
            self.runner.cancel()
        self._queued, self._has_queued = None, False
        self.state = "idle"

    def skip(self) -> None:
        if self.state == "running":
            self.runner.cancel()
        self.state = "skipped"
        self._step_over()
        self.status.setText(self._skipped_text())
        self.completeChanged.emit()

    def _step_over(self) -> None:
        """Nothing left to skip: the button goes (it used to stay, disabled), the bar stops."""
        self.skip_button.hide()
        self.bar.setRange(0, 1000)

    def _on_runner_progressed(self, fraction: float, text: str) -> None:
        if self.state == "running":
            if fraction > 0:
                self.bar.setRange(0, 1000)
                self.bar.setValue(int(1000 * fraction))
            text = short_paths(text)
            self.status.setText(text[:1].upper() + text[1:])

    def _on_runner_finished(self, result: object) -> None:
        if self._start_queued() or self.state != "running":
            return
        self.state = "done"
        self._step_over()
        self.bar.setValue(1000)
        self.status.setText(self._done_text(result))
        self.completeChanged.emit()

    def _on_runner_failed(self, message: str) -> None:
        if self._start_queued() or self.state != "running":
            return
        self._fail(self._failed_text(message))

    def _on_runner_cancelled(self) -> None:
        if self._start_queued():
            return
        if self.state == "running":
            self.state = "skipped"
            self.completeChanged.emit()


class BenchmarkPage(RunnerPage):
    """Runs the hardware benchmark when shown; Next is enabled when it is done or skipped."""

    def __init__(self, wizard: Wizard) -> None:
        super().__init__(wizard.benchmark, "Measuring this computer",
                         "SpecChat times the memory, disk, GPU and one model layer to predict speeds.",
                         "Benchmark", "&Skip the benchmark")
        self._wizard = wizard
        self.summary = rich_label("", "Measured hardware")
        self.body.addWidget(self.summary)
        self._finish_layout()

    def initializePage(self) -> None:
        if self.state in ("idle", "failed"):
            self._run(self._wizard.benchmark_options)

    def cleanupPage(self) -> None:  # Back keeps a finished or running measurement
        pass

    def _done_text(self, result: object) -> str:
        assert isinstance(result, HardwareProfile)  # what BenchmarkWorker returns
        self.summary.setText("<br>".join(profile_lines(result)[1:5]))
        return "<b>Done.</b> Press Next to see the models that suit this computer."

    def _failed_text(self, message: str) -> str:
        return f"The benchmark failed: {message} You can go on; the starter model will be recommended."

    def _skipped_text(self) -> str:
        return ("Skipped. The small starter model will be recommended; you can measure later "
                "in Settings → This computer.")


class CalibrationPage(RunnerPage):
    """Loads the pair and generates a few tokens: proves it works and measures the real speed."""

    def __init__(self, wizard: Wizard) -> None:
        super().__init__(wizard.calibration, "A short test run", "Loading the models and generating a few tokens.",
                         "Test run", "S&kip the test run")
        self._wizard = wizard
        self.setFinalPage(True)
        self.result: CalibrationResult | None = None
        self._finish_layout()

    def initializePage(self) -> None:
        option = self._wizard.chosen()
        assert option is not None
        target = self._wizard.local_path(option.target)
        draft = self._wizard.local_path(option.draft) if option.draft else None
        if target is None or (option.draft and draft is None):
            self._fail("The models are not on this computer; go Back to download them.")
            return
        prefs = self._wizard.store.load()
        self.result = None
        self._run(CalibrationRequest(
            target=target, draft=draft, load_settings=prefs.load_settings(),
            speculation=prefs.speculation(switch_draft=False),  # budget auto: as the chat will run it
            max_new_tokens=self._wizard.calibration_tokens,
        ))

    def _done_text(self, result: object) -> str:
        assert isinstance(result, CalibrationResult)
        self.result = result
        per_pass = f", {result.tokens_per_pass:.2f} tokens per target pass" if result.tokens_per_pass else ""
        option = self._wizard.chosen()
        versus = ""
        if option is not None and option.tokens_per_second is not None:
            versus = (f" The benchmark predicted {format_rate(option.tokens_per_second)} tok/s; from now on the "
                      "speeds shown for this pair are the ones measured here.")
        return (f"<b>It works.</b> {result.new_tokens} tokens at {format_rate(result.tokens_per_second)} tokens/s"
                f"{per_pass} (loaded in {result.load_seconds:.1f} s).{versus} Press <b>Start chatting</b>.")

    def _failed_text(self, message: str) -> str:
        return f"The test run failed: {message}"

    def _skipped_text(self) -> str:
        return "Skipped. Press <b>Start chatting</b>."
