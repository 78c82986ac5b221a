"""The registry of local models: what is in the models folder, plus what the HF cache holds,
plus (when the caller passes them) the GGUFs LM Studio and Ollama keep (discover.py), used in
place.

Each registered model is a folder `<models dir>/<slug>/` holding a manifest
(`specchat-model.json`) and usually the model files themselves. A model is registered only by
writing its manifest last (downloads build it in `.partial/` and rename the whole folder in), so a
half-finished model is never listed. Imports may point at files elsewhere (no copy); removing
those unregisters them and frees nothing, which `LocalModel.owns_files` says up front.

Manifests are read through engine.untrusted (regular files, bounded size and nesting) and
checked field by field; a damaged one is skipped with one warning naming it. An import is
refused when its files are damaged (integrity.py: a GGUF shorter than the tensors it declares,
a safetensors shard cut short) or when its name is not one names.py allows, or is the same as
a registered model's up to case and Unicode normalisation. Names match the same way.
"""

from __future__ import annotations

import logging
import os
import shutil
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Iterable

from engine import paths as engine_paths
from engine.errors import (
    DiskFull,
    InvalidRequest,
    MalformedInput,
    ModelNotFound,
    UnsupportedModel,
)
from engine.store.catalog import Catalog, CatalogModel
from engine.store.discover import LM_STUDIO, FoundModel
from engine.store.gguf_header import SPLIT_NAME, CorruptGGUF, open_regular, split_parts
from engine.store.hub_cache import find_cached_repo, list_cached_repos
from engine.store.integrity import check_model_files
from engine.store.names import check_import_name, default_import_name, name_key
from engine.store.paths import inside, is_repo_id
from engine.units import format_bytes
from engine.untrusted import read_json_file

logger = logging.getLogger(__name__)

MAX_MANIFEST_BYTES = 4 << 20  # a manifest lists file names and sizes: kilobytes
MANIFEST_NAME = "specchat-model.json"
MANIFEST_VERSION = 1
PARTIAL_DIR = ".partial"


@dataclass(frozen=True)
class LocalModel:
    """A model usable now. `path` is what the loader takes: a HF folder or a .gguf file."""

    model_id: str
    repo_id: str | None
    source: str  # "hub" | "import" | "pypi-wheel" | "hf-cache" | "lmstudio" | "ollama"
    path: Path
    size_bytes: int
    files: tuple[str, ...]
    revision: str | None
    folder: Path | None  # registry folder; None for HF-cache and found models
    owns_files: bool  # removing it frees size_bytes
    detail: str = ""  # what a found GGUF is: "Q4_K_M · llama"


FOUND_SOURCES = {"lmstudio": "LM Studio", "ollama": "Ollama"}


def found_as_local(found: FoundModel) -> LocalModel:
    """A GGUF LM Studio or Ollama keeps, as a local model used in place."""
    source = "lmstudio" if found.app == LM_STUDIO else "ollama"
    return LocalModel(found.name, None, source, found.path, found.size_bytes, (found.path.name,), None, None, False,
                      found.detail)


def write_json_atomic(path: Path, data: dict[str, Any]) -> None:
    """Write JSON so a crash leaves either the old file or the new one, never half of one (on
    the disk before the rename: a manifest or a download's state)."""
    engine_paths.write_json_atomic(path, data, durable=True)


