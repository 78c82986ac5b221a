"""GGUFs that LM Studio and Ollama keep, found in folder trees laid out like theirs (written
here): listed with size, quantisation and architecture, used in place by name; broken
manifests, missing blobs, unreadable files and names that leave the folder each get one line,
and the rest of the list still shows."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest
from gguf import GGUFWriter

from engine.cli.main import main
from engine.store import Discovery, discover_models, list_local_models, resolve_model
from engine.store.discover import LM_STUDIO, OLLAMA, app_folders

HOME_LMS = Path(".lmstudio") / "models"
HOME_OLLAMA = Path(".ollama") / "models"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from engine.testing.synthetic import tiny_gguf

    return tiny_gguf("llama", layers=1, layer_types=("Q8_0",), cache_dir=tmp_path_factory.mktemp("gguf"))


def header_only(path: Path, arch: str, **keys: int) -> Path:
    """A GGUF with metadata and no tensors (discovery reads no more)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    w = GGUFWriter(path, arch)
    for key, value in keys.items():
        w.add_uint32(key.replace("_", ".", 1), value)  # general_file_type -> general.file_type
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    w.close()
    return path


def blob(root: Path, data: bytes) -> str:
    digest = hashlib.sha256(data).hexdigest()
    (root / "blobs").mkdir(parents=True, exist_ok=True)
    (root / "blobs" / f"sha256-{digest}").write_bytes(data)
    return f"sha256:{digest}"


def manifest(root: Path, name: str, layers: list[dict] | str) -> None:
    path = root / "manifests" / name
    path.parent.mkdir(parents=True, exist_ok=True)
    body = layers if isinstance(layers, str) else json.dumps({
        "schemaVersion": 2, "mediaType": "application/vnd.docker.distribution.manifest.v2+json",
        "config": {"mediaType": "application/vnd.docker.container.image.v1+json", "digest": "sha256:" + "0" * 64,
                   "size": 2}, "layers": layers})
    path.write_text(body)


