"""The models page: catalog pairs with fit and predicted speed, downloads, local models, the active pair.

Layout, top to bottom: the active pair (two combo boxes over the local models and a "Use this
pair" button), a line about this computer's hardware profile, two tabs — "Catalog" (every pair
with its fit badge and the planner's tok/s on this machine) and "On this computer" (local models
with sizes, plus the GGUFs LM Studio and Ollama keep, used where they are; import, remove,
download by repo id) — and the download queue (a progress bar, speed,
ETA, pause/resume and cancel per model).

Downloads run in a `DownloadQueue` (app/workers/download_worker.py); the page only reacts to its signals.
A download of a pair that does not fit, a large one or one over the free disk space is confirmed
first through the injected `confirm` (app/models/downloads.py). Choosing a pair saves it into the
preferences and emits `active_pair_changed`.

The catalog's starter is the one folder every part of SpecChat runs (engine.loading.starter:
PyPI's Q4_1 GGUF converted once to FP32, in the cache): it is listed and chosen as that folder,
never copied into the models folder. Speeds are what this computer measured for a pair, else the
planner's prediction labelled as one (app/models/recommend.py); the active pair's line says what runs
(`set_running`: format, where the layers live, the decoding mode, the measured speed).
"""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path

from PySide6.QtCore import Qt, Signal
from PySide6.QtGui import QKeySequence, QShortcut, QShowEvent
from PySide6.QtWidgets import (
    QComboBox,
    QFileDialog,
    QFrame,
    QGroupBox,
    QHBoxLayout,
    QHeaderView,
    QLabel,
    QLineEdit,
    QMessageBox,
    QPushButton,
    QScrollArea,
    QTableWidget,
    QTabWidget,
    QVBoxLayout,
    QWidget,
)

from app.models.downloads import Confirm, DownloadRow, confirm_with_dialog
from app.models.recommend import (
    PairOption,
    download_bytes,
    download_warning,
    load_profile,
    pair_options,
    profile_headline,
)
from app.models.tables import (
    CATALOG_COLUMNS,
    COL_FIT,
    COL_SPEED,
    FIT_COLOURS,
    fill_catalog,
    fill_local,
    selected_key,
    table_defaults,
)
from app.state.preferences import Preferences
from app.state.preferences_store import PreferencesStore
from app.state.running import RunningPair
from app.widgets.status import ElidedLabel
from app.workers.download_worker import DownloadOptions, DownloadQueue, StarterSource
from engine import paths
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
from engine.store.pypi import starter_local_model
from engine.store.registry import FOUND_SOURCES, match_local
from engine.types import DownloadProgress
from engine.units import format_bytes

log = logging.getLogger(__name__)

