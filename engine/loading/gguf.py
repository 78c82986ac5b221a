"""GGUF files converted once into Hugging Face folders.

transformers reads a GGUF by de-quantising every tensor and rebuilding the tokenizer from the
file's vocabulary on every load: ~30 s for the 98.4 MB starter on 2 cores, most of it the
tokenizer. A small GGUF is therefore converted once into a folder (config.json, fp32
model.safetensors, tokenizer files) in the cache and loaded from there (about a second), which
also lets it use the folder-only features (NF4, streamed layers).

The cache key is the file's name, size and modification time, so a replaced or re-downloaded
file is converted again; a folder appears only complete (built beside it, then renamed). Large
GGUFs are not converted (fp32 would be ~7x the file on disk); they load directly each time.

What this does not do: validate the architecture (load.py does, on the converted folder).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn
from transformers import AutoModelForCausalLM, AutoTokenizer

from engine import paths
from engine.types import Tokenizer
from engine.units import GIB, MIB

log = logging.getLogger(__name__)

# Largest GGUF converted into a cached folder: a 4-bit file of this size is ~2 GB in fp32.
CACHE_MAX_FILE_BYTES = 300 * MIB


@contextlib.contextmanager
def isolated(gguf: Path) -> Iterator[Path]:
    """The GGUF, reached through a fresh folder that holds nothing else. transformers reads a
    GGUF's folder as well (config.json, tokenizer files, and with an `auto_map` Python code it
    offers to run), so a file is only ever read from where nothing can lie beside it: its own
    metadata is the whole model."""
    with tempfile.TemporaryDirectory(prefix="specchat-gguf-") as tmp:
        link = Path(tmp) / gguf.name
        try:
            link.symlink_to(gguf.resolve())
        except OSError:  # Windows without the symlink privilege: a hard link, else a copy
            try:
                os.link(gguf, link)
            except OSError:
                shutil.copy2(gguf, link)
        yield link


def read_gguf(gguf: Path, dtype: torch.dtype) -> tuple[nn.Module, Tokenizer]:
    """transformers' own reading of a GGUF (every tensor de-quantised into RAM), never trusting
    remote code and never reading a file beside it."""
    with isolated(gguf) as src:
        tok = AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name, trust_remote_code=False)
        model = AutoModelForCausalLM.from_pretrained(src.parent, gguf_file=src.name, dtype=dtype,
                                                     trust_remote_code=False)
    return model, tok


def convert_gguf(gguf: Path, dest: Path) -> Path:
    """Write the GGUF's model (fp32 safetensors), config, generation config and tokenizer into
    `dest` (published atomically: paths.publish_folder)."""
    log.info("converting %s to a Hugging Face folder (once)", gguf.name)
    model, tok = read_gguf(gguf, torch.float32)

    def build(tmp: Path) -> None:
        state = {k: v.contiguous() for k, v in model.state_dict().items()}
        if model.config.tie_word_embeddings:
            state.pop("lm_head.weight", None)
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        config = model.config
        if hasattr(config, "quantization_config"):  # the GGUF's own quantisation, gone once de-quantised
            del config.quantization_config
        config.save_pretrained(tmp)
        model.generation_config.save_pretrained(tmp)
        tok.save_pretrained(tmp)

    return paths.publish_folder(dest, build)


def cache_key(gguf: Path) -> str:
    """Folder name of a converted GGUF: its name, where it is, its size and modification time."""
    stat = gguf.stat()
    where = hashlib.sha1(str(gguf.resolve()).encode()).hexdigest()[:10]  # same name, another folder
    return f"{gguf.stem}-{where}-{stat.st_size}-{stat.st_mtime_ns}"


def cached_folder(gguf: Path, cache_dir: Path | None = None) -> Path | None:
    """The converted folder for `gguf` (converting it now if needed), or None when the file is
    too large to convert or the cache has no room: the caller then loads the GGUF directly."""
    stat = gguf.stat()
    if stat.st_size > CACHE_MAX_FILE_BYTES:
        return None
    root = (cache_dir or paths.cache_dir()) / "gguf"
    folder = root / cache_key(gguf)
    if (folder / "config.json").is_file():
        return folder
    root.mkdir(parents=True, exist_ok=True)
    if shutil.disk_usage(root).free < 10 * stat.st_size + GIB:  # fp32 is ~7x a 4-bit file
        log.warning("not caching a converted %s: too little free disk in %s", gguf.name, root)
        return None
    for stale in root.glob(cache_key(gguf).rsplit("-", 2)[0] + "-*"):  # older versions of this file
        if stale.is_dir() and stale != folder:
            shutil.rmtree(stale, ignore_errors=True)
    return convert_gguf(gguf, folder)
