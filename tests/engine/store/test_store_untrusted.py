"""Files the model store reads from outside (issue 26.2): Ollama manifests, LM Studio's
settings.json, the registry's manifests, the Hugging Face cache's refs and indexes, download
state and the catalog. Real files in fake LM Studio / Ollama / models folders: nested 100,000
deep, fields of the wrong type, huge, a FIFO, a folder or a symlink loop where the file belongs.
Each is one `!` line (or one warning) naming the file and why; the rest of the list still shows;
nothing hangs, and no RecursionError."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from test_discover import HOME_LMS, HOME_OLLAMA, blob, manifest, tiny  # noqa: F401 -- tiny is a fixture
from hub_server import FakeRepo, HubServer, make_model_files
from test_store_registry import make_cache_snapshot, make_hf_folder

from engine.cli.main import main
from engine.errors import UnsupportedModel
from engine.store import discover_models, download_model, import_model, list_local_models
from engine.store.transfer import DownloadSettings
from engine.store.catalog import load_catalog, usable_catalog
from engine.store.discover import MODEL_LAYER

DEEP = "[" * 100_000 + "]" * 100_000
DEEP_OBJECT = '{"a": ' * 100_000 + "1" + "}" * 100_000
pytestmark = pytest.mark.timeout(60)  # a FIFO that blocks fails the test instead of hanging the suite


def cli(capsys: pytest.CaptureFixture[str], *argv: object) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    assert "Traceback" not in err and "RecursionError" not in out + err
    return code, out, err


@pytest.fixture
def home(tmp_path: Path, tiny: Path, monkeypatch: pytest.MonkeyPatch) -> Path:  # noqa: F811
    """One good model in LM Studio's folder and one in Ollama's."""
    home = tmp_path / "home"
    (home / HOME_LMS / "pub" / "Good-GGUF").mkdir(parents=True)
    shutil.copy2(tiny, home / HOME_LMS / "pub" / "Good-GGUF" / "Good-Q8_0.gguf")
    ollama = home / HOME_OLLAMA
    layer = {"mediaType": MODEL_LAYER, "digest": blob(ollama, tiny.read_bytes()), "size": tiny.stat().st_size}
    manifest(ollama, "registry.ollama.ai/library/good/latest", [layer])
    monkeypatch.setenv("HOME", str(home))
    return home


def good_ones_still_show(out: str) -> None:
    assert "Good-Q8_0" in out and "good:latest" in out


# ---- nested 100,000 deep: the issue's own cases ------------------------------------------------------
def test_a_deeply_nested_manifest_and_settings_file_are_one_line_each(
        home: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    manifest(home / HOME_OLLAMA, "registry.ollama.ai/library/deep/latest", DEEP)
    (home / ".lmstudio" / "settings.json").write_text(DEEP_OBJECT)
    models = tmp_path / "models"
    code, out, err = cli(capsys, "models", "list", "--models-dir", models)
    assert code == 0
    good_ones_still_show(out)
    bad = [line for line in out.splitlines() if line.lstrip().startswith("! ")]
    assert len(bad) == 2, bad
    assert any("deep:latest" in line and "100000 levels deep" in line for line in bad)
    assert any(str(home / ".lmstudio" / "settings.json") in line and "levels deep" in line for line in bad)

    code, out, err = cli(capsys, "models", "list", "--json", "--models-dir", models)
    assert code == 0 and len(json.loads(out)["found_problems"]) == 2

    code, out, err = cli(capsys, "models", "import", "--models-dir", models)
    assert code == 0 and "imported Good-Q8_0" in out and "imported good-latest" in out
    assert err.count("note: ") == 2 and "deep:latest" in err


# ---- manifests of the wrong shape ---------------------------------------------------------------------
DIGEST = "sha256:" + "ab" * 32
WRONG_SHAPES = {
    "a list": "[]",
    "text": '"layers"',
    "layers an object": '{"layers": {"mediaType": "%s"}}' % MODEL_LAYER,
    "layers of numbers": '{"layers": [1, 2, "x"]}',
    "a digest number": '{"layers": [{"mediaType": "%s", "digest": 7}]}' % MODEL_LAYER,
    "a digest list": '{"layers": [{"mediaType": "%s", "digest": ["%s"]}]}' % (MODEL_LAYER, DIGEST),
    "a media type list": '{"layers": [{"mediaType": ["%s"], "digest": "%s"}]}' % (MODEL_LAYER, DIGEST),
    "a 5000-digit size": '{"layers": [{"mediaType": "%s", "digest": "%s", "size": %s}]}' % (
        MODEL_LAYER, DIGEST, "9" * 5000),
    "NaN": '{"layers": NaN}',
    "not UTF-8": b'{"layers": "\xff\xfe"}',
    "huge": '{"layers": []}' + " " * (3 << 20),
    "deep in a field": '{"layers": [], "config": %s}' % DEEP,
}


@pytest.mark.parametrize("shape", sorted(WRONG_SHAPES))
def test_a_manifest_of_the_wrong_shape_is_one_line(home: Path, shape: str) -> None:
    body = WRONG_SHAPES[shape]
    path = home / HOME_OLLAMA / "manifests" / "registry.ollama.ai" / "library" / "odd" / "1b"
    path.parent.mkdir(parents=True)
    path.write_bytes(body if isinstance(body, bytes) else body.encode())
    found = discover_models()
    assert {m.name for m in found.models} == {"Good-Q8_0", "good:latest"}
    [line] = found.problems
    assert line.startswith("Ollama's odd:1b: its manifest is broken (") and "ollama pull odd:1b" in line


# ---- special files where a manifest, a settings file or a GGUF belongs -------------------------------
def special(path: Path, kind: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "folder":
        path.mkdir()
    elif kind == "loop":
        path.symlink_to(path.name)  # a link to itself
    else:
        raise AssertionError(kind)


@pytest.mark.parametrize("kind", ["fifo", "folder", "loop"])
def test_a_pipe_folder_or_loop_where_a_file_belongs_is_one_line_and_never_blocks(
        home: Path, tmp_path: Path, kind: str, capsys: pytest.CaptureFixture[str]) -> None:
    ollama, lms = home / HOME_OLLAMA, home / HOME_LMS
    special(ollama / "manifests" / "registry.ollama.ai" / "library" / "pipe" / "latest", kind)
    special(lms / "pub" / "Pipe-GGUF" / "Pipe-Q4_K_M.gguf", kind)
    special(home / ".lmstudio" / "settings.json", kind)
    special(ollama / "blobs" / f"sha256-{'cd' * 32}", kind)  # the weights of a good-looking manifest
    manifest(ollama, "registry.ollama.ai/library/blob/latest",
             [{"mediaType": MODEL_LAYER, "digest": f"sha256:{'cd' * 32}", "size": 1000}])
    found = discover_models()
    assert {m.name for m in found.models} == {"Good-Q8_0", "good:latest"}
    text = "\n".join(found.problems)
    assert "registry.ollama.ai/library/pipe/latest" in text
    assert "Pipe-GGUF/Pipe-Q4_K_M.gguf" in text and "blob:latest" in text
    assert str(home / ".lmstudio" / "settings.json") in text
    assert len(found.problems) == 4, found.problems
    code, out, err = cli(capsys, "models", "list", "--models-dir", tmp_path / "models")
    assert code == 0
    good_ones_still_show(out)


def test_a_short_ollama_blob_is_one_line(home: Path, tiny: Path) -> None:  # noqa: F811
    ollama = home / HOME_OLLAMA
    data = tiny.read_bytes()
    layer = {"mediaType": MODEL_LAYER, "digest": blob(ollama, data[: len(data) // 2]), "size": len(data)}
    manifest(ollama, "registry.ollama.ai/library/half/latest", [layer])
    found = discover_models()
    assert {m.name for m in found.models} == {"Good-Q8_0", "good:latest"}
    [line] = found.problems
    assert "half:latest" in line and f"where the manifest says {len(data):,}" in line


# ---- SpecChat's own folders: registry manifests, the HF cache, download state, the catalog -------------
@pytest.mark.parametrize("body", [DEEP, '{"model_id": "x", "source": "import", "path": ".", "files": %s}' % DEEP,
                                  '{"model_id": ["x"], "source": "import", "path": ".", "files": []}',
                                  '{"model_id": "x", "source": "import", "path": 7, "files": []}',
                                  '{"model_id": "x", "source": "import", "path": ".", "files": [{"name": 1}]}',
                                  '{"model_id": "x", "source": "import", "path": ".", "files": [{"name": "a", '
                                  '"size": "%s"}]}' % ("9" * 5000),
                                  "fifo", "folder"])
def test_a_damaged_registry_manifest_is_one_warning_and_the_rest_still_lists(
        tmp_path: Path, models_dir: Path, body: str, capsys: pytest.CaptureFixture[str],
        caplog: pytest.LogCaptureFixture) -> None:
    import_model(make_hf_folder(tmp_path / "mine"), models_dir)
    path = models_dir / "bad" / "specchat-model.json"
    if body in ("fifo", "folder"):
        special(path, body)
    else:
        path.parent.mkdir(parents=True)
        path.write_text(body)
    code, out, err = cli(capsys, "models", "list", "--json", "--models-dir", models_dir)
    assert code == 0 and [m["id"] for m in json.loads(out)["local"]] == ["mine"]
    [warning] = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert "ignoring the damaged manifest" in warning and str(path) in warning


@pytest.mark.parametrize("damage", ["deep index", "index fifo", "index weight map of lists", "huge ref"])
def test_damaged_hugging_face_cache_files_are_skipped_with_one_warning(
        tmp_path: Path, models_dir: Path, damage: str, caplog: pytest.LogCaptureFixture) -> None:
    cache = tmp_path / "hf" / "hub"
    good = {"config.json": b'{"model_type": "llama"}', "model.safetensors": b"\0" * 64}
    make_cache_snapshot(cache, "good/model", "a" * 40, good)
    snapshot = make_cache_snapshot(cache, "bad/model", "b" * 40, {**good, "model.safetensors.index.json": b"{}"})
    index, ref = snapshot / "model.safetensors.index.json", cache / "models--bad--model" / "refs" / "main"
    index.unlink()
    if damage == "deep index":
        index.write_text(DEEP)
    elif damage == "index fifo":
        os.mkfifo(index)
    elif damage == "index weight map of lists":
        index.write_text('{"weight_map": {"w": ["model.safetensors"]}}')
    else:
        index.write_text('{"weight_map": {"w": "model.safetensors"}}')
        ref.write_text("b" * 40 + " " * (2 << 20))
    listed = {m.model_id for m in list_local_models(models_dir, cache)}
    [warning] = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    if damage == "huge ref":  # the snapshot itself is whole: found without the ref
        assert listed == {"good/model", "bad/model"} and str(ref) in warning
    else:
        assert listed == {"good/model"} and "bad" in warning and "index" in warning


def test_a_pipe_where_the_download_lock_or_state_belongs_never_blocks(
        hub: HubServer, models_dir: Path, settings: DownloadSettings) -> None:
    repo = hub.add_repo(FakeRepo("someone/model", make_model_files(20_000)))
    partial = models_dir / ".partial" / "someone--model"
    partial.mkdir(parents=True)
    os.mkfifo(partial / "download-state.json")
    os.mkfifo(models_dir / ".partial" / "someone--model.lock")
    path = download_model("someone/model", models_dir, settings=settings)
    assert (path / "model.safetensors").read_bytes() == repo.files["model.safetensors"]


def test_a_nested_download_state_is_ignored(hub: HubServer, models_dir: Path, settings: DownloadSettings) -> None:
    repo = hub.add_repo(FakeRepo("someone/model", make_model_files(20_000)))
    partial = models_dir / ".partial" / "someone--model"
    partial.mkdir(parents=True)
    (partial / "download-state.json").write_text(DEEP)
    path = download_model("someone/model", models_dir, settings=settings)
    assert (path / "model.safetensors").read_bytes() == repo.files["model.safetensors"]


@pytest.mark.parametrize("catalog", [DEEP, '{"schema_version": 1, "models": %s}' % DEEP,
                                     '{"schema_version": 1, "models": [], "starter": ["x"], "checked_on": "x"}',
                                     '{"schema_version": 1, "models": [{"id": 7, "repo_id": ["a/b"]}]}',
                                     '{"schema_version": 1, "models": [], "pairs": [["a"]], "starter": "x"}',
                                     "fifo", "folder"])
def test_a_damaged_catalog_is_one_clear_error(tmp_path: Path, catalog: str) -> None:
    path = tmp_path / "catalog.json"
    if catalog in ("fifo", "folder"):
        special(path, catalog)
    else:
        path.write_text(catalog)
    with pytest.raises(UnsupportedModel) as caught:
        load_catalog(path)
    assert str(path) in caught.value.user_message and "Reinstall" in caught.value.user_message
    assert usable_catalog(path).models == ()  # local models still work


@pytest.mark.parametrize("kind", ["fifo", "folder", "huge"])
def test_a_pipe_folder_or_huge_file_where_the_token_belongs_is_no_token(
        kind: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from engine.store.hub_token import token_status

    path = tmp_path / "token"
    if kind == "huge":
        path.write_text("hf_" + "a" * (1 << 20))
    else:
        special(path, kind)
    monkeypatch.setenv("HF_TOKEN_PATH", str(path))
    assert token_status().source == ""


def test_a_settings_file_that_moves_the_models_folder_to_the_root_keeps_the_listing_bounded(home: Path) -> None:
    (home / ".lmstudio" / "settings.json").write_text(json.dumps({"downloadsFolder": "/"}))
    found = discover_models()
    assert {"Good-Q8_0", "good:latest"} <= {m.name for m in found.models}
    assert len(found.problems) <= 2 * 21 and all("\n" not in line for line in found.problems)