NO_DRAFT = "(no draft)"
__all__ = ["CATALOG_COLUMNS", "COL_FIT", "COL_SPEED", "FIT_COLOURS", "ModelsPage"]


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
        hf_cache_dir: Path | None = None, catalog: Catalog | None = None, confirm: Confirm | None = None,
        running: RunningPair | None = None,
    ) -> None:
        super().__init__(parent)
        self.setAccessibleName("Models page")
        self._store = store
        self._catalog = catalog or load_catalog()
        self.confirm: Confirm = confirm or confirm_with_dialog(self)
        self._running = running
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
        table_defaults(self.catalog_table)
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
        table_defaults(self.local_table)
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
        if spec and spec == self._catalog.starter:  # the one starter folder, never a models-folder copy
            return next((m for m in self._local if m.model_id == spec and m.source == "pypi-wheel"
                         and m.path.is_dir()), None)
        return match_local(self._local, spec, self._catalog.find(spec))

    def _locate(self, spec: str) -> Path | None:
        model = self._find_local(spec)
        return model.path if model is not None else None

    def _pref_spec(self, spec: str) -> str:
        """How the preferences name a model: the starter by its folder (what loads), others by id."""
        path = self._locate(spec) if spec and spec == self._catalog.starter else None
        return str(path) if path is not None else spec

    def showEvent(self, event: QShowEvent) -> None:  # noqa: N802
        """Answers given since the page was last shown changed what was measured: redraw."""
        super().showEvent(event)
        self.refresh()

    def set_running(self, running: RunningPair | None) -> None:
        """What the engine has loaded (None: nothing); the active pair's line describes it."""
        self._running = running
        self._fill_pair_combos()

    def refresh(self) -> None:
        """Re-read the local models and the hardware profile; redraw everything."""
        self._prefs = self._store.load()
        self.folder_label.setText(f"Folder: {self.models_dir}")
        self.folder_label.setToolTip(str(self.models_dir))
        cache = self._hf_cache if self._hf_cache is not None else hf_hub_cache_dir()
        self.found = discover_models(facts=self._facts)  # LM Studio's and Ollama's GGUFs, used in place
        starter = starter_local_model(self._catalog.starter, paths.cache_dir()) if self._catalog.starter else None
        try:
            self._local = [starter] if starter is not None else []
            self._local += list_local_models(self.models_dir, cache, self.found.models)
        except OSError as exc:
            log.warning("cannot list %s: %s", self.models_dir, exc)
        profile = load_profile()
        self._options = pair_options(self._catalog, profile, locate=self._locate)
        self.profile_label.setText("This computer: " + profile_headline(profile))
        self._fill_catalog()
        self._fill_local()
        self.found_label.setText("\n".join(f"⚠ {line}" for line in self.found.problems))
        self.found_label.setVisible(bool(self.found.problems))
        self._fill_pair_combos()
        self._update_buttons()

    def _fill_catalog(self) -> None:
        selected = self.selected_option()
        fill_catalog(self.catalog_table, self._options, self.is_local)
        if selected is not None:
            self.select_pair(selected.pair_id)

    def _fill_local(self) -> None:
        fill_local(self.local_table, self._local)

    def _fill_pair_combos(self) -> None:
        prefs = self._prefs
        self._fill_combo(self.target_combo, [m.model_id for m in self._local], self._combo_name(prefs.target))
        self._fill_draft_combo(self._combo_name(prefs.draft))
        draft = _short_name(prefs.draft) or "no draft"
        running = self._running
        if running is not None:  # what the engine loaded, read from it: format, layers, decoding, speed
            self.active_label.setText(f"Running: {running.summary()}")
        else:
            self.active_label.setText(f"Chosen: <b>{_short_name(prefs.target)}</b> + {draft} (not loaded)"
                                      if prefs.target else "No pair chosen yet")
        self.active_label.setToolTip(f"{prefs.target}\n{prefs.draft}" if prefs.target else "")

    def _combo_name(self, spec: str) -> str:
        """A preference as the combos list it: the starter's folder by the catalog's starter id."""
        starter = self._locate(self._catalog.starter) if self._catalog.starter else None
        if spec and starter is not None and Path(spec).expanduser() == starter:
            return self._catalog.starter
        return spec

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
        pair_id = selected_key(self.catalog_table)
        return next((o for o in self._options if o.pair_id == pair_id), None) if pair_id is not None else None

    def select_pair(self, pair_id: str) -> None:
        for row in range(self.catalog_table.rowCount()):
            if self.catalog_table.item(row, 0).data(Qt.ItemDataRole.UserRole) == pair_id:
                self.catalog_table.selectRow(row)
                return

    def selected_local(self) -> LocalModel | None:
        name = selected_key(self.local_table)
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
        """Queue the pair's missing models, after a confirmation when the download deserves one
        (recommend.download_warning); [] when the user says no."""
        missing = [m for m in (option.target, option.draft) if m and not self.is_local(m)]
        entries = [e for e in (self._catalog.find(m) for m in missing) if e is not None]
        warning = download_warning(option, sum(download_bytes(e, self._catalog.starter) for e in entries),
                                   self.models_dir)
        if warning and not self.confirm("Download this pair?", warning):
            return []
        return [m for m in missing if self.download(m)]

    def set_active_pair(self, target: str, draft: str) -> None:
        target, draft = self._pref_spec(target), self._pref_spec(draft)
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


def _short_name(spec: str) -> str:
    """A model as the page names it: a local path by its folder or file name (the full path is
    in the tooltip), a catalog or repo id as it is."""
    return Path(spec).name if spec and ("/" in spec or "\\" in spec) and Path(spec).expanduser().exists() else spec
