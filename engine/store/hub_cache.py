"""Models already in the standard Hugging Face cache (`~/.cache/huggingface/hub`), found and
reused in place, never copied or downloaded again.

Reads the cache layout directly (`models--owner--name/refs/<rev>`, `snapshots/<commit>/...`
symlinks into `blobs/`) instead of `huggingface_hub.scan_cache_dir`, which walks every repo and
raises on the odd entries other tools leave there. Never writes to the cache. Refs and index
files are read through engine.untrusted (regular files only, size and nesting bounded). A
damaged entry (a ref that is not a commit name, an unreadable index, a snapshot that cannot be
listed) is skipped with one warning naming it; the rest of the cache stays usable.
"""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path

from engine.errors import MalformedInput
from engine.untrusted import read_bytes, read_json_file

logger = logging.getLogger(__name__)

# What a ref file may name: a snapshot folder (a commit hash), never a path ("../..", "/").
_SNAPSHOT_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$")
MAX_REF_BYTES = 1024  # a commit hash and a newline
MAX_INDEX_BYTES = 64 << 20  # a weight map of a 100k-tensor model is a few MiB


@dataclass(frozen=True)
class CachedRepo:
    """One usable snapshot of a model repo in the HF cache."""

    repo_id: str
    commit: str
    path: Path  # the snapshot folder, or the .gguf file when the snapshot holds only GGUF files
    size_bytes: int
    files: tuple[str, ...]


def find_cached_repo(repo_id: str, cache_dir: Path, revision: str = "main",
                     gguf_file: str | None = None) -> CachedRepo | None:
    """The snapshot `revision` points to (or the newest complete one), if it is loadable. With
    `gguf_file`, only a snapshot holding that file counts, and it is the model (a GGUF repo
    holds many quantisations; another one cached there is not this model)."""
    try:
        return _find_cached_repo(repo_id, cache_dir, revision, gguf_file)
    except (OSError, ValueError, MalformedInput) as exc:  # ValueError: undecodable text, a NUL in a name
        why = exc.user_message if isinstance(exc, MalformedInput) else exc
        logger.warning("ignoring %s in the Hugging Face cache %s: it is damaged (%s)", repo_id, cache_dir, why)
        return None


def _find_cached_repo(repo_id: str, cache_dir: Path, revision: str, gguf_file: str | None) -> CachedRepo | None:
    repo_dir = cache_dir / ("models--" + repo_id.replace("/", "--"))
    if not repo_dir.is_dir():
        # Repo ids are case-insensitive on the hub; folder names keep the case used to download.
        lowered = repo_dir.name.lower()
        matches = [p for p in cache_dir.glob("models--*") if p.name.lower() == lowered] if cache_dir.is_dir() else []
        if not matches:
            return None
        repo_dir = matches[0]
    snapshots = repo_dir / "snapshots"
    candidates: list[Path] = []
    ref = repo_dir / "refs" / revision
    if ref.is_file():
        commit: str | None = None
        try:
            commit = read_bytes(ref, what="The ref", max_bytes=MAX_REF_BYTES).decode("utf-8", errors="replace").strip()
        except MalformedInput as exc:  # far too large for a commit name: the other snapshots may still do
            logger.warning("ignoring the damaged ref %s in the Hugging Face cache (%s)", ref, exc.user_message)
        if commit is None:
            pass
        elif _SNAPSHOT_NAME.match(commit):
            candidates.append(snapshots / commit)
        else:  # the other snapshots may still do
            logger.warning("ignoring the damaged ref %s in the Hugging Face cache (it names %r, not a commit)",
                           ref, commit[:40])
    elif _SNAPSHOT_NAME.match(revision) and (snapshots / revision).is_dir():
        candidates.append(snapshots / revision)
    if snapshots.is_dir():
        others = sorted(
            (p for p in snapshots.iterdir() if p.is_dir() and p not in candidates),
            key=lambda p: p.stat().st_mtime,
            reverse=True,
        )
        candidates.extend(others)
    for snapshot in candidates:
        found = _gguf_in_snapshot(repo_id, snapshot, gguf_file) if gguf_file else _usable_snapshot(repo_id, snapshot)
        if found is not None:
            return found
    return None


def list_cached_repos(cache_dir: Path) -> list[CachedRepo]:
    """Every model repo in the cache with a loadable snapshot."""
    try:
        repo_dirs = sorted(cache_dir.glob("models--*--*")) if cache_dir.is_dir() else []
    except OSError as exc:
        logger.warning("cannot list the Hugging Face cache %s (%s)", cache_dir, exc.strerror)
        return []
    found: list[CachedRepo] = []
    for repo_dir in repo_dirs:
        repo_id = repo_dir.name[len("models--"):].replace("--", "/", 1)
        cached = find_cached_repo(repo_id, cache_dir)
        if cached is not None:
            found.append(cached)
    return found


def _usable_snapshot(repo_id: str, snapshot: Path) -> CachedRepo | None:
    """A snapshot with config.json and every safetensors shard its index names, or one .gguf.

    Dangling links (blob deleted, or download interrupted before the blob landed) disqualify it.
    """
    if not snapshot.is_dir():
        return None
    files = {p.relative_to(snapshot).as_posix(): p for p in snapshot.rglob("*") if p.is_file()}
    size = sum(p.stat().st_size for p in files.values())
    names = tuple(sorted(files))
    index = snapshot / "model.safetensors.index.json"
    if "config.json" in files and os.path.lexists(index):  # a pipe, or a link to a missing blob: damaged
        try:
            data = read_json_file(index, what="Its safetensors index", max_bytes=MAX_INDEX_BYTES)
            weight_map = data.get("weight_map") if isinstance(data, dict) else None
            if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
                raise ValueError(f"{index} has no weight map of tensor names to shard files")
            shards = set(weight_map.values())
        except (OSError, ValueError, MalformedInput) as exc:
            why = exc.user_message if isinstance(exc, MalformedInput) else exc
            logger.warning("ignoring %s in the Hugging Face cache: its safetensors index is unreadable (%s)",
                           snapshot, str(why)[:300])
            return None
        if shards and all(s in files for s in shards):
            return CachedRepo(repo_id, snapshot.name, snapshot, size, names)
        return None
    if "config.json" in files and any(n.endswith(".safetensors") for n in names):
        return CachedRepo(repo_id, snapshot.name, snapshot, size, names)
    ggufs = [n for n in names if n.endswith(".gguf")]
    if len(ggufs) == 1:
        return CachedRepo(repo_id, snapshot.name, files[ggufs[0]], size, names)
    return None


def _gguf_in_snapshot(repo_id: str, snapshot: Path, name: str) -> CachedRepo | None:
    """`name` in the snapshot, when its link leads to a blob that is there."""
    path = snapshot / name
    if "/" in name or "\\" in name or name.startswith(".") or not path.is_file():
        return None
    return CachedRepo(repo_id, snapshot.name, path, path.stat().st_size, (name,))
