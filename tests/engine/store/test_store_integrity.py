"""Damaged model files at import and in listings (issue 26.9): a GGUF cut short (one file or one
part of a split model), a safetensors shard cut short, an index naming a shard that is not
there, and a pipe where a model file belongs. Import refuses each with one `error:` line that
says what is damaged and what to do, and registers nothing; `models list` marks a registered
model whose files were damaged after import, and LM Studio's damaged GGUFs are `!` lines."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from test_discover import HOME_LMS

from engine.cli.main import main
from engine.errors import UnsupportedModel
from engine.testing.synthetic import tiny_gguf
from engine.store import discover_models, import_model, list_local_models
from engine.store.gguf_header import read_header

pytestmark = pytest.mark.timeout(60)  # a pipe that blocks fails the test instead of hanging the suite


@pytest.fixture(scope="module")
def gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_gguf("llama", layers=1, layer_types=("Q8_0",), cache_dir=tmp_path_factory.mktemp("gguf"))


@pytest.fixture(scope="module")
def split(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    first = tiny_gguf("llama", layers=2, layer_types=("Q8_0",), parts=2, cache_dir=tmp_path_factory.mktemp("split"))
    return sorted(first.parent.glob("*.gguf"))


def cli(capsys: pytest.CaptureFixture[str], *argv: object) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    assert "Traceback" not in err
    return code, out, err


def refused(capsys: pytest.CaptureFixture[str], path: Path, models_dir: Path, *more: str) -> str:
    """The one error line of an import that must be refused; nothing may be registered."""
    code, out, err = cli(capsys, "models", "import", path, "--models-dir", models_dir, *more)
    assert code == 1 and out == "" and len(err.splitlines()) == 1 and err.startswith("error: "), err
    assert list_local_models(models_dir) == []
    assert not list(models_dir.rglob("*.gguf")) and not list(models_dir.rglob("*.safetensors"))
    return err


def cut(src: Path, dest: Path, size: int) -> Path:
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_bytes(src.read_bytes()[:size])
    return dest


def data_start(path: Path) -> int:
    return min(t.offset for t in read_header(path).tensors)


@pytest.mark.parametrize("where", ["last byte", "half", "first tensor", "header"])
@pytest.mark.parametrize("copy", [False, True])
def test_a_gguf_cut_short_is_refused_at_import(gguf: Path, tmp_path: Path, models_dir: Path, where: str,
                                               copy: bool, capsys: pytest.CaptureFixture[str]) -> None:
    size = gguf.stat().st_size
    at = {"last byte": size - 1, "half": size // 2, "first tensor": data_start(gguf) + 100,
          "header": data_start(gguf) // 2}[where]
    err = refused(capsys, cut(gguf, tmp_path / "dl" / "Tiny-Q8_0.gguf", at), models_dir, *(["--copy"] if copy else []))
    assert "Tiny-Q8_0.gguf is damaged" in err and "download it again" in err
    assert ("truncated" in err and f"({at:,} bytes)" in err) if where != "header" else "ends inside its header" in err


def test_a_whole_gguf_still_imports(gguf: Path, tmp_path: Path, models_dir: Path) -> None:
    shutil.copy2(gguf, tmp_path / "Tiny-Q8_0.gguf")
    assert import_model(tmp_path / "Tiny-Q8_0.gguf", models_dir).model_id == "Tiny-Q8_0"


def test_a_split_gguf_with_a_short_part_is_refused_and_marked(
        split: list[Path], tmp_path: Path, models_dir: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    folder = tmp_path / "home" / HOME_LMS / "pub" / "Split-GGUF"
    first = folder / "Split-Q8_0-00001-of-00002.gguf"
    second = folder / "Split-Q8_0-00002-of-00002.gguf"
    folder.mkdir(parents=True)
    shutil.copy2(split[0], first)
    cut(split[1], second, split[1].stat().st_size - 64)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    found = discover_models()
    assert found.models == ()
    [line] = found.problems
    assert "Split-Q8_0-00001-of-00002.gguf" in line and "Split-Q8_0-00002-of-00002.gguf is truncated" in line
    for part in (first, second):  # named by either part
        err = refused(capsys, part, models_dir)
        assert "Split-Q8_0-00002-of-00002.gguf is truncated" in err
    shutil.copy2(split[1], second)  # the part downloaded again: whole
    assert [m.name for m in discover_models().models] == ["Split-Q8_0"]
    assert import_model(second, models_dir).path == first.resolve()


def test_a_model_damaged_after_import_is_marked_in_the_list(
        gguf: Path, tmp_path: Path, models_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    good, bad = tmp_path / "Good-Q8_0.gguf", tmp_path / "Bad-Q8_0.gguf"
    shutil.copy2(gguf, good)
    shutil.copy2(gguf, bad)
    import_model(good, models_dir)
    import_model(bad, models_dir)
    with bad.open("r+b") as f:  # a disk error, a sync tool: the file is shorter now
        f.truncate(gguf.stat().st_size // 3)
    code, out, err = cli(capsys, "models", "list", "--models-dir", models_dir)
    assert code == 0 and "Good-Q8_0" in out and "Bad-Q8_0" in out
    [mark] = [line for line in out.splitlines() if line.lstrip().startswith("! ")]
    assert mark.strip().startswith("! Bad-Q8_0 is damaged: Bad-Q8_0.gguf is truncated")
    code, out, err = cli(capsys, "models", "list", "--json", "--models-dir", models_dir)
    damaged = {m["id"]: m["damaged"] for m in json.loads(out)["local"]}
    assert damaged["Good-Q8_0"] is None and "truncated" in damaged["Bad-Q8_0"]


def test_a_safetensors_shard_cut_short_is_refused_at_import(
        tiny_target_path: Path, tmp_path: Path, models_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    folder = shutil.copytree(tiny_target_path, tmp_path / "tiny")
    shard = folder / "model.safetensors"
    with shard.open("r+b") as f:
        f.truncate(shard.stat().st_size - 1)
    err = refused(capsys, folder, models_dir)
    assert "tiny is damaged" in err and "model.safetensors is truncated" in err


def test_an_index_naming_a_missing_shard_is_refused_at_import(
        tiny_target_path: Path, tmp_path: Path, models_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    folder = shutil.copytree(tiny_target_path, tmp_path / "tiny")
    (folder / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"a": "model.safetensors", "b": "model-00002-of-00002.safetensors"}}))
    err = refused(capsys, folder, models_dir)
    assert "model-00002-of-00002.safetensors" in err


@pytest.mark.parametrize("what", ["gguf", "shard", "split part"])
def test_a_pipe_where_a_model_file_belongs_is_refused_without_blocking(
        what: str, tiny_target_path: Path, split: list[Path], tmp_path: Path, models_dir: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    if what == "gguf":
        path = tmp_path / "pipe.gguf"
        os.mkfifo(path)
    elif what == "shard":
        path = shutil.copytree(tiny_target_path, tmp_path / "tiny")
        (path / "model.safetensors").unlink()
        os.mkfifo(path / "model.safetensors")
    else:
        path = tmp_path / "Split-00001-of-00002.gguf"
        shutil.copy2(split[0], path)
        os.mkfifo(tmp_path / "Split-00002-of-00002.gguf")
    err = refused(capsys, path, models_dir)
    assert "named pipe" in err


def test_damage_is_an_unsupported_model_with_a_message(gguf: Path, tmp_path: Path, models_dir: Path) -> None:
    with pytest.raises(UnsupportedModel) as caught:
        import_model(cut(gguf, tmp_path / "x.gguf", 3000), models_dir)
    assert caught.value.user_message.startswith("x.gguf is damaged: ")
