"""The models page: catalog pairs with fit and speed, downloads, local models, the active pair.

Layout, top to bottom: the active pair (pair_box: two combo boxes over the local models and
"Use this pair"), a line about this computer's hardware profile, two tabs, "Catalog"
(catalog_tab: every pair with its fit badge and the speed measured here or predicted) and "On
this computer" (local_tab: local models with sizes, the GGUFs LM Studio and Ollama keep, used
where they are, damaged ones marked; import, remove, download by repo id), and the downloads
(downloads: a progress bar, speed, ETA, pause/resume and cancel per model). This module composes
them and owns what they share: the local models, the pair options, the download queue.

Slow work runs in worker threads: downloads in a `DownloadQueue` (app/workers/download_worker.py),
the disk scan (LM Studio's and Ollama's folders, whether each model's files are whole) in a
`ScanHost` (app/workers/scan_worker.py). `refresh()` redraws at once from the models folder and
the last scan, then again when a new scan comes back (`scanning` says whether one is under way).
A download of a pair that does not fit, a large one or one over the free disk space is confirmed
first, and removing a model too, through the injected `dialogs` (app/widgets/dialogs.py).
Choosing a pair saves it into the preferences and emits `active_pair_changed`.

The catalog's starter is the one file every part of SpecChat runs (engine.loading.starter:
PyPI's Q4_1 GGUF, in the cache, run as it is): it is listed and chosen as that file, never
copied into the models folder. Speeds are what this computer measured for a pair, else the
planner's prediction labelled as one (app/models/recommend.py); the active pair's line says what
runs (`set_running`: format, where the layers live, the decoding mode, the measured speed).
"""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path

from PySide6.QtCore import Qt, Signal
from PySide6.QtGui import QKeySequence, QShortcut, QShowEvent
from PySide6.QtWidgets import QHBoxLayout, QLabel, QTabWidget, QVBoxLayout, QWidget

