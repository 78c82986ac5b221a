"""EAGLE-3 heads in the catalog (role "head"): a pair of a target and a head declared for it is
accepted, and every other use of a head refused; a head pair downloaded through the local fake
hub lands beside its target, where engine.model.eagle_spec.find_eagles finds it, and loads as a
head (not as a draft model)."""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from hub_server import FakeRepo, HubServer
from transformers import AutoConfig

from engine.errors import UnsupportedModel
from engine.model.eagle_spec import find_eagles, is_eagle_folder
from engine.store import download_model, load_catalog, resolve_model
from engine.store.catalog import Catalog
from engine.store.transfer import DownloadSettings
from engine.testing.by_path import module_at
from engine.testing.synthetic import tiny_model

AUX = [1, 3, 5]
TARGET_REPO, HEAD_REPO = "org/tiny-llama", "org/tiny-llama-EAGLE3"


def _eagle_checkpoints() -> ModuleType:
    """tests/engine/decoding/eagle_checkpoints.py, the EAGLE tests' own head writer (one module)."""
    return module_at("eagle_checkpoints", Path(__file__).resolve().parents[1] / "decoding" / "eagle_checkpoints.py")


def entry(model_id: str, repo_id: str, role: str, **more: Any) -> dict[str, Any]:
    return {"id": model_id, "repo_id": repo_id, "role": role, "shards": 1, "download_bytes": 1000,
            "parameters": 500, "layers": 6, "vocab_rows": 1000, "dtype": "bfloat16", "prequantised": None,
            "model_type": "llama", "license": "apache-2.0", "gated": False, "template": "llama3",
            "description": model_id, "memory": {"bf16": {"ram_gb": 1, "vram_min_gb": 1, "vram_full_gb": 1}},
            "files": ["config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"], **more}


def head_entry(model_id: str = "tiny-llama-eagle3", head_for: tuple[str, ...] = ("tiny-llama",)) -> dict[str, Any]:
    return entry(model_id, HEAD_REPO, "head", layers=1, head_for=list(head_for),
                 files=["config.json", "model.safetensors"],
                 shape={"hidden_size": 64, "intermediate_size": 96, "num_attention_heads": 4, "num_kv_heads": 2,
                        "head_dim": 16, "draft_vocab_size": 1000})


BASE: dict[str, Any] = {
    "schema_version": 1, "checked_on": "2026-11-28", "starter": "tiny-llama",
    "models": [entry("tiny-llama", TARGET_REPO, "target"), entry("other-llama", "org/other-llama", "target"),
               entry("tiny-draft", "org/tiny-draft", "draft"), head_entry()],
    "pairs": [{"id": "tiny+draft", "target": "tiny-llama", "draft": "tiny-draft", "description": "a draft model"},
              {"id": "tiny+eagle3", "target": "tiny-llama", "draft": "tiny-llama-eagle3", "description": "a head"}],
}


def write_catalog(folder: Path, edit: Any = None) -> Path:
    data = copy.deepcopy(BASE)
    if edit is not None:
        edit(data)
    path = folder / "catalog.json"
    path.write_text(json.dumps(data))
    return path


def test_a_head_pair_is_accepted_and_never_taken_for_a_draft_model(tmp_path: Path) -> None:
    catalog = load_catalog(write_catalog(tmp_path))
    head = catalog.find("tiny-llama-eagle3")
    assert head is not None and head.is_head and head.head_for == ("tiny-llama",)
    assert catalog.pair("tiny+eagle3") is not None
    assert [m.id for m in catalog.heads_for("tiny-llama")] == ["tiny-llama-eagle3"] and not catalog.heads_for("other-llama")
    # callers that load the catalog's draft as a model get the draft model, never the head
    draft_pair = catalog.draft_pair("tiny-llama")
    assert draft_pair is not None and draft_pair.id == "tiny+draft"
    without = load_catalog(write_catalog(tmp_path, lambda d: d["pairs"].pop(0)))
    assert without.draft_pair("tiny-llama") is None
    # a head is priced as one layer and its output head over the draft vocabulary
    shape = head.shape()
    assert (shape.num_layers, shape.vocab_size, shape.layer.hidden_size) == (1, 1000, 64)


