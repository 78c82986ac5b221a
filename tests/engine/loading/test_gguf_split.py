"""A GGUF split into parts (llama.cpp's gguf-split, `<name>-00001-of-00003.gguf`; written here
by gguf-py's own split writer) loads like the one file it was cut from: the same logits bit for
bit, resident, streamed from RAM and from the disk tier, whichever part is named. (The one-file
model equals transformers reading it: test_gguf.py.) A missing or foreign part is refused by
name, importing registers (or copies) every part, and the downloader fetches them all."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine.errors import ModelNotFound, UnsupportedModel
from engine.loading.gguf import GGUFWeights
from engine.loading.load import LoadedModel, load_model, model_fingerprint
from engine.testing.synthetic import tiny_gguf
from engine.store.gguf_header import CorruptGGUF, read_header, read_model
from engine.store.registry import import_model
from engine.store.remote import RemoteFile, RemoteRepo, select_files

TYPES = ("Q8_0", "Q4_0", "Q4_K/Q6_K", "Q5_K")
PLACES = {"unpacked": dict(offload="none"), "resident": dict(offload="none", ram_limit_bytes=0), "RAM": dict(offload="all"),
          "disk": dict(offload="all", ram_limit_bytes=0)}
IDS = [5, 17, 99, 3, 250, 41, 7, 88]


@pytest.fixture(autouse=True)
def _cache_dir(model_cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPECCHAT_CACHE_DIR", str(model_cache))


@pytest.fixture(scope="module")
def whole_and_split(model_cache: Path) -> tuple[Path, list[Path]]:
    whole = tiny_gguf("llama", layers=4, layer_types=TYPES, cache_dir=model_cache)
    first = tiny_gguf("llama", layers=4, layer_types=TYPES, cache_dir=model_cache, parts=3)
    return whole, sorted(first.parent.glob("*.gguf"))


def logits(m: LoadedModel) -> torch.Tensor:
    cache = m.model.new_cache(32)
    return m.model.logits(m.model.forward(torch.tensor(IDS), torch.arange(len(IDS)), cache, None))


def test_the_parts_are_llama_cpp_splits_and_read_as_one_model(whole_and_split: tuple) -> None:
    whole, parts = whole_and_split
    assert [p.name for p in parts] == [f"model-0000{i}-of-00003.gguf" for i in (1, 2, 3)]
    alone = [read_header(p) for p in parts]
    assert [h.metadata["split.no"] for h in alone] == [0, 1, 2] and all(h.tensors for h in alone)
    merged = read_model(parts[1])  # any part names the model
    one = read_header(whole)
    assert merged.path == parts[0] and merged.files == tuple(parts)
    assert [(t.name, t.shape, t.qtype, t.nbytes) for t in merged.tensors] == \
           [(t.name, t.shape, t.qtype, t.nbytes) for t in one.tensors]
    # tensors lie whole in one part each, and some layer's tensors lie in two parts
    layer_parts = {}
    for t in merged.tensors:
        if t.name.startswith("blk."):
            layer_parts.setdefault(t.name.split(".")[1], set()).add(t.part)
    assert any(len(s) > 1 for s in layer_parts.values())


@pytest.mark.parametrize("place", PLACES)
def test_split_model_gives_the_one_files_logits(whole_and_split: tuple, place: str) -> None:
    whole, parts = whole_and_split
    want = logits(load_model(whole, **PLACES[place]))  # type: ignore[arg-type]
    got = load_model(parts[2], **PLACES[place])  # type: ignore[arg-type]
    assert got.path == parts[2]
    assert got.model.placement is not None and got.model.placement.quant == "gguf"
    assert torch.equal(logits(got), want)
    if place == "disk":
        store = got.model.streamer.store  # type: ignore[union-attr]
        assert store is not None and store.disk_layers == 4


def test_the_disk_tier_maps_a_part_in_place_when_its_layers_lie_in_it(model_cache: Path) -> None:
    first = tiny_gguf("llama", layers=4, layer_types=("Q8_0",), cache_dir=model_cache, parts=2)
    w = GGUFWeights(first)
    try:
        with torch.device("meta"):
            hf = AutoModelForCausalLM.from_config(w.config)
        w.bind(hf)
        layouts = w.layouts(hf, torch.float32, "none")
        where = {i: {t.part for t in w.header.tensors if t.name.startswith(f"blk.{i}.")} for i in range(4)}
        last = [i for i in range(4) if where[i] == {1}]
        assert last and any(len(s) > 1 or s == {0} for s in where.values())
        mapped = w.mapped(last, layouts)
        assert mapped is not None and mapped[0] == first.with_name("model-00002-of-00002.gguf")
        assert w.mapped(range(4), layouts) is None  # layers in two parts: the tier copies them
    finally:
        w.close()


def test_a_missing_or_foreign_part_is_refused_by_name(whole_and_split: tuple, tmp_path: Path) -> None:
    _, parts = whole_and_split
    gone = tmp_path / "gone"
    gone.mkdir()
    for p in (parts[0], parts[2]):
        shutil.copy2(p, gone / p.name)
    with pytest.raises(ModelNotFound) as err:
        load_model(gone / parts[0].name)
    assert "model-00002-of-00003.gguf" in err.value.user_message and "same folder" in err.value.user_message

    mixed = tmp_path / "mixed"
    mixed.mkdir()
    for p in parts:
        shutil.copy2(p, mixed / p.name)
    shutil.copy2(parts[2], mixed / parts[1].name)  # part 3 under part 2's name
    with pytest.raises(UnsupportedModel) as err2:
        load_model(mixed / parts[0].name)
    assert "do not belong together" in err2.value.user_message

    renamed = tmp_path / "renamed"
    renamed.mkdir()
    shutil.copy2(parts[0], renamed / "model.gguf")
    with pytest.raises(CorruptGGUF, match="split into 3 files"):
        read_model(renamed / "model.gguf")


def test_import_registers_every_part_and_the_fingerprint_covers_them(whole_and_split: tuple, tmp_path: Path) -> None:
    _, parts = whole_and_split
    src = tmp_path / "src"
    src.mkdir()
    for p in parts:
        shutil.copy2(p, src / f"Tiny-Q4-{p.name.split('-', 1)[1]}")
    named = sorted(src.iterdir())
    copied = import_model(named[1], tmp_path / "models", copy=True)
    assert copied.model_id == "Tiny-Q4" and copied.size_bytes == sum(p.stat().st_size for p in parts)
    assert copied.path.name == named[0].name and sorted(p.name for p in copied.path.parent.glob("*.gguf")) == \
           [p.name for p in named]
    in_place = import_model(named[2], tmp_path / "models", name="in-place")
    assert in_place.path == named[0]
    before = model_fingerprint(named[0], "none", torch.float32, "cpu")
    with open(named[2], "ab") as f:
        f.write(b"\0")  # a changed later part is another model for saved KV caches
    assert model_fingerprint(named[0], "none", torch.float32, "cpu") != before
    named[1].unlink()
    with pytest.raises(ModelNotFound, match="00002-of-00003"):
        import_model(named[0], tmp_path / "models", name="broken")


def test_the_downloader_takes_every_part_of_a_named_split_file() -> None:
    def f(name: str) -> RemoteFile:
        return RemoteFile(name, 10, None, None)

    files = (f("M-Q8_0.gguf"), f("M-Q4_K_M-00001-of-00002.gguf"), f("M-Q4_K_M-00002-of-00002.gguf"), f("README.md"))
    repo = RemoteRepo("someone/M-GGUF", "c" * 40, files, False)
    got = select_files(repo, None, "M-Q4_K_M-00002-of-00002.gguf")
    assert [x.name for x in got] == ["M-Q4_K_M-00001-of-00002.gguf", "M-Q4_K_M-00002-of-00002.gguf"]
    assert [x.name for x in select_files(repo, None, "M-Q8_0.gguf")] == ["M-Q8_0.gguf"]
    short = RemoteRepo("someone/M-GGUF", "c" * 40, files[:2], False)
    with pytest.raises(ModelNotFound, match="1 of the 2 parts"):
        select_files(short, None, "M-Q4_K_M-00001-of-00002.gguf")
