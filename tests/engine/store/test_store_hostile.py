"""The model store against hostile listings, damaged state files, read-only and full disks and
HF_HUB_OFFLINE (issue 18): each ends in exactly one `error:` line with exit code 1 (2 for a
bad command line), or in one warning and a store that keeps working. No traceback, and nothing
written outside the models folder."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from filesystems import read_only, small_disk
from hub_server import FakeRepo, HubServer, make_model_files
from test_store_registry import make_cache_snapshot, make_hf_folder

from engine.cli.main import main
from engine.errors import DiskFull
from engine.store import download_model, resolve_model
from engine.store.transfer import DownloadSettings
from engine.types import DownloadProgress

REPO = Path(__file__).resolve().parents[3]
WEIGHTS = "model.safetensors"


def cli(capsys: pytest.CaptureFixture[str], *argv: object) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    assert "Traceback" not in err
    return code, out, err


def one_error(err: str) -> str:
    """The one `error:` line of a failed command (progress lines may come before it)."""
    [line] = [line for line in err.splitlines() if line.startswith("error: ")]
    return line


def snapshot_of(root: Path) -> set[Path]:
    return set(root.rglob("*"))


# ---- names from outside never become paths outside the folder --------------------------------------
@pytest.mark.parametrize("name", ["../../escape.gguf", "sub/../../../escape.gguf", "..\\escape.gguf"])
def test_a_hostile_name_in_the_listing_is_refused_when_the_repo_is_asked_for_whole(
        hub: HubServer, models_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], name: str) -> None:
    hub.add_repo(FakeRepo("evil/model", {name: b"GGUF" + b"\0" * 64, "README.md": b"hi"}))
    before = snapshot_of(tmp_path)
    code, out, err = cli(capsys, "models", "download", "evil/model", "--models-dir", models_dir)
    assert code == 1 and out == ""
    assert "evil/model" in one_error(err) and "outside" in one_error(err)
    assert all(p.is_relative_to(models_dir) for p in snapshot_of(tmp_path) - before)
    assert not [r for r in hub.requests if "/resolve/" in r.path]  # not one byte fetched


@pytest.mark.parametrize("spec", ["evil/model:..\\..\\escape.gguf", "evil/model:../escape.gguf",
                                  "evil/model:q4//x.gguf", "evil/model:/tmp/escape.gguf"])
def test_a_hostile_file_name_on_the_command_line_is_refused_before_anything_is_written(
        hub: HubServer, models_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], spec: str) -> None:
    before = snapshot_of(tmp_path)
    code, out, err = cli(capsys, "models", "download", spec, "--models-dir", models_dir)
    assert code == 1 and out == "" and "outside" in one_error(err)
    assert snapshot_of(tmp_path) == before and hub.requests == []


def test_a_gguf_in_a_sub_folder_of_the_repo_downloads_into_the_models_folder(
        hub: HubServer, models_dir: Path, settings: DownloadSettings) -> None:
    q4, q8 = b"GGUF" + bytes(range(256)) * 20, b"GGUF" + bytes(range(255, -1, -1)) * 30
    hub.add_repo(FakeRepo("someone/sub-GGUF", {"q4/tiny.Q4_K_M.gguf": q4, "README.md": b"x"}))
    hub.add_repo(FakeRepo("someone/two-GGUF", {"q4/tiny.Q4_K_M.gguf": q4, "q8/tiny.Q8_0.gguf": q8}))
    only = download_model("someone/sub-GGUF", models_dir, settings=settings)
    picked = download_model("someone/two-GGUF:q8/tiny.Q8_0.gguf", models_dir, settings=settings)
    assert only.read_bytes() == q4 and picked.read_bytes() == q8
    assert only.is_relative_to(models_dir) and picked.is_relative_to(models_dir)
    assert resolve_model("someone/sub-GGUF", models_dir) == only
    assert not list((models_dir / ".partial").rglob("*.part"))


def test_import_names_and_manifest_paths_stay_inside_the_models_folder(
        tmp_path: Path, models_dir: Path, capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture) -> None:
    folder = make_hf_folder(tmp_path / "source")
    before = snapshot_of(tmp_path)
    for name in ("../escape", "a/b", "..", ".hidden", "x" * 200):
        code, out, err = cli(capsys, "models", "import", folder, "--name", name, "--copy", "--models-dir", models_dir)
        assert code == 2 and out == "" and len(err.splitlines()) == 1 and "import name" in err, name
    assert snapshot_of(tmp_path) == before
    # a manifest (written by anyone) whose relative path leaves its folder is not listed
    bad = models_dir / "bad"
    bad.mkdir(parents=True)
    (bad / "specchat-model.json").write_text(json.dumps({
        "model_id": "bad", "source": "hub", "path": "../../source/config.json", "files": []}))
    (models_dir / "worse").mkdir()
    (models_dir / "worse" / "specchat-model.json").write_text("[1, 2]")
    code, out, err = cli(capsys, "models", "list", "--json", "--models-dir", models_dir)
    assert code == 0 and json.loads(out)["local"] == []
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]  # stderr in a real process
    assert len(warnings) == 2 and all("ignoring the damaged manifest" in w for w in warnings), warnings


def test_importing_a_symlink_loop_is_one_error_line(tmp_path: Path, models_dir: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "a").symlink_to(tmp_path / "b")
    (tmp_path / "b").symlink_to(tmp_path / "a")
    code, out, err = cli(capsys, "models", "import", tmp_path / "a", "--models-dir", models_dir)
    assert code == 1 and out == "" and len(err.splitlines()) == 1 and "leads back to itself" in err
    folder = make_hf_folder(tmp_path / "model")
    (folder / "shard.safetensors").symlink_to(folder / "shard.safetensors")
    code, out, err = cli(capsys, "models", "import", folder, "--models-dir", models_dir)
    assert code == 1 and out == "" and len(err.splitlines()) == 1 and "shard.safetensors" in err
    assert not models_dir.exists()


# ---- HF_HUB_OFFLINE ----------------------------------------------------------------------------------
@pytest.mark.parametrize("spec", ["someone/only-on-the-hub", "smollm2-135m-instruct"])
def test_hf_hub_offline_fails_at_once_and_names_the_setting(
        hub: HubServer, models_dir: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
        spec: str) -> None:
    hub.add_repo(FakeRepo("someone/only-on-the-hub", make_model_files()))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    started = time.perf_counter()
    code, out, err = cli(capsys, "models", "download", spec, "--models-dir", models_dir)
    assert code == 1 and out == ""
    line = one_error(err)
    assert "HF_HUB_OFFLINE=1" in line and "internet" not in line
    assert time.perf_counter() - started < 2.0  # no retries, no PyPI fallback for the starter
    assert hub.requests == []


# ---- read-only and full disks -----------------------------------------------------------------------
def test_a_read_only_models_folder_is_one_error_line_naming_it(
        hub: HubServer, models_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    hub.add_repo(FakeRepo("someone/model", make_model_files()))
    models_dir.mkdir()
    with read_only(models_dir):
        code, out, err = cli(capsys, "models", "download", "someone/model", "--models-dir", models_dir)
    assert code == 1 and out == ""
    line = one_error(err)
    assert str(models_dir) in line and "--models-dir" in line and "writable" in line
    assert list(models_dir.iterdir()) == []


def test_disk_full_while_writing_the_bookkeeping_keeps_the_data_and_resumes(
        hub: HubServer, tmp_path: Path, settings: DownloadSettings, capsys: pytest.CaptureFixture[str]) -> None:
    repo = hub.add_repo(FakeRepo("someone/model", make_model_files()))
    with small_disk(tmp_path / "disk", 4 << 20) as disk:
        models_dir = disk / "models"
        filler = disk / "filler"

        def fill_after_the_last_byte(event: DownloadProgress) -> None:
            """Another program takes every free block the moment the data is complete."""
            if event.state == "verifying" and event.bytes_done == event.bytes_total and not filler.exists():
                with filler.open("wb") as handle, pytest.raises(OSError):
                    while True:
                        handle.write(b"\0" * 65536)
                        handle.flush()

        with pytest.raises(DiskFull) as caught:
            download_model("someone/model", models_dir, settings=settings, on_progress=fill_after_the_last_byte)
        assert "full" in caught.value.user_message and "kept" in caught.value.user_message
        partial = models_dir / ".partial" / "someone--model"
        assert (partial / WEIGHTS).read_bytes() == repo.files[WEIGHTS]  # the data survived
        served = hub.bytes_served(WEIGHTS)

        filler.unlink()  # space is freed
        path = download_model("someone/model", models_dir, settings=settings)
        assert (path / WEIGHTS).read_bytes() == repo.files[WEIGHTS]
        assert hub.bytes_served(WEIGHTS) == served  # resumed: the data was not fetched again


def test_a_full_disk_before_the_download_is_one_error_line(
        hub: HubServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    hub.add_repo(FakeRepo("someone/model", make_model_files()))
    with small_disk(tmp_path / "disk", 256 << 10) as disk:
        code, out, err = cli(capsys, "models", "download", "someone/model", "--models-dir", disk / "models")
    assert code == 1 and out == "" and "short" in one_error(err)


# ---- damaged state files ----------------------------------------------------------------------------
def test_a_damaged_download_state_is_ignored(hub: HubServer, models_dir: Path, settings: DownloadSettings) -> None:
    repo = hub.add_repo(FakeRepo("someone/model", make_model_files()))
    partial = models_dir / ".partial" / "someone--model"
    partial.mkdir(parents=True)
    (partial / "download-state.json").write_text('["not", "a", "state"]')
    path = download_model("someone/model", models_dir, settings=settings)
    assert (path / WEIGHTS).read_bytes() == repo.files[WEIGHTS]


def test_damaged_hugging_face_cache_entries_are_skipped_with_a_warning(
        tmp_path: Path, models_dir: Path, capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture) -> None:
    cache = tmp_path / "hf" / "hub"
    good = {"config.json": b'{"model_type": "llama"}', WEIGHTS: b"\0" * 64}
    make_cache_snapshot(cache, "good/model", "a" * 40, good)
    # refs that name no commit: a path out of the cache, undecodable bytes; the snapshots still count
    for repo_id, ref in (("climbs/out", b"../../.."), ("binary/ref", b"\xff\xfe\x00\x01")):
        make_cache_snapshot(cache, repo_id, "b" * 40, good)
        (cache / f"models--{repo_id.replace('/', '--')}" / "refs" / "main").write_bytes(ref)
    make_cache_snapshot(cache, "index/list", "c" * 40, {**good, "model.safetensors.index.json": b"[]"})
    make_cache_snapshot(cache, "index/map", "d" * 40, {**good, "model.safetensors.index.json": b'{"weight_map": 7}'})
    (cache / "models--file--repo").write_text("a file where a folder should be")
    code, out, err = cli(capsys, "models", "list", "--json", "--models-dir", models_dir)
    assert code == 0
    assert sorted(m["id"] for m in json.loads(out)["local"]) == ["binary/ref", "climbs/out", "good/model"]
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]  # stderr in a real process
    assert len(warnings) == 4 and all("Hugging Face cache" in w for w in warnings), warnings
    assert resolve_model("index/list", models_dir) is None


@pytest.mark.parametrize("catalog", ["[]", '{"schema_version": 1}', '{"schema_version": 1, "models": [1]}'])
def test_a_damaged_catalog_leaves_local_models_usable(tmp_path: Path, models_dir: Path, catalog: str) -> None:
    """A real process whose installed catalog file (the specchat_resources package) is damaged."""
    resources = tmp_path / "site" / "specchat_resources"
    resources.mkdir(parents=True)
    (resources / "__init__.py").write_text("")
    (resources / "catalog.json").write_text(catalog)
    folder = make_hf_folder(tmp_path / "mine")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path / "site"), str(REPO)])}
    run = [sys.executable, "-m", "engine", "models"]
    imported = subprocess.run([*run, "import", str(folder), "--models-dir", str(models_dir)], cwd=REPO, env=env,
                              capture_output=True, text=True, timeout=120)
    assert imported.returncode == 0, imported.stderr
    listed = subprocess.run([*run, "list", "--json", "--models-dir", str(models_dir)], cwd=REPO, env=env,
                            capture_output=True, text=True, timeout=120)
    assert listed.returncode == 0 and "Traceback" not in listed.stderr
    assert [m["id"] for m in json.loads(listed.stdout)["local"]] == ["mine"]
    [warning] = listed.stderr.splitlines()
    assert warning.startswith("WARNING") and str(resources / "catalog.json") in warning


NO_NETWORK_SCRIPT = """
import sys
tried = []
sys.addaudithook(lambda event, args: tried.append(str(args)[:80]) if event == "socket.connect" else None)
from engine.cli.main import main
codes = [main(["generate", "--target", sys.argv[1], "--prompt", "hi", "--max-new-tokens", "2"]),
         main(["models", "list", "--models-dir", sys.argv[2]]),
         main(["models", "download", "smollm2-135m-instruct", "--models-dir", sys.argv[2]])]
print("RESULT", codes, tried)
"""


def test_with_hf_hub_offline_nothing_opens_a_connection(tmp_path: Path, tiny_target_path: Path) -> None:
    """Loading, listing and a refused download, in a real process: not one socket connect
    (issue 17.18)."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-c", NO_NETWORK_SCRIPT, str(tiny_target_path), str(tmp_path / "models")],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    [result] = [line for line in done.stdout.splitlines() if line.startswith("RESULT")]
    assert result == "RESULT [0, 0, 1] []", done.stderr
    assert "HF_HUB_OFFLINE=1" in one_error(done.stderr) and "Traceback" not in done.stderr
