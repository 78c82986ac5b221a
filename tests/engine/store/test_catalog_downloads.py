"""The catalog's GGUF and AWQ targets through the real download path, against the local fake hub
serving tiny files under the entries' own repo ids and file names: a GGUF entry fetches its one
file out of a repo of many quantisations and registers as that file; an AWQ entry fetches its
config and every shard; both then load in the format the catalog says. An entry SpecChat cannot
run yet is refused, by id or repo id, before a single request."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from hub_server import FakeRepo, HubServer
from safetensors.torch import load_file, save_file

from engine.errors import UnsupportedModel
from engine.loading.load import load_model
from engine.testing.synthetic import tiny_gguf, tiny_model
from engine.store import download_model, load_catalog, resolve_model
from engine.store.catalog import DEFAULT_CATALOG_PATH, CatalogModel
from engine.store.hub_cache import find_cached_repo
from engine.store.registry import find_local_model
from engine.store.transfer import DownloadSettings

CATALOG = load_catalog()
GGUF_ENTRIES = [m for m in CATALOG.models if m.gguf_file and m.runnable]
AWQ_ENTRIES = [m for m in CATALOG.models if m.prequantised == "awq" and m.runnable]
AWQ_GROUP = 32  # the tiny model's rows are 64 and 128 wide: whole groups
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def arch_of(entry: CatalogModel) -> str:
    return "qwen2" if entry.template == "chatml" else "llama"


def other_quantisations(entry: CatalogModel) -> dict[str, bytes]:
    """What else a GGUF repo holds: other quantisations beside the file, a split one in a
    sub-folder (as bartowski's repos keep those over 50 GB), and a README."""
    stem = entry.gguf_file.rsplit("-", 1)[0]  # "Llama-3.3-70B-Instruct"
    return {
        f"{stem}-Q2_K.gguf": b"GGUF" + bytes(3000),
        f"{stem}-Q4_K_S.gguf": b"GGUF" + bytes(4000),
        f"{stem}-Q8_0/{stem}-Q8_0-00001-of-00002.gguf": b"GGUF" + bytes(5000),
        f"{stem}-Q8_0/{stem}-Q8_0-00002-of-00002.gguf": bytes(5000),
        "README.md": b"# quants\n",
    }


@pytest.mark.parametrize("entry", GGUF_ENTRIES, ids=lambda m: m.id)
def test_a_gguf_entry_downloads_only_its_file_and_loads_packed(
    entry: CatalogModel, hub: HubServer, models_dir: Path, settings: DownloadSettings, model_cache: Path,
) -> None:
    gguf = tiny_gguf(arch_of(entry), layers=2, hidden=256, layer_types=("Q4_K/Q6_K",), cache_dir=model_cache)
    decoys = other_quantisations(entry)
    hub.add_repo(FakeRepo(entry.repo_id, {entry.gguf_file: gguf.read_bytes(), **decoys}))

    # Another quantisation of the same repo, downloaded first, is not the catalog's model.
    decoy = next(n for n in decoys if n.endswith("-Q2_K.gguf"))
    download_model(f"{entry.repo_id}:{decoy}", models_dir, settings=settings, catalog=CATALOG)
    assert find_local_model(entry.id, models_dir, None, CATALOG) is None

    path = download_model(entry.id, models_dir, settings=settings, catalog=CATALOG)
    assert path.name == entry.gguf_file and path.read_bytes() == gguf.read_bytes()
    fetched = {r.path.rsplit("/", 1)[-1] for r in hub.requests if r.method == "GET" and "/resolve/" in r.path}
    assert fetched == {decoy, entry.gguf_file}  # nothing else of the repo, ever
    manifest = json.loads((path.parent / "specchat-model.json").read_text())
    assert [f["name"] for f in manifest["files"]] == [entry.gguf_file] and manifest["path"] == entry.gguf_file
    assert resolve_model(entry.id, models_dir) == path
    assert find_local_model(entry.repo_id, models_dir, None, CATALOG).path == path  # the repo id means the entry

    loaded = load_model(path)
    assert loaded.model.placement.quant == "gguf"  # decoder layers kept in their GGUF blocks


@pytest.mark.parametrize("entry", GGUF_ENTRIES, ids=lambda m: m.id)
def test_a_gguf_entry_in_the_hf_cache_is_its_own_file_only(entry: CatalogModel, tmp_path: Path) -> None:
    snapshot = tmp_path / "hub" / ("models--" + entry.repo_id.replace("/", "--")) / "snapshots" / "c0ffee"
    snapshot.mkdir(parents=True)
    (snapshot / next(iter(other_quantisations(entry)))).write_bytes(b"GGUF" + bytes(100))
    assert find_cached_repo(entry.repo_id, tmp_path / "hub", gguf_file=entry.gguf_file) is None
    (snapshot / entry.gguf_file).write_bytes(b"GGUF" + bytes(200))
    cached = find_cached_repo(entry.repo_id, tmp_path / "hub", gguf_file=entry.gguf_file)
    assert cached is not None and cached.path == snapshot / entry.gguf_file and cached.size_bytes == 204
    found = find_local_model(entry.id, tmp_path / "models", tmp_path / "hub", CATALOG)
    assert found is not None and found.path == snapshot / entry.gguf_file


def awq_repo(folder: Path, shards: int = 2) -> dict[str, bytes]:
    """The tiny model as an AutoAWQ GEMM checkpoint (int4 codes, zeros, fp16 scales: values do not
    matter here, the layout does) in `shards` safetensors files with an index, as a repo's files."""
    state = load_file(str(folder / "model.safetensors"))
    out: dict[str, torch.Tensor] = {}
    for name, t in state.items():
        module = name.rpartition(".")[0]
        if not (module.split(".")[-1] in LINEARS and name.endswith(".weight")):
            out[name] = t
            continue
        n_out, n_in = t.shape
        out[module + ".qweight"] = torch.zeros(n_in, n_out // 8, dtype=torch.int32)
        out[module + ".qzeros"] = torch.zeros(n_in // AWQ_GROUP, n_out // 8, dtype=torch.int32)
        out[module + ".scales"] = torch.full((n_in // AWQ_GROUP, n_out), 0.01, dtype=torch.float16)
    names = sorted(out)
    files: dict[str, bytes] = {}
    weight_map = {}
    for i in range(shards):
        shard = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: out[n].contiguous() for n in names[i::shards]}
        save_file(part, str(folder.parent / shard), metadata={"format": "pt"})
        files[shard] = (folder.parent / shard).read_bytes()
        weight_map.update({n: shard for n in part})
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": AWQ_GROUP,
                                     "zero_point": True, "version": "gemm"}
    files["config.json"] = json.dumps(config).encode()
    files["model.safetensors.index.json"] = json.dumps({"metadata": {}, "weight_map": weight_map}).encode()
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json"):
        if (folder / name).is_file():
            files[name] = (folder / name).read_bytes()
    return files


@pytest.mark.parametrize("entry", AWQ_ENTRIES, ids=lambda m: m.id)
def test_an_awq_entry_downloads_config_and_every_shard_and_loads_int4(
    entry: CatalogModel, hub: HubServer, models_dir: Path, settings: DownloadSettings, model_cache: Path,
    tmp_path: Path,
) -> None:
    source = tmp_path / "src" / "tiny"
    source.parent.mkdir()
    source.symlink_to(tiny_model(arch_of(entry), seed=3, cache_dir=model_cache))
    files = awq_repo(source)
    hub.add_repo(FakeRepo(entry.repo_id, {**files, "README.md": b"x", "LICENSE": b"x",
                                          "original/consolidated.00.pth": b"never"}))

    path = download_model(entry.id, models_dir, settings=settings, catalog=CATALOG)
    assert sorted(p.name for p in path.iterdir() if p.name != "specchat-model.json") == sorted(files)
    for name, data in files.items():
        assert (path / name).read_bytes() == data, name
    assert resolve_model(entry.id, models_dir) == path

    loaded = load_model(path)
    assert loaded.model.placement.quant == "awq"  # int4 layers kept packed



def marked_unrunnable(tmp_path: Path, model_id: str, why: str) -> Path:
    """The shipped catalog with `model_id` marked as one SpecChat cannot run yet (and its pairs gone)."""
    raw = json.loads(DEFAULT_CATALOG_PATH.read_text())
    next(m for m in raw["models"] if m["id"] == model_id)["unsupported"] = why
    raw["pairs"] = [p for p in raw["pairs"] if model_id not in (p["target"], p["draft"])]
    path = tmp_path / "catalog.json"
    path.write_text(json.dumps(raw))
    return path


def test_an_entry_specchat_cannot_run_yet_is_refused_before_any_request(
    hub: HubServer, models_dir: Path, settings: DownloadSettings, tmp_path: Path,
) -> None:
    why = "its experts are stored in a format SpecChat does not load yet"
    catalog = load_catalog(marked_unrunnable(tmp_path, "gpt-oss-120b", why))
    entry = catalog.find("gpt-oss-120b")
    assert entry is not None and not entry.runnable
    hub.add_repo(FakeRepo(entry.repo_id, {"config.json": b"{}", "model-00000-of-00014.safetensors": bytes(5000)}))
    events: list = []
    for spec in (entry.id, entry.repo_id, entry.repo_id.upper()):  # a repo id means its entry
        with pytest.raises(UnsupportedModel) as caught:
            download_model(spec, models_dir, settings=settings, catalog=catalog, on_progress=events.append)
        message = caught.value.user_message
        assert f"cannot run gpt-oss-120b ({entry.repo_id}) yet: {why}" in message
        assert "Nothing was downloaded" in message
    assert hub.requests == []  # not even the repo's listing
    assert not models_dir.exists() or not any(models_dir.rglob("*.safetensors"))
    assert [e.state for e in events] == ["failed"] * 3 and events[0].message == message  # the app's download row
    # The shipped catalog runs it: the same download goes ahead.
    path = download_model(entry.id, models_dir, settings=settings, catalog=CATALOG)
    assert (path / "model-00000-of-00014.safetensors").stat().st_size == 5000
