"""Import names in any script (issue 33.3): a folder named `tiny-ü` imports under that name and
`generate --target` finds it, however the name is typed (NFC or NFD, any case); names a file
system cannot hold, that could leave the models folder, or that collide with an imported one
on a case-insensitive file system are refused with one `error:` line, and nothing is written."""

from __future__ import annotations

import json
import shutil
import unicodedata
from pathlib import Path

import pytest
from model_files import write_gguf
from test_discover import HOME_LMS

from engine.cli.main import main
from engine.store import import_model, list_local_models, resolve_model
from engine.store.names import check_import_name, default_import_name, name_key


def cli(capsys: pytest.CaptureFixture[str], *argv: object) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    assert "Traceback" not in err
    return code, out, err


def nfd(text: str) -> str:
    return unicodedata.normalize("NFD", text)


@pytest.fixture
def tiny_u(tiny_target_path: Path, tmp_path: Path) -> Path:
    """The tiny model in a folder whose name is not ASCII."""
    return shutil.copytree(tiny_target_path, tmp_path / "src" / "tiny-ü")


def test_a_folder_named_tiny_u_imports_and_generates_by_its_name(
        tiny_u: Path, models_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = cli(capsys, "models", "import", tiny_u, "--models-dir", models_dir)
    assert code == 0, err
    assert out.startswith("imported tiny-ü ")
    for typed in ("tiny-ü", nfd("tiny-ü"), "TINY-Ü", nfd("Tiny-Ü")):  # however it is typed
        assert resolve_model(typed, models_dir) == tiny_u.resolve(), typed
    code, out, err = cli(capsys, "generate", "--target", nfd("tiny-ü"), "--prompt", "hi", "--max-new-tokens", "2",
                         "--json")
    assert code == 0, err
    assert json.loads(out.splitlines()[0])["stats"]["new_tokens"] == 2
    code, out, err = cli(capsys, "models", "list", "--json", "--models-dir", models_dir)
    assert [m["id"] for m in json.loads(out)["local"]] == ["tiny-ü"]
    code, out, err = cli(capsys, "models", "remove", nfd("TINY-Ü"), "--yes", "--models-dir", models_dir)
    assert code == 0 and "removed tiny-ü" in out and list_local_models(models_dir) == []


@pytest.mark.parametrize("name", ["Modèles", "模型", "Llama-3-ü", "Ελληνικά 2", "मॉडल", "Модель_7b.q4", "_x"])
def test_names_in_any_script_are_allowed(name: str, tmp_path: Path, models_dir: Path) -> None:
    model = import_model(write_gguf(tmp_path / "m.gguf"), models_dir, name=nfd(name))
    assert model.model_id == name == unicodedata.normalize("NFC", model.model_id)  # kept in NFC
    assert (models_dir / f"local--{name}").is_dir()
    assert resolve_model(name.upper(), models_dir) == model.path


REFUSED = {
    "a slash": "a/b", "a backslash": "a\\b", "parent": "..", "dots inside": "a..b", "a NUL": "a\0b",
    "a tab": "a\tb", "a newline": "a\nb", "a right-to-left override": "abc\u202egguf", "a zero-width space": "a\u200bb",
    "CON": "CON", "con with an extension": "con.txt", "COM1": "COM1", "LPT9": "lpt9.gguf", "NUL with a space": "NUL ",
    "a trailing dot": "model.", "a trailing space": "model ", "a leading dot": ".hidden", "a leading dash": "-rf",
    "a leading space": " x", "<": "a<b", ">": "a>b", ":": "a:b", '"': 'a"b', "|": "a|b", "?": "a?b", "*": "a*b",
    "an emoji": "model\U0001F600", "too many characters": "x" * 101, "too many bytes": "模" * 70, "empty": "",
    "only a combining mark": "\u0308",
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_names_no_file_system_can_hold_are_refused(case: str, tmp_path: Path, models_dir: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    gguf = write_gguf(tmp_path / "m.gguf")
    code, out, err = cli(capsys, "models", "import", gguf, f"--name={REFUSED[case]}", "--models-dir", models_dir)
    assert code == 2 and out == "" and len(err.splitlines()) == 1 and "cannot be an import name" in err, err
    assert not models_dir.exists()


@pytest.mark.parametrize(("first", "second"), [("Tiny", "tiny"), ("tiny-ü", nfd("TINY-Ü")), ("straße", "STRASSE"),
                                               ("Modèles", nfd("modèles"))])
def test_a_name_that_collides_on_a_case_insensitive_file_system_is_refused(
        first: str, second: str, tmp_path: Path, models_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    gguf = write_gguf(tmp_path / "m.gguf")
    import_model(gguf, models_dir, name=first)
    code, out, err = cli(capsys, "models", "import", gguf, "--name", second, "--models-dir", models_dir)
    assert code == 1 and out == "" and len(err.splitlines()) == 1, err
    assert f"{unicodedata.normalize('NFC', first)!r} is already imported" in err and "--name" in err
    assert [m.model_id for m in list_local_models(models_dir)] == [unicodedata.normalize("NFC", first)]


def test_default_names_keep_letters_and_replace_the_rest() -> None:
    assert default_import_name("Llama 3 (ü) 8B") == "Llama 3 -ü- 8B"
    assert default_import_name(nfd("Modèles")) == "Modèles"
    assert default_import_name("tiny:latest") == "tiny-latest"
    assert default_import_name("hf.co/someone/Tiny-GGUF:Q8_0") == "hf.co-someone-Tiny-GGUF-Q8_0"
    assert default_import_name("...a..b...") == "a.b"
    assert default_import_name("--\u0308x") == "x"
    assert default_import_name("???") == "model"
    for stem in ("Llama 3 (ü) 8B", "模型", "tiny:latest", "a/b\\c", "..", "x\u202ey"):
        check_import_name(default_import_name(stem))  # what the default makes is allowed
    assert name_key("Straße") == name_key("STRASSE") == name_key(nfd("strasse"))


def test_found_models_with_non_ascii_names_import_by_those_names(
        tmp_path: Path, models_dir: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    lms = tmp_path / "home" / HOME_LMS / "pub" / "模型-GGUF"
    write_gguf(lms / f"{nfd('Modèle')}-Q8_0.gguf")  # as macOS's HFS+ stores a name: decomposed
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    code, out, err = cli(capsys, "models", "import", "--models-dir", models_dir)
    assert code == 0 and "imported Modèle-Q8_0" in out, out + err
    assert resolve_model("modèle-q8_0", models_dir) is not None