@pytest.mark.parametrize(("edit", "said"), [
    (lambda d: d["pairs"].append({"id": "other+eagle3", "target": "other-llama", "draft": "tiny-llama-eagle3",
                                  "description": "a head of another model"}), "was trained for tiny-llama"),
    (lambda d: d["models"][2].update(head_for=["tiny-llama"]), "only a head"),  # a head listed as a draft model
    (lambda d: d["pairs"].append({"id": "eagle3+draft", "target": "tiny-llama-eagle3", "draft": "tiny-draft",
                                  "description": "a head as a target"}), "role 'head'"),
    (lambda d: d["models"][3].update(head_for=[]), "head_for"),
    (lambda d: d["models"][3].update(head_for=["no-such-model"]), "no-such-model"),
    (lambda d: d["models"][3].update(id="tiny-llama-head"), "says 'eagle'"),
    (lambda d: d["models"][3].update(files=["config.json", "pytorch_model.bin"]), ".safetensors"),
    (lambda d: d["models"][3].update(vocab_rows=999), "maps its tokens onto 999 rows"),
    (lambda d: d["models"][3].update(role="helper"), "role is 'helper'"),
], ids=["another-target", "head-as-draft-model", "head-as-target", "no-head_for", "unknown-target", "id-without-eagle",
        "pickled-weights", "other-vocabulary", "unknown-role"])
def test_a_head_anywhere_but_beside_its_own_target_is_refused(tmp_path: Path, edit: Any, said: str) -> None:
    path = write_catalog(tmp_path, edit)
    with pytest.raises(UnsupportedModel) as raised:
        load_catalog(path)
    assert said in raised.value.user_message and "Reinstall SpecChat" in raised.value.user_message


@pytest.fixture(scope="module")
def head_files(model_cache: Path) -> tuple[dict[str, bytes], dict[str, bytes]]:
    """A 6-layer tiny Llama's files and the files of an EAGLE-3 head trained for it (random weights)."""
    home = model_cache / "catalog-heads"
    target = home / "tiny-llama"
    if not (target / "config.json").is_file():
        home.mkdir(parents=True, exist_ok=True)
        shutil.copytree(tiny_model("llama", seed=0, layers=6, cache_dir=model_cache), target)
    head = _eagle_checkpoints().write_eagle(home / "tiny-llama-EAGLE3", target, aux=AUX, draft_vocab=40)

    def files(folder: Path) -> dict[str, bytes]:
        return {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file()}
    return files(target), files(head)


def tiny_catalog(tmp_path: Path) -> Catalog:
    """The tiny target and its head under the fake hub's repo ids, with the tiny model's vocabulary."""
    def edit(data: dict[str, Any]) -> None:
        for model in data["models"]:
            model.update(vocab_rows=TINY_VOCAB)
        data["models"][3]["shape"]["draft_vocab_size"] = 40
    return load_catalog(write_catalog(tmp_path, edit))


TINY_VOCAB = 384  # engine.testing.synthetic.tiny_model's


def test_a_downloaded_head_pair_lands_where_the_engine_finds_and_loads_the_head(
    head_files: tuple[dict[str, bytes], dict[str, bytes]], hub: HubServer, models_dir: Path,
    settings: DownloadSettings, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    target_files, head_files_ = head_files
    hub.add_repo(FakeRepo(TARGET_REPO, target_files))
    hub.add_repo(FakeRepo(HEAD_REPO, {**head_files_, "README.md": b"# an EAGLE-3 head\n"}))
    catalog = tiny_catalog(tmp_path)
    pair = catalog.pair("tiny+eagle3")
    assert pair is not None
    paths = [download_model(spec, models_dir, settings=settings, catalog=catalog) for spec in (pair.target, pair.draft)]
    target, head = paths
    assert head.parent == target.parent == models_dir  # beside each other in the models folder
    assert sorted(p.name for p in head.iterdir()) == ["config.json", "model.safetensors", "specchat-model.json"]

    found = find_eagles(target, AutoConfig.from_pretrained(target))
    assert [(s.folder, s.problem, s.aux) for s in found] == [(head, "", tuple(AUX))]
    # what the app hands load_engine for the pair's draft (its catalog id resolved) is the head's folder
    resolved = resolve_model(pair.draft, models_dir)
    assert resolved == head and is_eagle_folder(resolved)

    from engine.decoding.pair import draft_choice_of, load_engine

    engine = load_engine(str(target), str(resolved))
    choice = draft_choice_of(engine)
    assert choice is not None and choice.kind == "assistant" and "EAGLE-3 head" in choice.label
    # `--draft ID` on the command line: the id is resolved to the head's folder, loaded as a head
    monkeypatch.setenv("SPECCHAT_MODELS_DIR", str(models_dir))
    by_id = draft_choice_of(load_engine(str(target), pair.draft))
    assert by_id is not None and by_id.kind == "assistant" and by_id.label == choice.label
