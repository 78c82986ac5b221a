"""What a hub repo holds: its commit, files, sizes and checksums, via huggingface_hub.

`fetch_repo` calls `HfApi(endpoint=...).model_info(files_metadata=True)` (the `?blobs=true` model
info: siblings with size, git blob id and LFS sha256) and maps hub errors to EngineErrors a user
can act on. The endpoint is passed explicitly because huggingface_hub reads HF_ENDPOINT once at
import.
"""

from __future__ import annotations

import fnmatch
import logging
from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import Callable

import httpx2
from huggingface_hub import HfApi
from huggingface_hub.errors import HfHubHTTPError

from engine.errors import (
    DownloadFailed,
    GatedRepo,
    HubUnreachable,
    ModelNotFound,
    UnsupportedModel,
)
from engine.store.gguf_header import split_parts
from engine.store.paths import check_file_name

logger = logging.getLogger(__name__)

# Files a HF folder needs to load; never `original/` (Meta's consolidated .pth) or pickles.
DEFAULT_PATTERNS = (
    "config.json", "generation_config.json", "*.safetensors", "model.safetensors.index.json",
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
    "vocab.json", "merges.txt", "tokenizer.model", "chat_template.jinja", "chat_template.json",
)


@dataclass(frozen=True)
class RemoteFile:
    name: str
    size: int
    sha256: str | None  # LFS files: the hub's sha256 of the content
    blob_id: str | None  # git blob sha1 (of "blob <size>\0" + content) for non-LFS files


@dataclass(frozen=True)
class RemoteRepo:
    repo_id: str
    commit: str
    files: tuple[RemoteFile, ...]
    gated: bool


def gated_message(repo_id: str, endpoint: str, had_token: bool) -> str:
    page = f"{endpoint}/{repo_id}"
    if had_token:
        return (
            f"The hub refused the token for {repo_id}: it is gated. Accept the licence at {page} with "
            f"the account that owns the token (approval can take a while), or paste a token with "
            f"read access from {endpoint}/settings/tokens."
        )
    return (
        f"{repo_id} is gated: accept the licence at {page} and paste a token with read access "
        f"(from {endpoint}/settings/tokens) in Settings → Hugging Face; on the command line run "
        f"`hf auth login`, pass --token or set HF_TOKEN."
    )


def fetch_repo(
    repo_id: str, revision: str, token: str | None, endpoint: str, timeout_s: float,
    retries: int = 3, wait: Callable[[float], None] | None = None, backoff_s: float = 1.0,
) -> RemoteRepo:
    """The repo's file list at `revision`, pinned to one commit. Retries network errors."""
    api = HfApi(endpoint=endpoint, token=token if token else None)
    info = None
    last_error: Exception | None = None
    for attempt in range(retries + 1):
        try:
            info = api.model_info(repo_id, revision=revision, files_metadata=True, timeout=timeout_s)
            break
        except HfHubHTTPError as exc:
            status = exc.response.status_code if exc.response is not None else 0
            if status in (401, 403):
                raise GatedRepo(gated_message(repo_id, endpoint, bool(token))) from exc
            if status == 404:
                raise ModelNotFound(
                    f"{repo_id} (revision {revision}) was not found on {endpoint}. Check the spelling; "
                    "private repos also answer this without a token."
                ) from exc
            if status not in (408, 429, 500, 502, 503, 504):
                raise DownloadFailed(f"The hub answered {status} for {repo_id}: {exc}. Try again later.") from exc
            last_error = exc
        except (httpx2.TransportError, OSError) as exc:
            last_error = exc
        logger.info("model info for %s failed (attempt %d): %s", repo_id, attempt + 1, last_error)
        if attempt < retries and wait is not None:
            wait(min(backoff_s * 2.0 ** attempt, 30.0))  # raises Cancelled if the user cancels meanwhile
    if info is None:
        raise HubUnreachable(
            f"Cannot reach the Hugging Face hub at {endpoint} ({last_error.__class__.__name__}: {last_error}). "
            "Check the internet connection or proxy, then try again; partial downloads are kept."
        ) from last_error
    siblings = info.siblings or []
    files = tuple(
        RemoteFile(
            check_file_name(s.rfilename, f"The repository {repo_id}"),
            int(s.lfs.size if s.lfs else (s.size or 0)),
            s.lfs.sha256 if s.lfs else None,
            None if s.lfs else s.blob_id,
        )
        for s in siblings
    )
    commit = info.sha or revision
    return RemoteRepo(repo_id, commit, files, bool(info.gated))


def select_files(repo: RemoteRepo, patterns: tuple[str, ...] | None, gguf_file: str | None) -> tuple[RemoteFile, ...]:
    """The files to fetch: one named .gguf, else the loadable HF folder, else the repo's only .gguf."""
    top_level = [f for f in repo.files if "/" not in f.name]
    if gguf_file is not None:
        # a split model (<name>-00001-of-00003.gguf) is all its parts, whichever one was named
        wanted_names = [p.as_posix() for p in split_parts(PurePosixPath(gguf_file))]
        by_name = {f.name: f for f in repo.files}
        chosen = [by_name[n] for n in wanted_names if n in by_name]
        if gguf_file not in by_name:
            raise ModelNotFound(f"{repo.repo_id} has no file {gguf_file!r}.")
        if len(chosen) != len(wanted_names):
            absent = [n for n in wanted_names if n not in by_name]
            raise ModelNotFound(f"{repo.repo_id} has only {len(chosen)} of the {len(wanted_names)} parts of "
                                f"{gguf_file} (no {absent[0]}), so it cannot be loaded.")
        return tuple(chosen)
    wanted = patterns or DEFAULT_PATTERNS
    chosen = [f for f in top_level if any(fnmatch.fnmatchcase(f.name, p) for p in wanted)]
    if any(f.name.endswith(".safetensors") for f in chosen) and any(f.name == "config.json" for f in chosen):
        return tuple(chosen)
    ggufs = [f for f in repo.files if f.name.endswith(".gguf")]
    if len(ggufs) == 1:
        return (ggufs[0],)
    if ggufs:
        listing = ", ".join(f.name for f in ggufs[:6])
        raise UnsupportedModel(
            f"{repo.repo_id} holds several GGUF files ({listing}{', ...' if len(ggufs) > 6 else ''}). "
            f"Pick one as {repo.repo_id}:FILE.gguf."
        )
    raise UnsupportedModel(
        f"{repo.repo_id} has no safetensors weights with a config.json and no .gguf file, so SpecChat "
        "cannot load it (pickle .bin checkpoints are refused for safety)."
    )
