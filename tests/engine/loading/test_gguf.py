"""GGUF files load through a folder converted once: same weights and tokenizer as transformers'
own GGUF reader, reused on the next load, converted again when the file changes."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch

from engine.loading.gguf import cache_key, cached_folder
from engine.loading.load import load_model
from engine.store.pypi import STARTER_GGUF_BYTES, starter_gguf


def test_cache_key_changes_with_the_file_and_its_place(tmp_path: Path) -> None:
    a = tmp_path / "a" / "m.gguf"
    b = tmp_path / "b" / "m.gguf"
    for f in (a, b):
        f.parent.mkdir()
        f.write_bytes(b"GGUF" + bytes(16))
    os.utime(b, ns=(a.stat().st_atime_ns, a.stat().st_mtime_ns))
    assert cache_key(a) != cache_key(b)  # same name, size and time, other folder
    before = cache_key(a)
    os.utime(a, ns=(a.stat().st_atime_ns, a.stat().st_mtime_ns + 10**9))
    assert cache_key(a) != before and cache_key(a).rsplit("-", 2)[0] == before.rsplit("-", 2)[0]


@pytest.mark.slow
def test_starter_gguf_loads_like_transformers_and_converts_once(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = tmp_path / "models" / "starter.gguf"
    gguf.parent.mkdir()
    shutil.copy2(starter_gguf(), gguf)  # a copy: the test changes its modification time
    assert gguf.stat().st_size == STARTER_GGUF_BYTES  # the size the app and README state
    monkeypatch.setenv("SPECCHAT_CACHE_DIR", str(tmp_path / "cache"))

    loaded = load_model(gguf)
    assert loaded.path == gguf
    folder = cached_folder(gguf)
    assert folder is not None and folder.parent == tmp_path / "cache" / "gguf"
    built = (folder / "model.safetensors").stat().st_mtime_ns

    # the independent reference: transformers reading the GGUF itself
    ref_tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    ref = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32).eval()
    text = "The capital of France is Paris. def f(x):\n    return x * 2  # ünïcode"
    ids = ref_tok(text)["input_ids"]
    assert loaded.tokenizer(text)["input_ids"] == ids  # type: ignore[operator]
    model = loaded.model
    cache = model.new_cache()
    hidden = model.forward(torch.tensor(ids), torch.arange(len(ids)), cache, None)
    ours = model.logits(hidden)  # (n, V)
    with torch.inference_mode():
        theirs = ref(torch.tensor([ids])).logits[0].float()  # (n, V)
    assert (ours - theirs).abs().max().item() <= 1e-4

    assert load_model(gguf).path == gguf  # the second load reuses the folder
    assert (folder / "model.safetensors").stat().st_mtime_ns == built

    st = gguf.stat()
    os.utime(gguf, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # "a re-downloaded file"
    again = cached_folder(gguf)
    assert again is not None and again != folder and not folder.exists()