def manifest_data(
    *, model_id: str, repo_id: str | None, source: str, path: str, revision: str | None,
    files: list[dict[str, Any]],
) -> dict[str, Any]:
    return {
        "manifest_version": MANIFEST_VERSION,
        "model_id": model_id,
        "repo_id": repo_id,
        "source": source,
        "path": path,
        "revision": revision,
        "files": files,
        "registered_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }


def read_manifest(folder: Path) -> LocalModel | None:
    """The model registered in `folder`, or None if there is no valid manifest (a damaged one is
    skipped with a warning). A relative `path` must stay inside `folder`."""
    manifest = folder / MANIFEST_NAME
    try:
        data = read_json_file(manifest, what="The manifest", max_bytes=MAX_MANIFEST_BYTES)
        if not isinstance(data, dict):
            raise TypeError("not a JSON object")
        raw_path, entries = data.get("path"), data.get("files")
        model_id, source = data.get("model_id"), data.get("source")
        if not isinstance(raw_path, str) or not raw_path or not isinstance(entries, list):
            raise TypeError("its path must be text and its files a list")
        if not isinstance(model_id, str) or not isinstance(source, str) or not model_id:
            raise TypeError("model_id and source must be text")
        if not all(isinstance(f, dict) and isinstance(f.get("name"), str) and _count(f.get("size")) for f in entries):
            raise TypeError("each file must be a name and a size in bytes")
        target = Path(raw_path)
        if target.is_absolute():
            path = target  # an import by reference: the files stay where they are
        else:  # "." (the folder itself) or a file in it
            path = folder if raw_path == "." else inside(folder, raw_path, f"The manifest {manifest}")
        files = tuple(f["name"] for f in entries)
        size = sum(f["size"] for f in entries)
        repo_id, revision = data.get("repo_id"), data.get("revision")
        return LocalModel(model_id, repo_id if isinstance(repo_id, str) else None, source, path.resolve(), size,
                          files, revision if isinstance(revision, str) else None, folder, not target.is_absolute())
    except FileNotFoundError:
        return None
    except (OSError, ValueError, TypeError, RuntimeError, UnsupportedModel, MalformedInput) as exc:
        # RuntimeError: a symlink loop (Path.resolve); UnsupportedModel: a path that leaves the folder;
        # MalformedInput: nested too deep, too large, not JSON, or a pipe or folder where the file belongs
        reason = exc.user_message if isinstance(exc, (UnsupportedModel, MalformedInput)) \
            else f"{type(exc).__name__}: {exc}"
        logger.warning("ignoring the damaged manifest %s (%s)", manifest, reason[:300])
        return None


def _count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def list_local_models(models_dir: Path, hf_cache_dir: Path | None = None,
                      found: list[FoundModel] | tuple[FoundModel, ...] = ()) -> list[LocalModel]:
    """Registered models, then HF-cache models not already registered under the same repo id,
    then the runnable `found` GGUFs (discover.py) not already imported."""
    listed: list[LocalModel] = []
    try:
        folders = sorted(models_dir.iterdir()) if models_dir.is_dir() else []
    except OSError as exc:
        logger.warning("cannot list the models folder %s (%s)", models_dir, exc.strerror or exc)
        folders = []
    for folder in folders:
        if folder.is_dir() and not folder.name.startswith("."):
            model = read_manifest(folder)
            if model is not None:
                listed.append(model)
    if hf_cache_dir is not None:
        known = {m.repo_id.lower() for m in listed if m.repo_id}
        for cached in list_cached_repos(hf_cache_dir):
            if cached.repo_id.lower() not in known:
                listed.append(_from_cache(cached.repo_id, cached))
    paths = {m.path for m in listed}
    listed += [found_as_local(f) for f in found if f.runnable and f.path.resolve() not in paths]
    return listed


def find_local_model(
    spec: str, models_dir: Path, hf_cache_dir: Path | None, catalog: Catalog | None
) -> LocalModel | None:
    """A local model by catalog id, repo id or import name; registry first, then the HF cache."""
    entry = catalog.find(spec) if catalog is not None else None
    repo_id = entry.repo_id if entry is not None else (spec if is_repo_id(spec) else None)
    found = match_local(list_local_models(models_dir), spec, entry)
    if found is not None:
        return found
    if hf_cache_dir is not None and repo_id is not None:
        cached = find_cached_repo(repo_id, hf_cache_dir, entry.revision if entry else "main",
                                  entry.gguf_file if entry else None)
        if cached is not None:
            return _from_cache(entry.id if entry else repo_id, cached)
    return None


def match_local(models: Iterable[LocalModel], spec: str, entry: CatalogModel | None) -> LocalModel | None:
    """The model of `models` that `spec` names: by id (the catalog entry's too), else by repo id
    (`entry`'s, or `spec` itself when it is one); ids compare by names.name_key (case and
    Unicode normalisation do not matter). A GGUF catalog entry is one file of its repo:
    another quantisation downloaded from there is not this model."""
    names = {name_key(spec)} | ({name_key(entry.id)} if entry else set())
    repo = (entry.repo_id if entry else spec if is_repo_id(spec) else "").lower()
    gguf = entry.gguf_file if entry else None
    for model in models:
        if name_key(model.model_id) in names:
            return model
        if repo and (model.repo_id or "").lower() == repo and (gguf is None or model.path.name == gguf):
            return model
    return None


def _from_cache(model_id: str, cached: Any) -> LocalModel:
    return LocalModel(
        model_id, cached.repo_id, "hf-cache", cached.path, cached.size_bytes, cached.files,
        cached.commit, None, False,
    )


def import_model(path: Path, models_dir: Path, name: str | None = None, copy: bool = False) -> LocalModel:
    """Register a local HF folder or .gguf file; with `copy` its files move under the models folder.
    Refused: what cannot load, damaged files (integrity.py), and names names.py does not allow or
    that are already taken up to case and normalisation."""
    try:
        source = path.expanduser().resolve()
    except (RuntimeError, OSError) as exc:  # RuntimeError: Python's "Symlink loop from ..."
        raise ModelNotFound(f"Cannot import {path}: it is a symbolic link that leads back to itself.") from exc
    if not source.exists():
        raise ModelNotFound(f"Nothing to import at {source}: check the path.")
    if source.is_file():
        if source.suffix.lower() != ".gguf" and not _starts_like_gguf(source):  # Ollama's blobs have no suffix
            raise UnsupportedModel(
                f"{source.name} is not a .gguf file. Import a .gguf file or a Hugging Face folder "
                "(config.json + *.safetensors + tokenizer files)."
            )
        files = split_parts(source)  # every part of a split model, which is named by its first
        missing = [p.name for p in files if not p.exists()]  # a pipe or folder there: the check below says so
        if missing:
            raise ModelNotFound(f"{source.name} is one of {len(files)} files of a split model, but "
                                f"{', '.join(missing[:3])} {'is' if len(missing) == 1 else 'are'} not beside it. "
                                "Put every part in the same folder, then import again.")
        source = files[0]
    elif not source.is_dir():
        raise UnsupportedModel(f"{source} is a named pipe, socket or device, not a model: import a .gguf file or "
                               "a Hugging Face folder.")
    else:
        if not (source / "config.json").is_file() or not any(source.glob("*.safetensors")):
            raise UnsupportedModel(
                f"{source} is not a Hugging Face model folder: it needs config.json and *.safetensors "
                "weights (pickle .bin checkpoints are not loaded, for safety)."
            )
        broken = sorted(p.name for p in source.iterdir() if p.is_symlink() and not p.exists())
        if broken:
            raise UnsupportedModel(
                f"{source} holds symbolic links that lead nowhere (a loop or a missing file): {', '.join(broken[:4])}. "
                "Fix or remove them, then import again."
            )
        files = sorted(p for p in source.iterdir() if p.is_file())
    not_text = next((p for p in (source, *files) if not _is_text(str(p))), None)
    if not_text is not None:  # the manifest could not hold it, and the model readers cannot open it
        raise UnsupportedModel(f"{not_text} cannot be imported: its name holds bytes that are not UTF-8 text, which "
                               "the model readers cannot open. Rename it (letters in any script are fine) and import "
                               "again.")
    split = SPLIT_NAME.match(source.name) if source.is_file() else None
    stem = split["stem"] if split else source.stem if source.is_file() else source.name
    model_name = check_import_name(name if name is not None else default_import_name(stem))
    folder = inside(models_dir, f"local--{model_name}", "The import name")
    _check_name_free(model_name, folder, models_dir)
    check_model_files(source)  # a GGUF cut short, a shard missing its end: refused before registering
    entries: list[dict[str, Any]] = [{"name": p.name, "size": p.stat().st_size} for p in files]
    if copy:
        needed = sum(e["size"] for e in entries)
        models_dir.mkdir(parents=True, exist_ok=True)
        free = shutil.disk_usage(models_dir).free
        if needed > free:
            raise DiskFull(
                f"Copying {model_name} needs {format_bytes(needed)} but only {format_bytes(free)} is free "
                f"on {models_dir} ({format_bytes(needed - free)} short). Free space, or import without copying."
            )
        staging = models_dir / PARTIAL_DIR / folder.name
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
        for p in files:
            shutil.copy2(p, staging / p.name)
        target = files[0].name if source.is_file() else "."
        write_json_atomic(staging / MANIFEST_NAME, manifest_data(
            model_id=model_name, repo_id=None, source="import", path=target, revision=None, files=entries))
        if folder.is_dir():  # a leftover without manifest (a crash during an earlier remove)
            shutil.rmtree(folder)
        os.replace(staging, folder)
    else:
        write_json_atomic(folder / MANIFEST_NAME, manifest_data(
            model_id=model_name, repo_id=None, source="import", path=str(source), revision=None, files=entries))
    model = read_manifest(folder)
    assert model is not None
    logger.info("imported %s from %s (copy=%s)", model_name, source, copy)
    return model


def _is_text(name: str) -> bool:
    """Whether a path is Unicode text (Python keeps bytes that are not UTF-8 as lone surrogates)."""
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _check_name_free(name: str, folder: Path, models_dir: Path) -> None:
    """InvalidRequest when a registered model already goes by `name`, up to case and Unicode
    normalisation: on Windows and macOS the two would share one folder, and by name either
    spelling would find either model."""
    taken = next((m for m in list_local_models(models_dir) if name_key(m.model_id) == name_key(name)
                  or name_key(m.folder.name if m.folder else "") == name_key(folder.name)), None)
    if (folder / MANIFEST_NAME).exists() or taken is not None:
        other = taken.model_id if taken is not None else name
        same = "" if other == name else " (names that differ only in case or accents' encoding are the same name)"
        raise InvalidRequest(
            f"A model named {other!r} is already imported{same}. Remove it first "
            f"(specchat models remove {other}) or pass another --name."
        )


def _starts_like_gguf(path: Path) -> bool:
    try:
        with open_regular(path) as f:
            return f.read(4) == b"GGUF"
    except (OSError, CorruptGGUF):
        return False


def remove_model(model: LocalModel) -> int:
    """Delete a registered model's folder; returns the bytes freed (0 for imports by reference)."""
    if model.source in FOUND_SOURCES:
        raise InvalidRequest(
            f"{model.model_id} belongs to {FOUND_SOURCES[model.source]} ({model.path}); SpecChat only uses it "
            f"where it is. Remove it in {FOUND_SOURCES[model.source]}."
        )
    if model.folder is None:
        raise InvalidRequest(
            f"{model.model_id} lives in the Hugging Face cache ({model.path}), which other apps share. "
            "Remove it with `hf cache delete` (huggingface_hub's CLI)."
        )
    freed = model.size_bytes if model.owns_files else 0
    # Unregister first (manifest gone), then delete the files: a crash in between leaves an
    # unlisted folder, never a listed model with missing files.
    (model.folder / MANIFEST_NAME).unlink(missing_ok=True)
    shutil.rmtree(model.folder, ignore_errors=True)
    logger.info("removed %s (%d bytes freed)", model.model_id, freed)
    return freed