@pytest.fixture
def trees(tmp_path: Path, tiny: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A home folder with LM Studio's and Ollama's trees: good models and every kind of breakage."""
    home = tmp_path / "home"
    lms = home / HOME_LMS
    (lms / "lmstudio-community" / "Tiny-GGUF").mkdir(parents=True)
    shutil.copy2(tiny, lms / "lmstudio-community" / "Tiny-GGUF" / "Tiny-Q8_0.gguf")
    shutil.copy2(tiny, lms / "lmstudio-community" / "Tiny-GGUF" / "mmproj-Tiny-f16.gguf")  # a projector: skipped
    header_only(lms / "google" / "gemma-GGUF" / "gemma-Q4_K_M.gguf", "gemma2", general_file_type=15)
    header_only(lms / "big" / "Big-GGUF" / "Big-Q4_K_M-00001-of-00002.gguf", "llama", split_no=0, split_count=2)
    header_only(lms / "big" / "Big-GGUF" / "Big-Q4_K_M-00002-of-00002.gguf", "llama", split_no=1, split_count=2)
    header_only(lms / "big" / "Half-GGUF" / "Half-Q4_K_M-00001-of-00003.gguf", "llama", split_no=0, split_count=3)
    header_only(lms / "big" / "Half-GGUF" / "Half-Q4_K_M-00003-of-00003.gguf", "llama", split_no=2, split_count=3)
    (lms / "broken" / "Cut-GGUF").mkdir(parents=True)
    (lms / "broken" / "Cut-GGUF" / "cut.gguf").write_bytes(b"GGUF\x03\x00\x00\x00" + b"\xff" * 8)
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    shutil.copy2(tiny, outside / "secret.gguf")
    (lms / "evil").symlink_to(outside, target_is_directory=True)  # leads out of LM Studio's folder
    (lms / "broken" / "Cut-GGUF" / "linked.gguf").symlink_to(outside / "secret.gguf")  # so does a file

    ollama = home / HOME_OLLAMA
    model = {"mediaType": "application/vnd.ollama.image.model", "digest": blob(ollama, tiny.read_bytes()),
             "size": tiny.stat().st_size}
    template = {"mediaType": "application/vnd.ollama.image.template", "digest": blob(ollama, b"{{ .Prompt }}"),
                "size": 12}
    manifest(ollama, "registry.ollama.ai/library/tiny/latest", [model, template])
    manifest(ollama, "hf.co/someone/Tiny-GGUF/Q8_0", [model])
    manifest(ollama, "registry.ollama.ai/library/broken/latest", "{not json")
    manifest(ollama, "registry.ollama.ai/library/gone/7b",
             [{"mediaType": "application/vnd.ollama.image.model", "digest": "sha256:" + "a" * 64, "size": 9}])
    manifest(ollama, "registry.ollama.ai/library/hostile/1b",
             [{"mediaType": "application/vnd.ollama.image.model", "digest": "sha256:../../../etc/passwd"}])
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.delenv("OLLAMA_MODELS", raising=False)
    return home


def test_found_models_are_listed_with_size_quantisation_and_architecture(trees: Path, tiny: Path) -> None:
    found = discover_models()
    by_name = {m.name: m for m in found.models}
    assert set(by_name) == {"Tiny-Q8_0", "gemma-Q4_K_M", "Big-Q4_K_M", "Half-Q4_K_M", "tiny:latest"}
    lms, ollama = by_name["Tiny-Q8_0"], by_name["tiny:latest"]
    assert (lms.app, ollama.app) == (LM_STUDIO, OLLAMA)
    assert lms.size_bytes == ollama.size_bytes == tiny.stat().st_size
    assert lms.runnable and ollama.runnable and lms.detail == ollama.detail == "Q8_0 · llama"
    assert ollama.path.parent == trees / HOME_OLLAMA / "blobs"  # the blob itself: used in place
    assert not by_name["gemma-Q4_K_M"].runnable and "gemma2" in by_name["gemma-Q4_K_M"].note
    assert by_name["gemma-Q4_K_M"].quantisation == "Q4_K_M"  # from general.file_type
    # a split model is one entry, by its first part, sized as all its parts; a missing part is named
    big = by_name["Big-Q4_K_M"]
    parts = sorted((trees / HOME_LMS / "big" / "Big-GGUF").iterdir())
    assert big.path == parts[0] and big.size_bytes == sum(p.stat().st_size for p in parts) and big.runnable
    half = by_name["Half-Q4_K_M"]
    assert not half.runnable and "Half-Q4_K_M-00002-of-00003.gguf of 3 missing" in half.note
    # the same blob under a second name is listed once
    assert sum(m.path == ollama.path for m in found.models) == 1


def test_each_broken_thing_gets_one_clear_line(trees: Path) -> None:
    problems = discover_models().problems
    assert len(problems) == 6, problems
    text = "\n".join(problems)
    assert "Ollama's broken:latest: its manifest is broken" in text and "ollama pull broken:latest" in text
    assert "Ollama's gone:7b: its weights (blob sha256-aaaaaaaaaaaa…) are missing" in text
    assert "Ollama's hostile:1b" in text and "not a sha256 digest" in text
    assert "LM Studio: broken/Cut-GGUF/cut.gguf: not a readable GGUF" in text
    assert "'evil'" in text and "'broken/Cut-GGUF/linked.gguf'" in text  # symlinks out of the folder: refused
    assert "secret" not in text
    assert all("\n" not in line for line in problems)


def test_found_models_are_usable_in_place_by_name(trees: Path, tmp_path: Path) -> None:
    assert resolve_model("tiny:latest", tmp_path / "models") == discover_models().models[-1].path
    assert resolve_model("Tiny-Q8_0", tmp_path / "models").name == "Tiny-Q8_0.gguf"  # type: ignore[union-attr]
    local = list_local_models(tmp_path / "models", None, discover_models().models)
    assert {(m.model_id, m.source) for m in local} >= {("tiny:latest", "ollama"), ("Tiny-Q8_0", "lmstudio")}
    assert all(not m.owns_files for m in local)
    from engine.loading.load import load_model

    loaded = load_model("tiny:latest")  # an Ollama blob: no .gguf suffix
    assert loaded.model.placement is not None and loaded.model.placement.quant == "gguf"


def test_models_list_and_import_show_and_register_them(trees: Path, tmp_path: Path,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    models = tmp_path / "models"
    assert main(["models", "list", "--models-dir", str(models)]) == 0
    out = capsys.readouterr().out
    assert "Found in LM Studio and Ollama" in out and "tiny:latest" in out and "Q8_0 · llama" in out
    assert "! Ollama's gone:7b" in out
    assert out.count("tiny:latest") == 1  # in its own section, not again under the local models
    assert main(["models", "list", "--json", "--models-dir", str(models)]) == 0
    listing = json.loads(capsys.readouterr().out)
    assert {f["name"] for f in listing["found"] if f["runnable"]} == {"Tiny-Q8_0", "Big-Q4_K_M", "tiny:latest"}
    assert len(listing["found_problems"]) == 6

    assert main(["models", "import", "--models-dir", str(models)]) == 0
    out, err = capsys.readouterr()
    assert "imported Tiny-Q8_0" in out and "imported tiny-latest" in out and "note: " in err
    registered = {m.model_id: m for m in list_local_models(models)}
    assert set(registered) == {"Tiny-Q8_0", "Big-Q4_K_M", "tiny-latest"} and not registered["tiny-latest"].owns_files
    assert main(["models", "import", "--models-dir", str(models)]) == 0
    assert capsys.readouterr().out.count("already imported") == 3
    assert main(["models", "remove", "tiny:latest", "--yes", "--models-dir", str(models)]) == 1  # not SpecChat's
    assert "belongs to Ollama" in capsys.readouterr().err


def test_no_folders_no_list_and_ollama_models_moves_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path / "empty"))
    monkeypatch.setenv("OLLAMA_MODELS", str(tmp_path / "store"))
    assert discover_models().models == () and discover_models().problems == ()
    assert (OLLAMA, tmp_path / "store") in app_folders()
    assert os.environ["OLLAMA_MODELS"] == str(tmp_path / "store")


def test_a_moved_lm_studio_folder_is_found_through_its_settings(tmp_path: Path, tiny: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    home, moved = tmp_path / "home", tmp_path / "big-disk" / "models"
    (moved / "pub" / "Tiny-GGUF").mkdir(parents=True)
    shutil.copy2(tiny, moved / "pub" / "Tiny-GGUF" / "Moved-Q8_0.gguf")
    (home / ".lmstudio").mkdir(parents=True)
    (home / ".lmstudio" / "settings.json").write_text(json.dumps({"downloadsFolder": str(moved)}))
    monkeypatch.setenv("HOME", str(home))
    assert (LM_STUDIO, moved) in app_folders()
    assert [m.name for m in discover_models().models] == ["Moved-Q8_0"]
    for junk in ('{"downloadsFolder": "relative/models"}', '{"downloadsFolder": 7}', "[1]", "{not json"):
        (home / ".lmstudio" / "settings.json").write_text(junk)  # one line naming the file, never an error
        found = discover_models()
        assert found.models == () and len(found.problems) == 1
        assert str(home / ".lmstudio" / "settings.json") in found.problems[0]
    (home / ".lmstudio" / "settings.json").write_text('{"theme": "dark"}')  # the folder was never moved
    assert discover_models() == Discovery((), ())


def test_the_same_file_name_in_two_lm_studio_repos_gets_two_names(tmp_path: Path, tiny: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    lms = tmp_path / "home" / HOME_LMS
    for repo in ("a/Tiny-GGUF", "b/Tiny-GGUF"):
        (lms / repo).mkdir(parents=True)
        shutil.copy2(tiny, lms / repo / "model-Q8_0.gguf")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    found = {m.name: m.path for m in discover_models().models}
    assert found == {"model-Q8_0": lms / "a/Tiny-GGUF/model-Q8_0.gguf",
                     "b/Tiny-GGUF/model-Q8_0": lms / "b/Tiny-GGUF/model-Q8_0.gguf"}
    assert resolve_model("b/Tiny-GGUF/model-Q8_0", tmp_path / "models") == lms / "b/Tiny-GGUF/model-Q8_0.gguf"

