"""The first-run wizard: welcome -> hardware benchmark -> recommended pair -> download -> calibration.

Each long step runs in its own worker thread (the benchmark and calibration in a `TaskRunner`,
downloads in a `DownloadQueue`); a page's Next button is enabled by `isComplete()` once its step
is done, failed or skipped. The benchmark can be skipped (the starter is then recommended). On a
CPU-only machine only the starter (no draft) is offered. The starter always comes from its PyPI
wheel and runs as that Q4_1 GGUF (engine.loading.starter: the one starter `specchat chat` runs
too), so a fresh machine without hub access still reaches a chat; its row says so.

Speeds on the recommendation page are what this computer measured for a pair once it has run
(the test run at the end counts), else the planner's prediction labelled as one. A download of
a pair that does not fit, a large one or one larger than the free disk space is confirmed first
(`confirm`, injected: tests answer without a dialog).

On finish the chosen target/draft and `first_run_done=True` are saved in the preferences (the
starter by its GGUF, which is what loads).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

from PySide6.QtCore import Qt
from PySide6.QtWidgets import (
    QCheckBox,
    QLabel,
    QListWidget,
    QListWidgetItem,
    QPushButton,
    QVBoxLayout,
    QWidget,
    QWizard,
    QWizardPage,
)

from app.models.recommend import (
    PairOption,
    download_bytes,
    download_warning,
    load_profile,
    pair_options,
    profile_has_gpu,
    recommend,
)
from app.models.tables import FIT_COLOURS
from app.state.names import short_paths  # noqa: F401  (tests import it from here)
from app.state.preferences_store import PreferencesStore
from app.widgets.dialogs import Confirm, Dialogs
from app.wizard.runs import BenchmarkPage, CalibrationPage, progress_bar, rich_label
from app.workers.benchmark_worker import benchmark_runner, calibration_runner
from app.workers.download_worker import (
    DownloadOptions,
    DownloadQueue,
    StarterSource,
    describe_progress,
    progress_fraction,
)
from engine import paths
from engine.store import (
    DownloadSettings,
    find_local_model,
    hf_hub_cache_dir,
    load_catalog,
)
from engine.store.pypi import built_starter
from engine.types import DownloadProgress
from engine.units import format_bytes


class WelcomePage(QWizardPage):
    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setTitle("Welcome to SpecChat")
        self.setSubTitle("Chat with large open models on this computer, privately.")
        layout = QVBoxLayout(self)
        layout.addWidget(rich_label(
            "<p>A few steps get you to a first chat:</p><ol>"
            "<li><b>Measure this computer</b> (about a minute) to predict how fast each model runs here.</li>"
            "<li><b>Choose a model pair</b>: a large target model and a small draft that speeds it up.</li>"
            "<li><b>Download</b> it (you can pause and resume).</li>"
            "<li><b>A short test run</b>, then the chat opens.</li></ol>"
            "<p>Press <b>Next</b> (Alt+N) to start.</p>", "Welcome text"))
        layout.addStretch(1)


class RecommendPage(QWizardPage):
    """Catalog pairs that fit, fastest first (the starter alone on CPU-only machines)."""

    def __init__(self, wizard: FirstRunWizard) -> None:
        super().__init__()
        self._wizard = wizard
        self.setTitle("Choose a model pair")
        self.setSubTitle("Best first: the pairs that fit this computer, fastest first, then the small starter.")
        self.intro = rich_label("", "Recommendation")
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
        everything = pair_options(self._wizard.catalog, profile, locate=self._wizard.local_path)
        chosen = self.selected()
        recommended = recommend(everything, profile)
        self.options = list(recommended)
        if self.show_all.isChecked():  # the rest after the recommendation, fastest first
            offered = {o.pair_id for o in self.options}
            self.options += sorted((o for o in everything if o.pair_id not in offered),
                                   key=lambda o: -(o.speed or 0.0))
        if profile is None:
            intro = "Without a benchmark SpecChat recommends the small starter model, which runs anywhere."
        elif not profile_has_gpu(profile) and len(recommended) > 1:
            intro = ("No CUDA GPU was found. The <b>starter</b> is a small download that runs anywhere; the "
                     "models after it are mixtures of experts, which read only a few billion of their weights a "
                     "token, so this CPU runs them at reading speed (a large download, and most of this "
                     "computer's RAM).")
        elif not profile_has_gpu(profile):
            intro = ("No CUDA GPU was found, so the <b>starter</b> runs alone: on a CPU a draft model costs as "
                     "much as it saves. Large pairs need a GPU.")
        elif len(recommended) == 1:
            intro = "No catalog pair fits this computer's GPU and RAM; the small starter runs anywhere."
        else:
            intro = "These pairs fit this computer; the first is the fastest."
        self.intro.setText(intro)
        self.list.clear()
        for option in self.options:
            draft = f" + {option.draft}" if option.draft else " (no draft)"
            details = [f"{format_bytes(option.download_bytes)} to download", option.target_format]
            if option.fit != "unknown":
                colour = FIT_COLOURS.get(option.fit, "#666666")
                details.append(f"<span style='color:{colour}'><b>{option.fit_label}</b></span>")
            speed = f"{option.speed_html()}<br>" if option.speed_html() else ""
            item = QListWidgetItem()
            item.setData(Qt.ItemDataRole.UserRole, option.pair_id)
            item.setToolTip(option.reason or option.description)
            item.setData(Qt.ItemDataRole.AccessibleTextRole, f"{option.title}: {option.target}{draft}")
            label = QLabel(f"<b>{option.title}</b> — {option.target}{draft}<br>{' · '.join(details)}<br>"
                           f"{speed}<span style='color:#666666'>{option.description}</span>")
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

    def validatePage(self) -> bool:
        """Next: a download that deserves a second look (too big, large, over the free space) is
        confirmed first; No stays on this page."""
        option = self.selected()
        if option is None:
            return False
        wizard = self._wizard
        missing = sum(download_bytes(m, wizard.catalog.starter) for m in wizard.missing_models(option))
        warning = download_warning(option, missing, wizard.models_dir)
        return not warning or wizard.confirm("Download this pair?", warning)

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
        self.bar = progress_bar("Download progress")
        self.status = rich_label("", "Download status")
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
            starter = self._wizard.catalog.starter
            self.status.setText(f"Downloading {', '.join(self.pending)}…" + (
                " The starter comes from PyPI as a Q4_1 GGUF, which runs as it is."
                if starter in self.pending else ""))
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


class FirstRunWizard(QWizard):
    """The first-run wizard. Extra keyword arguments serve tests: a quick benchmark, short
    download timeouts, a local starter source instead of pip, fewer calibration tokens."""

    def __init__(
        self, store: PreferencesStore, parent: QWidget | None = None, endpoint: str | None = None, *,
        benchmark_options: Mapping[str, Any] | None = None, download_settings: DownloadSettings | None = None,
        starter_source: StarterSource | None = None, hf_cache_dir: Path | None = None, calibration_tokens: int = 24,
        confirm: Confirm | None = None,
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
        self.confirm: Confirm = confirm or Dialogs.over(self).confirm
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
        """What loads for a catalog id: the starter's GGUF, else the model store's copy."""
        if spec and spec == self.catalog.starter:
            return built_starter(paths.cache_dir())
        cache = self._hf_cache if self._hf_cache is not None else hf_hub_cache_dir()
        model = find_local_model(spec, self.models_dir, cache, self.catalog)
        return model.path if model is not None else None

    def missing_models(self, option: PairOption) -> list[Any]:
        """The catalog models of `option` not on this computer yet."""
        ids = [m for m in (option.target, option.draft) if m and self.local_path(m) is None]
        return [m for m in (self.catalog.find(i) for i in ids) if m is not None]

    def accept(self) -> None:
        option = self.chosen()
        prefs = self.store.load()
        if option is not None:  # the starter by its GGUF: the model store does not hold it
            starter = self.catalog.starter
            target, draft = (str(self.local_path(m) or m) if m == starter else m for m in (option.target, option.draft))
            prefs = replace(prefs, target=target, draft=draft)
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
