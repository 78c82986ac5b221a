"""The models page: catalog pairs with fit and predicted speed, downloads, local models, the active pair.

Layout, top to bottom: the active pair (two combo boxes over the local models and a "Use this
pair" button), a line about this computer's hardware profile, two tabs — "Catalog" (every pair
with its fit badge and the planner's tok/s on this machine) and "On this computer" (local models
with sizes, plus the GGUFs LM Studio and Ollama keep, used where they are; import, remove,
download by repo id) — and the download queue (a progress bar, speed,
ETA, pause/resume and cancel per model).

Downloads run in a `DownloadQueue` (app/download_worker.py); the page only reacts to its signals.
Choosing a pair saves it into the preferences and emits `active_pair_changed`.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path

from PySide6.QtCore import Qt, Signal
from PySide6.QtGui import QKeySequence, QShortcut
from PySide6.QtWidgets import (
    QAbstractItemView,
    QComboBox,
    QFileDialog,
    QFrame,
    QGroupBox,
    QHBoxLayout,
    QHeaderView,
    QLabel,
    QLineEdit,
    QMessageBox,
    QProgressBar,
    QPushButton,
    QScrollArea,
    QTableWidget,
    QTableWidgetItem,
    QTabWidget,
    QVBoxLayout,
    QWidget,
)

from app.download_worker import (
    DownloadOptions,
    DownloadQueue,
    StarterSource,
    describe_progress,
    progress_fraction,
)
from app.preferences import Preferences, PreferencesStore
from app.recommend import PairOption, load_profile, pair_options, profile_headline
from app.status import ElidedLabel
from engine.errors import EngineError
from engine.store import (
    Discovery,
    DownloadSettings,
    HeaderFacts,
    LocalModel,
    discover_models,
    hf_hub_cache_dir,
    import_model,
    list_local_models,
    load_catalog,
    remove_model,
)
from engine.store.catalog import Catalog
from engine.store.registry import FOUND_SOURCES, match_local
from engine.types import DownloadProgress
from engine.units import format_bytes

log = logging.getLogger(__name__)

CATALOG_COLUMNS = ("Pair", "Target", "Format", "Draft", "Download", "Fit", "Predicted speed", "On disk", "About")
COL_PAIR, COL_FORMAT, COL_FIT, COL_SPEED, COL_ABOUT = (CATALOG_COLUMNS.index(c) for c in
                                                       ("Pair", "Format", "Fit", "Predicted speed", "About"))
FIT_COLOURS = {"fits": "#1e7d32", "slow": "#b26a00", "too big": "#b3261e", "unknown": "#666666"}
NO_DRAFT = "(no draft)"


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


class ModelsPage(QWidget):
    """Browse, download, import, remove and choose models.

    Signals:
        active_pair_changed(str, str): target, draft ("" = none); already saved in preferences.
        download_finished(str, str): spec, local path.
    """

    active_pair_changed = Signal(str, str)
    download_finished = Signal(str, str)

    def __init__(
        self, store: PreferencesStore, parent: QWidget | None = None, endpoint: str | None = None, *,
        download_settings: DownloadSettings | None = None, starter_source: StarterSource | None = None,
        hf_cache_dir: Path | None = None, catalog: Catalog | None = None,
    ) -> None:
        super().__init__(parent)
        self.setAccessibleName("Models page")
        self._store = store
        self._catalog = catalog or load_catalog()
        self._prefs = store.load()
        self._hf_cache = hf_cache_dir
        self._local: list[LocalModel] = []
        self._facts = HeaderFacts()  # each found GGUF's header is read once per change of the file
        self.found = Discovery((), ())
        self._options: list[PairOption] = []
        self.rows: dict[str, DownloadRow] = {}
        self._download_args = {"endpoint": endpoint, "settings": download_settings or DownloadSettings(),
                               "hf_cache_dir": hf_cache_dir, "starter_source": starter_source}
        self.queue = self._make_queue(self._prefs.models_path())
        self._build()
        store.changed.connect(self._on_store_changed)
        self.refresh()

    # ---- construction ----------------------------------------------------------------------
    def _make_queue(self, models_dir: Path) -> DownloadQueue:
        queue = DownloadQueue(DownloadOptions(models_dir=models_dir, **self._download_args), self)
        queue.progressed.connect(self._on_queue_progressed)
        queue.finished.connect(self._on_queue_finished)
        queue.failed.connect(self._on_queue_failed)
        queue.cancelled.connect(self._on_queue_cancelled)
        return queue

    def _build(self) -> None:
        title = QLabel("<h2>Models</h2>")
        self.folder_label = ElidedLabel()  # a long path elides (full in its tooltip): the page fits half a screen
        self.folder_label.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.folder_label.setAccessibleName("Models folder")
        header = QHBoxLayout()
        header.addWidget(title)
        header.addStretch(1)
        header.addWidget(self.folder_label)

        self.target_combo = QComboBox()
        self.target_combo.setAccessibleName("Active target model")
        self.target_combo.currentIndexChanged.connect(self._on_target_combo_changed)
        self.draft_combo = QComboBox()
        self.draft_combo.setAccessibleName("Active draft model")
        self.draft_combo.setToolTip("A small model of the same family that guesses ahead; the target checks its "
                                    "guesses, several tokens per pass. (no draft): plain decoding")
        for combo in (self.target_combo, self.draft_combo):  # long names elide: the page fits half a screen
            combo.setSizeAdjustPolicy(QComboBox.SizeAdjustPolicy.AdjustToMinimumContentsLengthWithIcon)
            combo.setMinimumContentsLength(14)
        self.use_button = QPushButton("&Use this pair")
        self.use_button.setAccessibleName("Use the chosen target and draft")
        self.use_button.clicked.connect(self._on_use_clicked)
        self.active_label = QLabel()
        self.active_label.setAccessibleName("Active pair")
        target_label = QLabel("&Target:")
        target_label.setBuddy(self.target_combo)
        draft_label = QLabel("&Draft:")
        draft_label.setBuddy(self.draft_combo)
        pair_box = QGroupBox("Active pair")
        pair_column = QVBoxLayout(pair_box)
        pair_row = QHBoxLayout()
        for w in (target_label, self.target_combo, draft_label, self.draft_combo, self.use_button):
            pair_row.addWidget(w)
        pair_row.addStretch(1)
        pair_column.addLayout(pair_row)
        self.active_label.setWordWrap(True)
        pair_column.addWidget(self.active_label)

        self.profile_label = QLabel()
        self.profile_label.setWordWrap(True)
        self.profile_label.setAccessibleName("This computer")

        self.tabs = QTabWidget()
        self.tabs.setAccessibleName("Model lists")
        self.tabs.addTab(self._build_catalog_tab(), "&Catalog")
        self.tabs.addTab(self._build_local_tab(), "On this &computer")

        downloads = QGroupBox("Downloads")
        downloads.setAccessibleName("Downloads")
        self.downloads_layout = QVBoxLayout()
        self.downloads_layout.setContentsMargins(0, 0, 0, 0)
        self.no_downloads = QLabel("No downloads. Pick a pair in the catalog and press Download.")
        self.no_downloads.setAccessibleName("No downloads")
        self.downloads_layout.addWidget(self.no_downloads)
        self.downloads_layout.addStretch(1)
        inner = QWidget()
        inner.setLayout(self.downloads_layout)
        scroll = QScrollArea()
        scroll.setWidgetResizable(True)
        scroll.setFrameShape(QFrame.Shape.NoFrame)
        scroll.setWidget(inner)
        scroll.setMinimumHeight(60)
        box_layout = QVBoxLayout(downloads)
        box_layout.addWidget(scroll)

        layout = QVBoxLayout(self)
        layout.addLayout(header)
        layout.addWidget(pair_box)
        layout.addWidget(self.profile_label)
        layout.addWidget(self.tabs, 2)
        layout.addWidget(downloads, 1)

        QShortcut(QKeySequence.StandardKey.Refresh, self, activated=self.refresh)
        QShortcut(QKeySequence("Ctrl+I"), self, activated=self._on_import_folder_clicked)

    def _build_catalog_tab(self) -> QWidget:
        self.catalog_table = QTableWidget(0, len(CATALOG_COLUMNS))
        self.catalog_table.setAccessibleName("Catalog pairs")
        self.catalog_table.setHorizontalHeaderLabels(list(CATALOG_COLUMNS))
        self._table_defaults(self.catalog_table)
        self.catalog_table.itemSelectionChanged.connect(self._update_buttons)
        self.catalog_table.itemDoubleClicked.connect(lambda _item: self._on_catalog_use_clicked())
        self.download_button = QPushButton("Do&wnload")
        self.download_button.setAccessibleName("Download the selected pair")
        self.download_button.clicked.connect(self._on_download_clicked)
        self.catalog_use_button = QPushButton("Use &selected pair")
        self.catalog_use_button.setAccessibleName("Use the selected catalog pair")
        self.catalog_use_button.clicked.connect(self._on_catalog_use_clicked)
        refresh = QPushButton("&Refresh")
        refresh.setAccessibleName("Refresh the model lists")
        refresh.clicked.connect(self.refresh)
        buttons = QHBoxLayout()
        buttons.addWidget(self.download_button)
        buttons.addWidget(self.catalog_use_button)
        buttons.addStretch(1)
        buttons.addWidget(refresh)
        tab = QWidget()
        layout = QVBoxLayout(tab)
        layout.addWidget(self.catalog_table)
        layout.addLayout(buttons)
        return tab

    def _build_local_tab(self) -> QWidget:
        self.local_table = QTableWidget(0, 4)
        self.local_table.setAccessibleName("Local models")
        self.local_table.setHorizontalHeaderLabels(["Name", "Source", "Size", "Location"])
        self._table_defaults(self.local_table)
        self.local_table.horizontalHeader().setSectionResizeMode(3, QHeaderView.ResizeMode.Stretch)
        self.local_table.itemSelectionChanged.connect(self._update_buttons)
        import_folder = QPushButton("Import &folder…")
        import_folder.setAccessibleName("Import a Hugging Face model folder")
        import_folder.clicked.connect(self._on_import_folder_clicked)
        self.found_label = QLabel()
        self.found_label.setWordWrap(True)
        self.found_label.setAccessibleName("Problems with LM Studio and Ollama models")
        self.found_label.hide()
        import_gguf = QPushButton("Import .&gguf…")
        import_gguf.setAccessibleName("Import a GGUF file")
        import_gguf.clicked.connect(self._on_import_gguf_clicked)
        self.remove_button = QPushButton("Re&move…")
        self.remove_button.setAccessibleName("Remove the selected model")
        self.remove_button.clicked.connect(self._on_remove_clicked)
        QShortcut(QKeySequence.StandardKey.Delete, self.local_table, activated=self._on_remove_clicked)
        self.repo_edit = QLineEdit()
        self.repo_edit.setPlaceholderText("owner/name or owner/name:FILE.gguf")
        self.repo_edit.setAccessibleName("Hugging Face repo id to download")
        self.repo_edit.returnPressed.connect(self._on_repo_download_clicked)
        repo_button = QPushButton("Download &repo")
        repo_button.setAccessibleName("Download the repo id")
        repo_button.clicked.connect(self._on_repo_download_clicked)
        buttons = QHBoxLayout()
        for w in (import_folder, import_gguf, self.remove_button):
            buttons.addWidget(w)
        buttons.addStretch(1)
        buttons.addWidget(self.repo_edit, 1)
        buttons.addWidget(repo_button)
        tab = QWidget()
        layout = QVBoxLayout(tab)
        layout.addWidget(self.local_table)
        layout.addWidget(self.found_label)
        layout.addLayout(buttons)
        return tab

    @staticmethod
    def _table_defaults(table: QTableWidget) -> None:
        table.setSelectionBehavior(QAbstractItemView.SelectionBehavior.SelectRows)
        table.setSelectionMode(QAbstractItemView.SelectionMode.SingleSelection)
        table.setEditTriggers(QAbstractItemView.EditTrigger.NoEditTriggers)
        table.verticalHeader().setVisible(False)
        table.setAlternatingRowColors(True)
        table.horizontalHeader().setSectionResizeMode(QHeaderView.ResizeMode.ResizeToContents)
        table.horizontalHeader().setStretchLastSection(True)
        table.setMinimumHeight(110)  # a few rows stay visible in a small window

    # ---- state -----------------------------------------------------------------------------
    @property
    def models_dir(self) -> Path:
        return self._prefs.models_path()

    def local_models(self) -> list[LocalModel]:
        return list(self._local)

    def options(self) -> list[PairOption]:
        return list(self._options)

    def is_local(self, model_id: str) -> bool:
        return self._find_local(model_id) is not None

    def _find_local(self, spec: str) -> LocalModel | None:
        return match_local(self._local, spec, self._catalog.find(spec))

    def refresh(self) -> None:
        """Re-read the local models and the hardware profile; redraw everything."""
        self._prefs = self._store.load()
        self.folder_label.setText(f"Folder: {self.models_dir}")
        self.folder_label.setToolTip(str(self.models_dir))
        cache = self._hf_cache if self._hf_cache is not None else hf_hub_cache_dir()
        self.found = discover_models(facts=self._facts)  # LM Studio's and Ollama's GGUFs, used in place
        try:
            self._local = list_local_models(self.models_dir, cache, self.found.models)
        except OSError as exc:
            log.warning("cannot list %s: %s", self.models_dir, exc)
            self._local = []
        profile = load_profile()
        self._options = pair_options(self._catalog, profile)
        self.profile_label.setText("This computer: " + profile_headline(profile))
        self._fill_catalog()
        self._fill_local()
        self.found_label.setText("\n".join(f"⚠ {line}" for line in self.found.problems))
        self.found_label.setVisible(bool(self.found.problems))
        self._fill_pair_combos()
        self._update_buttons()

    def _fill_catalog(self) -> None:
        table = self.catalog_table
        selected = self.selected_option()
        table.setRowCount(len(self._options))
        for row, option in enumerate(self._options):
            on_disk = [m for m in (option.target, option.draft) if m and self.is_local(m)]
            needed = [m for m in (option.target, option.draft) if m]
            disk = "yes" if len(on_disk) == len(needed) else (f"{len(on_disk)} of {len(needed)}" if on_disk else "no")
            cells = [option.title, option.target, option.target_format, option.draft or "—",
                     format_bytes(option.download_bytes), option.fit_label, option.speed_text(), disk,
                     option.description]
            for col, text in enumerate(cells):
                item = QTableWidgetItem(text)
                item.setData(Qt.ItemDataRole.UserRole, option.pair_id)
                if col in (COL_PAIR, COL_SPEED, COL_ABOUT):
                    item.setToolTip(option.reason or option.description)
                if col == COL_FORMAT:
                    item.setToolTip(option.target_source)
                if col == COL_FIT:
                    item.setForeground(_colour("#ffffff"))
                    item.setBackground(_colour(FIT_COLOURS.get(option.fit, "#666666")))
                    item.setTextAlignment(Qt.AlignmentFlag.AlignCenter)
                    item.setToolTip(option.reason or option.fit_label)
                table.setItem(row, col, item)
        if selected is not None:
            self.select_pair(selected.pair_id)

    def _fill_local(self) -> None:
        table = self.local_table
        table.setRowCount(len(self._local))
        sources = {"hub": "downloaded", "import": "imported", "pypi-wheel": "PyPI wheel", "hf-cache": "HF cache",
                   **FOUND_SOURCES}
        for row, model in enumerate(self._local):
            size = format_bytes(model.size_bytes) + ("" if model.owns_files else " (not copied)")
            source = sources.get(model.source, model.source) + (f" · {model.detail}" if model.detail else "")
            for col, text in enumerate([model.model_id, source, size, str(model.path)]):
                item = QTableWidgetItem(text)
                item.setData(Qt.ItemDataRole.UserRole, model.model_id)
                table.setItem(row, col, item)

    def _fill_pair_combos(self) -> None:
        prefs = self._prefs
        self._fill_combo(self.target_combo, [m.model_id for m in self._local], prefs.target)
        self._fill_draft_combo(prefs.draft)
        draft = _short_name(prefs.draft) or "no draft"
        self.active_label.setText(f"In use: <b>{_short_name(prefs.target)}</b> + {draft}" if prefs.target
                                  else "No pair chosen yet")
        self.active_label.setToolTip(f"{prefs.target}\n{prefs.draft}" if prefs.target else "")

    def _on_target_combo_changed(self, _index: int) -> None:
        self._fill_draft_combo(self.draft_combo.currentData() or "")

    def _fill_draft_combo(self, current: str) -> None:
        """The drafts on offer: every local model but the chosen target (a model cannot draft for
        itself; it used to be offered, and choosing it silently meant no draft)."""
        target = self.target_combo.currentData() or ""
        names = [m.model_id for m in self._local if m.model_id != target]
        self._fill_combo(self.draft_combo, [NO_DRAFT, *names], current if current != target else "")

    @staticmethod
    def _fill_combo(combo: QComboBox, names: list[str], current: str) -> None:
        combo.blockSignals(True)
        combo.clear()
        for name in names:
            combo.addItem(name, "" if name == NO_DRAFT else name)
        if current and current not in names:
            combo.addItem(f"{current} (not downloaded)", current)
        combo.setCurrentIndex(max(combo.findData(current), 0))
        combo.blockSignals(False)

    def _update_buttons(self) -> None:
        option = self.selected_option()
        missing = option is not None and any(m and not self.is_local(m) for m in (option.target, option.draft))
        self.download_button.setEnabled(missing)
        self.catalog_use_button.setEnabled(option is not None and not missing)
        local = self.selected_local()  # LM Studio's and Ollama's own models are removed in those apps
        self.remove_button.setEnabled(local is not None and local.source not in FOUND_SOURCES)
        self.use_button.setEnabled(self.target_combo.count() > 0)

    def selected_option(self) -> PairOption | None:
        pair_id = _selected_key(self.catalog_table)
        return next((o for o in self._options if o.pair_id == pair_id), None) if pair_id is not None else None

    def select_pair(self, pair_id: str) -> None:
        for row in range(self.catalog_table.rowCount()):
            if self.catalog_table.item(row, 0).data(Qt.ItemDataRole.UserRole) == pair_id:
                self.catalog_table.selectRow(row)
                return

    def selected_local(self) -> LocalModel | None:
        name = _selected_key(self.local_table)
        return next((m for m in self._local if m.model_id == name), None) if name is not None else None

    # ---- actions ---------------------------------------------------------------------------
    def download(self, spec: str) -> bool:
        """Queue one model (catalog id or repo id); shows its row. False if already queued."""
        entry = self._catalog.find(spec)
        spec = entry.id if entry is not None else spec  # progress events name the catalog id
        if not self.queue.enqueue(spec):
            return False
        old = self.rows.pop(spec, None)
        if old is not None:
            old.deleteLater()
        row = DownloadRow(spec, self.queue)
        row.cleared.connect(self._on_row_cleared)
        row.retry_requested.connect(self.download)
        self.rows[spec] = row
        self.downloads_layout.insertWidget(self.downloads_layout.count() - 1, row)
        self.no_downloads.hide()
        return True

    def download_pair(self, option: PairOption) -> list[str]:
        started = [m for m in (option.target, option.draft) if m and not self.is_local(m) and self.download(m)]
        return started

    def set_active_pair(self, target: str, draft: str) -> None:
        self._prefs = replace(self._store.load(), target=target, draft=draft)
        self._store.save(self._prefs)  # -> _on_store_changed -> refresh
        self.active_pair_changed.emit(target, draft)

    def import_path(self, path: Path) -> LocalModel | None:
        try:
            model = import_model(path, self.models_dir)
        except EngineError as exc:
            QMessageBox.warning(self, "Cannot import", exc.user_message)
            return None
        self.refresh()
        return model

    def remove_local(self, model: LocalModel, confirm: bool = True) -> bool:
        if confirm:
            what = (f"This deletes {format_bytes(model.size_bytes)} in {model.path}." if model.owns_files
                    else f"The files at {model.path} stay where they are.")
            answer = QMessageBox.question(self, "Remove model", f"Remove {model.model_id}? {what}")
            if answer != QMessageBox.StandardButton.Yes:
                return False
        try:
            remove_model(model)
        except EngineError as exc:
            QMessageBox.warning(self, "Cannot remove", exc.user_message)
            return False
        self.refresh()
        return True

    def shutdown(self) -> None:
        """Cancel downloads (partial data kept) and stop the download thread."""
        self.queue.shutdown()

    # ---- slots -----------------------------------------------------------------------------
    def _on_download_clicked(self) -> None:
        option = self.selected_option()
        if option is not None:
            self.download_pair(option)

    def _on_catalog_use_clicked(self) -> None:
        option = self.selected_option()
        if option is not None and all(not m or self.is_local(m) for m in (option.target, option.draft)):
            self.set_active_pair(option.target, option.draft)

    def _on_use_clicked(self) -> None:
        target = self.target_combo.currentData() or ""
        draft = self.draft_combo.currentData() or ""
        if target:
            self.set_active_pair(target, "" if draft == target else draft)

    def _on_repo_download_clicked(self) -> None:
        spec = self.repo_edit.text().strip()
        if spec:
            self.download(spec)
            self.repo_edit.clear()

    def _on_import_folder_clicked(self) -> None:
        folder = QFileDialog.getExistingDirectory(self, "Import a Hugging Face model folder")
        if folder:
            self.import_path(Path(folder))

    def _on_import_gguf_clicked(self) -> None:
        path, _ = QFileDialog.getOpenFileName(self, "Import a GGUF file", "",
                                              "GGUF models (*.gguf);;All files, e.g. an Ollama blob (*)")
        if path:
            self.import_path(Path(path))

    def _on_remove_clicked(self) -> None:
        model = self.selected_local()
        if model is not None:
            self.remove_local(model)

    def _on_store_changed(self, prefs: Preferences) -> None:
        if prefs.models_path() != self.models_dir and not self.queue.active():
            self.queue.shutdown()
            self.queue = self._make_queue(prefs.models_path())
        self.refresh()

    def _on_row_cleared(self, spec: str) -> None:
        row = self.rows.pop(spec, None)
        if row is not None:
            row.deleteLater()
        self.no_downloads.setVisible(not self.rows)

    def _on_queue_progressed(self, event: DownloadProgress) -> None:
        row = self.rows.get(event.model_id)
        if row is not None:
            row.update_progress(event)

    def _on_queue_finished(self, spec: str, path: str) -> None:
        row = self.rows.get(spec)
        if row is not None:
            row.finish("done", f"Done · {path}")
        self.refresh()
        self.download_finished.emit(spec, path)

    def _on_queue_failed(self, spec: str, message: str) -> None:
        row = self.rows.get(spec)
        if row is not None:
            row.finish("failed", message)

    def _on_queue_cancelled(self, spec: str) -> None:
        row = self.rows.get(spec)
        if row is not None:
            row.finish("cancelled", "Cancelled · the partial data is kept; download again to resume")


def _colour(name: str):  # type: ignore[no-untyped-def]
    from PySide6.QtGui import QBrush, QColor

    return QBrush(QColor(name))


def _short_name(spec: str) -> str:
    """A model as the page names it: a local path by its folder or file name (the full path is
    in the tooltip), a catalog or repo id as it is."""
    return Path(spec).name if spec and ("/" in spec or "\\" in spec) and Path(spec).expanduser().exists() else spec


def _selected_key(table: QTableWidget) -> str | None:
    """The key (UserRole data of column 0) of a table's selected row, or None."""
    model = table.selectionModel()
    rows = model.selectedRows() if model is not None else []
    return table.item(rows[0].row(), 0).data(Qt.ItemDataRole.UserRole) if rows else None
