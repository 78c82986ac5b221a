"""Models already in the standard Hugging Face cache (`~/.cache/huggingface/hub`), found and
reused in place, never copied or downloaded again.

Reads the cache layout directly (`models--owner--name/refs/<rev>`, `snapshots/<commit>/...`
symlinks into `blobs/`) instead of `huggingface_hub.scan_cache_dir`, which walks every repo and
raises on the odd entries other tools leave there. Never writes to the cache.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class CachedRepo:
    """One usable snapshot of a model repo in the HF cache."""

    repo_id: str
    commit: str
    path: Path  # the snapshot folder, or the .gguf file when the snapshot holds only GGUF files
    size_bytes: int
    files: tuple[str, ...]


def find_cached_repo(repo_id: str, cache_dir: Path, revision: str = "main") -> CachedRepo | None:
    """The snapshot `revision` points to (or the newest complete one), if it is loadable."""
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
        candidates.append(snapshots / ref.read_text(encoding="utf-8").strip())
    elif (snapshots / revision).is_dir():
        candidates.append(snapshots / revision)
    if snapshots.is_dir():
        others = sorted(
            (p for p in snapshots.iterdir() if p.is_dir() and p not in candidates),
            key=lambda p: p.stat().st_mtime,
            reverse=True,
        )
        candidates.extend(others)
    for snapshot in candidates:
        found = _usable_snapshot(repo_id, snapshot)
        if found is not None:
            return found
    return None


def list_cached_repos(cache_dir: Path) -> list[CachedRepo]:
    """Every model repo in the cache with a loadable snapshot."""
    if not cache_dir.is_dir():
        return []
    found: list[CachedRepo] = []
    for repo_dir in sorted(cache_dir.glob("models--*--*")):
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
    if "config.json" in files and index.is_file():
        try:
            shards = set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values())
        except (OSError, ValueError, KeyError):
            logger.warning("unreadable safetensors index in %s", snapshot)
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