from app.models.catalog_tab import CatalogTab
from app.models.downloads import DownloadsBox
from app.models.local_tab import LocalTab
from app.models.pair_box import PairBox
from app.models.recommend import (
    PairOption,
    download_bytes,
    download_warning,
    load_profile,
    pair_options,
    profile_headline,
)
from app.models.tables import CATALOG_COLUMNS, COL_FIT, COL_SPEED, FIT_COLOURS
from app.state.preferences import Preferences
from app.state.preferences_store import PreferencesStore
from app.state.running import RunningPair
from app.widgets.dialogs import Dialogs
from app.widgets.field_row import ElidedLabel
from app.workers.download_worker import DownloadOptions, DownloadQueue, StarterSource
from app.workers.scan_worker import DiskScan, ScanHost
from engine import paths
from engine.decoding.draft_menu import DraftEntry, head_entries
from engine.errors import EngineError
from engine.store import (
    Discovery,
    DownloadSettings,
    LocalModel,
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
        hf_cache_dir: Path | None = None, catalog: Catalog | None = None, dialogs: Dialogs | None = None,
        running: RunningPair | None = None,
    ) -> None:
        super().__init__(parent)
        self.setAccessibleName("Models page")
        self._store = store
        self._catalog = catalog or load_catalog()
        self.dialogs = dialogs or Dialogs.over(self)
        self._running = running
        self._prefs = store.load()
        self._hf_cache = hf_cache_dir
        self._local: list[LocalModel] = []
        self.found = Discovery((), ())  # the last scan's: LM Studio's and Ollama's models
        self._damage: dict[Path, str] = {}  # the last scan's: why each damaged model is damaged
        self._options: list[PairOption] = []
        self._download_options = DownloadOptions(  # the models folder follows the preferences
            models_dir=self._prefs.models_path(), endpoint=endpoint, settings=download_settings or DownloadSettings(),
            hf_cache_dir=hf_cache_dir, starter_source=starter_source)
        self.queue = self._make_queue(self._prefs.models_path())
        self.scanner = ScanHost(self)
        self.scanner.worker.scanned.connect(self._on_scanner_scanned)
        self._scanned = 0  # the id of the last scan that came back
        self._build()
        store.changed.connect(self._on_store_changed)
        self.refresh()

    # ---- construction ----------------------------------------------------------------------
    def _make_queue(self, models_dir: Path) -> DownloadQueue:
        queue = DownloadQueue(replace(self._download_options, models_dir=models_dir), self)
        queue.progressed.connect(self._on_queue_progressed)
        queue.finished.connect(self._on_queue_finished)
        queue.failed.connect(self._on_queue_failed)
        queue.cancelled.connect(self._on_queue_cancelled)
        return queue

    def _build(self) -> None:
        self.folder_label = ElidedLabel()  # a long path elides (full in its tooltip): the page fits half a screen
        self.folder_label.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.folder_label.setAccessibleName("Models folder")
        header = QHBoxLayout()
        header.addWidget(QLabel("<h2>Models</h2>"))
        header.addStretch(1)
        header.addWidget(self.folder_label)
        self.pair = PairBox()
        self.pair.heads_for = self._heads_for
        self._heads: dict[Path, list[DraftEntry]] = {}  # by target path, until the next listing
        self.pair.use_requested.connect(self.set_active_pair)
        self.profile_label = QLabel()
        self.profile_label.setWordWrap(True)
        self.profile_label.setAccessibleName("This computer")
        self.catalog = CatalogTab()
        self.catalog.download_requested.connect(self.download_pair)
        self.catalog.use_requested.connect(self._on_catalog_use_requested)
        self.catalog.refresh_requested.connect(self.refresh)
        self.local = LocalTab(self.dialogs)
        self.local.import_requested.connect(self.import_path)
        self.local.remove_requested.connect(self.remove_local)
        self.local.download_requested.connect(self.download)
        self.tabs = QTabWidget()
        self.tabs.setAccessibleName("Model lists")
        self.tabs.addTab(self.catalog, "&Catalog")
        self.tabs.addTab(self.local, "On this &computer")
        self.downloads = DownloadsBox()
        self.downloads.retry_requested.connect(self.download)
        layout = QVBoxLayout(self)
        layout.addLayout(header)
        layout.addWidget(self.pair)
        layout.addWidget(self.profile_label)
        layout.addWidget(self.tabs, 2)
        layout.addWidget(self.downloads, 1)
        QShortcut(QKeySequence.StandardKey.Refresh, self).activated.connect(self.refresh)
        QShortcut(QKeySequence("Ctrl+I"), self).activated.connect(self.local.import_folder)

    # ---- state -----------------------------------------------------------------------------
    @property
    def models_dir(self) -> Path:
        return self._prefs.models_path()

    @property
    def scanning(self) -> bool:
        """A disk scan is under way (its result redraws the page)."""
        return self._scanned != self.scanner.latest

    def local_models(self) -> list[LocalModel]:
        return list(self._local)

    def options(self) -> list[PairOption]:
        return list(self._options)

    def damage(self) -> dict[Path, str]:
        """Why each damaged local model is damaged, by path (the last scan's)."""
        return dict(self._damage)

    def is_local(self, model_id: str) -> bool:
        return self._find_local(model_id) is not None

    def _find_local(self, spec: str) -> LocalModel | None:
        if spec and spec == self._catalog.starter:  # the one starter GGUF, never a models-folder copy
            return next((m for m in self._local if m.model_id == spec and m.source == "pypi-wheel"
                         and m.path.is_file() and m.path.parent == paths.cache_dir() / "starter"), None)
        return match_local(self._local, spec, self._catalog.find(spec))

    def _locate(self, spec: str) -> Path | None:
        model = self._find_local(spec)
        return model.path if model is not None else None

    def _heads_for(self, name: str) -> list[DraftEntry]:
        """The heads the local model `name` brings (draft_menu: config files and headers only),
        kept until the models are listed again."""
        path = self._locate(name)
        if path is None:
            return []
        if path not in self._heads:
            self._heads[path] = head_entries(path)
        return self._heads[path]

    def _pref_spec(self, spec: str) -> str:
        """How the preferences name a model: the starter by its GGUF (what loads), others by id."""
        path = self._locate(spec) if spec and spec == self._catalog.starter else None
        return str(path) if path is not None else spec

    def _combo_name(self, spec: str) -> str:
        """A preference as the combos list it: the starter's GGUF by the catalog's starter id."""
        starter = self._locate(self._catalog.starter) if self._catalog.starter else None
        if spec and starter is not None and Path(spec).expanduser() == starter:
            return self._catalog.starter
        return spec

    def selected_option(self) -> PairOption | None:
        return self.catalog.selected_option()

    def select_pair(self, pair_id: str) -> None:
        self.catalog.select_pair(pair_id)

    def selected_local(self) -> LocalModel | None:
        return self.local.selected_local()

    def showEvent(self, event: QShowEvent) -> None:  # noqa: N802
        """Answers given since the page was last shown changed what was measured: redraw."""
        super().showEvent(event)
        self.refresh()

    def set_running(self, running: RunningPair | None) -> None:
        """What the engine has loaded (None: nothing); the active pair's line describes it."""
        self._running = running
        self._show_pair()

    # ---- drawing ---------------------------------------------------------------------------
    def refresh(self) -> None:
        """Re-read the models folder and the hardware profile and redraw now; scan the disk (LM
        Studio, Ollama, damaged files) in the scan thread, which redraws again when it is done."""
        self._prefs = self._store.load()
        self.folder_label.setText(f"Folder: {self.models_dir}")
        self.folder_label.setToolTip(str(self.models_dir))
        self._relist()
        self.scanner.scan(tuple(m.path for m in self._local if m.source not in FOUND_SOURCES))

    def _relist(self) -> None:
        """List the local models (with the last scan's found ones) and redraw every part."""
        cache = self._hf_cache if self._hf_cache is not None else hf_hub_cache_dir()
        starter = starter_local_model(self._catalog.starter, paths.cache_dir()) if self._catalog.starter else None
        try:
            self._local = [starter] if starter is not None else []
            self._local += list_local_models(self.models_dir, cache, self.found.models)
        except OSError as exc:
            log.warning("cannot list %s: %s", self.models_dir, exc)
        profile = load_profile()
        self._options = pair_options(self._catalog, profile, locate=self._locate)
        self.profile_label.setText("This computer: " + profile_headline(profile))
        self._heads.clear()  # a head downloaded or removed shows at the next listing
        self.catalog.fill(self._options, self.is_local)
        self.local.fill(self._local, self._damage, self.found.problems)
        self._show_pair()

    def _show_pair(self) -> None:
        prefs, running = self._prefs, self._running
        draft = DRAFT_WORDS.get(prefs.draft) or _short_name(prefs.draft)
        if running is not None:  # what the engine loaded, read from it: format, layers, decoding, speed
            line = f"Running: {running.summary()}"
        else:
            line = f"Chosen: <b>{_short_name(prefs.target)}</b> + {draft} (not loaded)" if prefs.target \
                else "No pair chosen yet"
        tip = f"{prefs.target}\n{prefs.draft}" if prefs.target else ""
        self.pair.show_pair([m.model_id for m in self._local], self._combo_name(prefs.target),
                            self._combo_name(prefs.draft), line, tip)

    def _on_scanner_scanned(self, request_id: int, scan: DiskScan) -> None:
        self._scanned = max(self._scanned, request_id)
        if request_id != self.scanner.latest:
            return  # a newer scan is under way: its result redraws
        self.found, self._damage = scan.found, dict(scan.damage)
        self._relist()

    # ---- actions ---------------------------------------------------------------------------
    def download(self, spec: str) -> bool:
        """Queue one model (catalog id or repo id); shows its row. False if already queued."""
        entry = self._catalog.find(spec)
        spec = entry.id if entry is not None else spec  # progress events name the catalog id
        if not self.queue.enqueue(spec):
            return False
        self.downloads.add(spec, self.queue)
        return True

    def download_pair(self, option: PairOption) -> list[str]:
        """Queue the pair's missing models, after a confirmation when the download deserves one
        (recommend.download_warning); [] when the user says no."""
        missing = [m for m in (option.target, option.draft) if m and not self.is_local(m)]
        entries = [e for e in (self._catalog.find(m) for m in missing) if e is not None]
        warning = download_warning(option, sum(download_bytes(e, self._catalog.starter) for e in entries),
                                   self.models_dir)
        if warning and not self.dialogs.confirm("Download this pair?", warning):
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
            self.dialogs.warn("Cannot import", exc.user_message)
            return None
        self.refresh()
        return model

    def remove_local(self, model: LocalModel, confirm: bool = True) -> bool:
        if confirm:
            what = (f"This deletes {format_bytes(model.size_bytes)} in {model.path}." if model.owns_files
                    else f"The files at {model.path} stay where they are.")
            if not self.dialogs.confirm("Remove model", f"Remove {model.model_id}? {what}"):
                return False
        try:
            remove_model(model)
        except EngineError as exc:
            self.dialogs.warn("Cannot remove", exc.user_message)
            return False
        self.refresh()
        return True

    def shutdown(self) -> None:
        """Cancel downloads (partial data kept); stop the download and scan threads."""
        self.queue.shutdown()
        self.scanner.shutdown()

    # ---- slots -----------------------------------------------------------------------------
    def _on_catalog_use_requested(self, option: PairOption) -> None:
        self.set_active_pair(option.target, option.draft)

    def _on_store_changed(self, prefs: Preferences) -> None:
        if prefs.models_path() != self.models_dir and not self.queue.active():
            self.queue.shutdown()
            self.queue = self._make_queue(prefs.models_path())
        self.refresh()

    def _on_queue_progressed(self, event: DownloadProgress) -> None:
        self.downloads.progress(event)

    def _on_queue_finished(self, spec: str, path: str) -> None:
        self.downloads.finish(spec, "done", f"Done · {path}")
        self.refresh()
        self.download_finished.emit(spec, path)

    def _on_queue_failed(self, spec: str, message: str) -> None:
        self.downloads.finish(spec, "failed", message)

    def _on_queue_cancelled(self, spec: str) -> None:
        self.downloads.finish(spec, "cancelled", "Cancelled · the partial data is kept; download again to resume")


DRAFT_WORDS = {"": "no draft", "none": "no draft", "auto": "the draft the engine picks", "self": "a self-draft",
               "mtp": "the model's MTP head", **{f"self:{b}": f"a {b}-bit self-draft" for b in (2, 3, 4)}}


def _short_name(spec: str) -> str:
    """A model as the page names it: a local path by its folder or file name (the full path is
    in the tooltip), a catalog or repo id as it is."""
    return Path(spec).name if spec and ("/" in spec or "\\" in spec) and Path(spec).expanduser().exists() else spec
