"""`specchat models ...` through the CLI's own entry point (parser, handler, error reporting)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hub_server import STARTER_REPO, FakeRepo, HubServer
from model_files import write_gguf

from engine.cli.main import main
from engine.cli.parser import build_parser


def run(argv: list[str]) -> int:
    assert build_parser().parse_args(argv).handler == "engine.cli.models:run_models"
    return main(argv)


def test_download_list_remove_roundtrip(
    hub: HubServer, starter_repo: FakeRepo, models_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    hub.bytes_per_second = 1_500_000
    assert run(["models", "download", "smollm2-135m-instruct", "--models-dir", str(models_dir)]) == 0
    out, err = capsys.readouterr()
    path = Path(out.strip().splitlines()[-1])
    assert path == models_dir / "smollm2-135m-instruct" and (path / "model.safetensors").is_file()
    assert "100.0%" in err and "[" in err and "]" in err and "done: Saved to" in err

    assert run(["models", "list", "--json", "--models-dir", str(models_dir)]) == 0
    listing = json.loads(capsys.readouterr().out)
    assert [m["id"] for m in listing["local"]] == ["smollm2-135m-instruct"]
    assert next(m for m in listing["catalog"] if m["id"] == "smollm2-135m-instruct")["local"]

    assert run(["models", "list", "--models-dir", str(models_dir)]) == 0
    assert STARTER_REPO in capsys.readouterr().out

    assert run(["models", "remove", "smollm2-135m-instruct", "--models-dir", str(models_dir)]) == 2  # usage
    out, err = capsys.readouterr()
    assert "frees 30" in out and "--yes" in err  # size shown first; no silent delete without a tty
    assert run(["models", "remove", "smollm2-135m-instruct", "--yes", "--models-dir", str(models_dir)]) == 0
    assert "removed" in capsys.readouterr().out
    assert not path.exists()


def test_errors_print_user_message_and_exit_1(
    hub: HubServer, models_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    hub.add_repo(FakeRepo("meta-llama/Llama-3.2-1B-Instruct", {"config.json": b"{}", "model.safetensors": b"w" * 100}, gated=True, token="t"))
    assert run(["models", "download", "meta-llama/Llama-3.2-1B-Instruct", "--models-dir", str(models_dir)]) == 1
    err = capsys.readouterr().err
    [last] = [line for line in err.splitlines() if line.startswith("error: ")]
    assert "accept the licence" in last and "Traceback" not in err
    assert run(["models", "remove", "nothing-here", "--yes", "--models-dir", str(models_dir)]) == 1


def test_import_via_cli(tmp_path: Path, models_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    gguf = write_gguf(tmp_path / "x.gguf")
    assert run(["models", "import", str(gguf), "--models-dir", str(models_dir)]) == 0
    assert capsys.readouterr().out.strip().endswith("x.gguf")


def test_list_shows_each_catalog_format_and_a_gguf_entry_only_when_its_file_is_here(
    hub: HubServer, models_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    repo, name = "bartowski/Llama-3.3-70B-Instruct-GGUF", "Llama-3.3-70B-Instruct-Q4_K_M.gguf"
    hub.add_repo(FakeRepo(repo, {name: b"GGUF" + bytes(300), "Llama-3.3-70B-Instruct-Q2_K.gguf": b"GGUF" + bytes(200)}))
    # Another quantisation of the entry's repo is downloaded: the entry itself is not here.
    assert run(["models", "download", f"{repo}:Llama-3.3-70B-Instruct-Q2_K.gguf", "--models-dir", str(models_dir)]) == 0
    capsys.readouterr()
    assert run(["models", "list", "--json", "--models-dir", str(models_dir)]) == 0
    catalog = {m["id"]: m for m in json.loads(capsys.readouterr().out)["catalog"]}
    gguf, awq = catalog["llama-3.3-70b-instruct-q4_k_m"], catalog["llama-3.1-70b-instruct-awq-int4"]
    assert (gguf["format"], gguf["prequantised"], gguf["file"], gguf["local"]) == ("GGUF Q4_K_M", "gguf", name, False)
    assert (awq["format"], awq["prequantised"], awq["file"]) == ("AWQ INT4", "awq", None)

    assert run(["models", "download", "llama-3.3-70b-instruct-q4_k_m", "--models-dir", str(models_dir)]) == 0
    capsys.readouterr()
    assert run(["models", "list", "--models-dir", str(models_dir)]) == 0
    lines = {line.split()[0].lstrip("*"): line for line in capsys.readouterr().out.splitlines()
             if line.startswith((" *", "  ")) and "B  " in line}
    assert lines["llama-3.3-70b-instruct-q4_k_m"].startswith(" *") and "GGUF Q4_K_M" in lines["llama-3.3-70b-instruct-q4_k_m"]
    assert "AWQ INT4" in lines["llama-3.1-70b-instruct-awq-int4"] and "42.5 GB" in lines["llama-3.3-70b-instruct-q4_k_m"]
    assert "BF16" in lines["llama-3.3-70b-instruct"] and not lines["llama-3.3-70b-instruct"].startswith(" *")



def test_list_marks_what_specchat_cannot_run_yet_and_download_refuses_it(
    hub: HubServer, models_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from engine.store import catalog as catalog_module

    assert run(["models", "list", "--json", "--models-dir", str(models_dir)]) == 0
    listing = json.loads(capsys.readouterr().out)
    shipped = {m["id"]: m for m in listing["catalog"]}
    assert shipped["gpt-oss-20b"]["model_type"] == "gpt_oss" and shipped["gpt-oss-20b"]["format"] == "MXFP4"
    assert all(m["runs"] and m["unsupported"] is None for m in listing["catalog"])  # all it lists, it runs
    pairs = {p["id"]: p for p in listing["pairs"]}
    assert pairs["qwen3.6-27b-draft-free"]["draft"] is None and pairs["llama-3.3-70b+1b"]["draft"]

    # An installed catalog that marks one entry as not runnable yet.
    raw = json.loads(catalog_module.DEFAULT_CATALOG_PATH.read_text())
    why = "its config.json is a wrapper SpecChat does not read yet"
    next(m for m in raw["models"] if m["id"] == "qwen3.6-27b")["unsupported"] = why
    raw["pairs"] = [p for p in raw["pairs"] if p["target"] != "qwen3.6-27b"]
    (tmp_path / "catalog.json").write_text(json.dumps(raw))
    monkeypatch.setattr(catalog_module, "DEFAULT_CATALOG_PATH", tmp_path / "catalog.json")

    assert run(["models", "list", "--json", "--models-dir", str(models_dir)]) == 0
    marked = {m["id"]: m for m in json.loads(capsys.readouterr().out)["catalog"]}
    assert (marked["qwen3.6-27b"]["runs"], marked["qwen3.6-27b"]["unsupported"]) == (False, why)
    assert marked["gpt-oss-20b"]["runs"] is True
    assert run(["models", "list", "--models-dir", str(models_dir)]) == 0
    lines = capsys.readouterr().out.splitlines()
    at = next(i for i, line in enumerate(lines) if line.split()[:1] == ["qwen3.6-27b"])
    assert lines[at + 1] == f"      cannot run yet: {why}"
    assert sum("cannot run yet" in line for line in lines) == 1
    assert any("gpt-oss-20b + (no draft" in line for line in lines)

    assert run(["models", "download", "Qwen/Qwen3.6-27B", "--models-dir", str(models_dir)]) == 1
    err = capsys.readouterr().err
    [last] = [line for line in err.splitlines() if line.startswith("error: ")]
    assert f"cannot run qwen3.6-27b (Qwen/Qwen3.6-27B) yet: {why}" in last and "Nothing was downloaded" in last
    assert "Traceback" not in err and hub.requests == []
