"""GGUF models that LM Studio and Ollama keep, found where they are so SpecChat can use them in
place (no copy): name, size, quantisation and architecture, read from each file's header.

- LM Studio: `<models folder>/<publisher>/<repo>/<file>.gguf`, in ~/.lmstudio/models, (older
  versions) ~/.cache/lm-studio/models, or where its settings.json's "downloadsFolder" moved it.
  Vision projectors (mmproj-*.gguf) are not models. A model split into several files
  (`<name>-00001-of-00003.gguf`) is one entry, by its first part, sized as all parts; with a
  part missing it is listed as not runnable, naming the part.
- Ollama: ~/.ollama/models (or $OLLAMA_MODELS): `manifests/<registry>/<namespace>/<model>/<tag>`
  are JSON manifests whose "application/vnd.ollama.image.model" layer names the weights by
  digest, stored as `blobs/sha256-<hex>`.

Every name read from a folder listing or a manifest is checked (paths.check_file_name, inside)
before it becomes a path that is touched: a hostile manifest cannot lead outside Ollama's
folder. Manifests and LM Studio's settings.json are read through engine.untrusted (regular files
only, size and nesting bounded); a manifest's fields are checked for type before use. A broken
manifest or settings file, a missing or short blob, a pipe, folder or dangling link where a model
file belongs, and a GGUF whose header is damaged or whose file is shorter than the tensors it
declares (every part of a split model is checked) each become one line in `Discovery.problems`,
and the rest of the list still shows. Header facts are remembered per (path, size, modification
time), so listing again costs a directory walk.

What this module does not do: load models (engine.loading) or import torch.
"""

from __future__ import annotations

import itertools
import logging
import os
import re
import stat
import unicodedata
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from engine.errors import MalformedInput, UnsupportedModel
from engine.store.gguf_header import (
    SPLIT_NAME,
    CorruptGGUF,
    GGUFHeader,
    read_header,
    read_model,
    split_parts,
)
from engine.store.gguf_archs import RUNNABLE, RUNS
from engine.store.names import name_key
from engine.store.paths import check_file_name, inside
from engine.untrusted import read_json_file

log = logging.getLogger(__name__)

LM_STUDIO, OLLAMA = "LM Studio", "Ollama"
MODEL_LAYER = "application/vnd.ollama.image.model"
MAX_MANIFEST_BYTES = 1 << 20
MAX_WALK_ENTRIES = 50_000  # per folder searched: far more than any model library holds
MAX_WALK_PROBLEMS = 20  # lines per folder searched; the rest are counted
_DIGEST = re.compile(r"^sha256[:-]([0-9a-f]{64})$")


@dataclass(frozen=True)
class FoundModel:
    name: str  # LM Studio: the file name without .gguf; Ollama: "model:tag" as `ollama list` shows it
    app: str  # LM_STUDIO | OLLAMA
    path: Path  # the GGUF itself (for Ollama, its blob)
    size_bytes: int
    architecture: str
    quantisation: str  # "Q4_K_M", or the most common tensor type when the file does not say
    runnable: bool
    note: str = ""  # why it cannot run, when it cannot

    @property
    def detail(self) -> str:
        """"Q4_K_M · llama", as the models page and `models list` show it."""
        return f"{self.quantisation} · {self.architecture}" + (f" ({self.note})" if self.note else "")


@dataclass(frozen=True)
class Discovery:
    models: tuple[FoundModel, ...]
    problems: tuple[str, ...]  # one line each, for the user


def app_folders(home: Path | None = None) -> list[tuple[str, Path]]:
    """Where LM Studio and Ollama keep models on this machine (existing or not)."""
    return _app_folders(home, [])


def _app_folders(home: Path | None, problems: list[str]) -> list[tuple[str, Path]]:
    home = home or Path.home()
    ollama = os.environ.get("OLLAMA_MODELS")
    lm_studio = [home / ".lmstudio" / "models", home / ".cache" / "lm-studio" / "models"]
    moved = _lm_studio_moved(home, problems)
    return [(LM_STUDIO, p) for p in lm_studio + ([moved] if moved and moved not in lm_studio else [])] + [
        (OLLAMA, Path(ollama).expanduser() if ollama else home / ".ollama" / "models")]


def _lm_studio_moved(home: Path, problems: list[str]) -> Path | None:
    """The models folder a user chose in LM Studio ("downloadsFolder" in its settings.json), if
    any. The file is untrusted: only an absolute path is taken, and only ever read from; a file
    that cannot be read is one line in `problems`."""
    for settings in (home / ".lmstudio" / "settings.json", home / ".cache" / "lm-studio" / "settings.json"):
        try:
            data = read_json_file(settings, what=f"{LM_STUDIO}'s settings", max_bytes=MAX_MANIFEST_BYTES)
        except FileNotFoundError:
            continue
        except (OSError, MalformedInput) as exc:
            why = exc.user_message if isinstance(exc, MalformedInput) else f"{settings}: {exc.strerror or exc}"
            problems.append(f"{why.rstrip('.')}; a models folder moved in {LM_STUDIO} is not searched.")
            continue
        if not isinstance(data, dict):
            problems.append(f"{LM_STUDIO}'s settings ({settings}) is not a JSON object; a models folder moved in "
                            f"{LM_STUDIO} is not searched.")
            continue
        folder = data.get("downloadsFolder")
        if isinstance(folder, str) and folder and "\0" not in folder and Path(folder).expanduser().is_absolute():
            return Path(folder).expanduser()
        if folder not in (None, ""):
            problems.append(f"{LM_STUDIO}'s settings ({settings}): its downloadsFolder {str(folder)[:80]!r} is not "
                            "an absolute folder path; ignored.")
    return None


class HeaderFacts:
    """Header facts by (path, size, mtime): each file's header is read once per change. A
    caller that lists again and again (the models page) keeps one."""

    def __init__(self) -> None:
        self._known: dict[tuple[str, int, int], tuple[str, str, int]] = {}
        self._whole: set[tuple[tuple[str, int, int], ...]] = set()

    def of(self, path: Path) -> tuple[str, str, int]:
        """(architecture, quantisation, split count) of a GGUF; CorruptGGUF/OSError if unreadable
        (a damaged header, a file shorter than its tensors, not a regular file)."""
        key = _stat_key(path)
        if key not in self._known:
            self._known[key] = _describe(read_header(path))
        return self._known[key]

    def check_parts(self, files: Sequence[Path]) -> None:
        """CorruptGGUF unless every part of a split model is whole and the parts belong together."""
        key = tuple(_stat_key(f) for f in files)
        if key not in self._whole:
            read_model(files[0])
            self._whole.add(key)


def _stat_key(path: Path) -> tuple[str, int, int]:
    st = path.stat()
    return str(path), st.st_size, st.st_mtime_ns


def discover_models(folders: Sequence[tuple[str, Path]] | None = None,
                    facts: HeaderFacts | None = None) -> Discovery:
    """GGUF models in LM Studio's and Ollama's folders (app_folders() unless given)."""
    facts = facts or HeaderFacts()
    problems: list[str] = []
    folders = folders if folders is not None else _app_folders(None, problems)
    models = [m for c in _candidates(folders, problems) if (m := _found(*c, facts, problems)) is not None]
    return Discovery(tuple(models), tuple(problems))


def locate_found(name: str, folders: Sequence[tuple[str, Path]] | None = None) -> Path | None:
    """The GGUF of a found model by its name ("llama3.1:8b"; case and Unicode normalisation do not
    matter, as for imports), reading no header; None if absent."""
    key = name_key(name)
    return next((path for found, _, path, _ in _candidates(folders if folders is not None else app_folders(), [])
                 if name_key(found) == key), None)


Candidate = tuple[str, str, Path, str]  # name, app, path, where (for messages)


def _candidates(folders: Sequence[tuple[str, Path]], problems: list[str]) -> list[Candidate]:
    out: list[Candidate] = []
    seen: set[Path] = set()
    names: set[str] = set()
    for app, root in folders:
        if not root.is_dir():
            continue
        for c in _lm_studio(root, problems) if app == LM_STUDIO else _ollama(root, problems):
            try:
                real = c[2].resolve()
            except (OSError, RuntimeError):  # RuntimeError: a symlink loop (Python < 3.13)
                real = c[2]
            if real in seen:  # the same file reached twice
                continue
            seen.add(real)
            if c[0] in names and app == LM_STUDIO:  # the same file name in two repos: the later by its path
                c = (c[3].removeprefix(f"{LM_STUDIO}: ")[: -len(".gguf")], *c[1:])
            names.add(c[0])
            out.append(c)
    return out


def _is_model_file(rel: str) -> bool:
    name = rel.rsplit("/", 1)[-1].lower()
    return name.endswith(".gguf") and not name.startswith("mmproj")  # vision projectors are not models


def _lm_studio(root: Path, problems: list[str]) -> list[Candidate]:
    found = []
    for rel in _walk(root, 4, problems, f"{LM_STUDIO}'s folder {root}", _is_model_file):
        name = rel.rsplit("/", 1)[-1]
        split = SPLIT_NAME.match(name)
        if split and split["no"] != "00001":
            continue  # a later part of a split model: listed once, by its first part
        path = root / rel  # checked by _walk
        stem = split["stem"] if split else name[: -len(".gguf")]
        found.append((unicodedata.normalize("NFC", stem), LM_STUDIO, path, f"{LM_STUDIO}: {rel}"))
    return found


class _BrokenManifest(ValueError):
    """What is wrong with an Ollama manifest, for its one line."""


def _ollama(root: Path, problems: list[str]) -> list[Candidate]:
    manifests, blobs = root / "manifests", root / "blobs"
    found = []
    if not os.path.lexists(manifests):  # nothing pulled yet
        return []
    for rel in _walk(manifests, 4, problems, f"{OLLAMA}'s manifests", lambda r: r.count("/") == 3):
        parts = rel.split("/")
        if len(parts) != 4:
            continue
        host, namespace, model, tag = parts
        name = f"{model}:{tag}" if (host, namespace) == ("registry.ollama.ai", "library") else \
            f"{namespace}/{model}:{tag}" if host == "registry.ollama.ai" else f"{host}/{namespace}/{model}:{tag}"
        where = f"{OLLAMA}'s {name}"
        try:
            manifest = inside(manifests, rel, f"{OLLAMA}'s manifests")
            digest, size = _model_layer(read_json_file(manifest, what=f"{OLLAMA}'s manifest",
                                                       max_bytes=MAX_MANIFEST_BYTES))
            blob = inside(blobs, f"sha256-{digest}", where)
        except UnsupportedModel as exc:
            problems.append(exc.user_message)
            continue
        except (OSError, MalformedInput, _BrokenManifest) as exc:
            why = exc.user_message if isinstance(exc, MalformedInput) else \
                str(exc) if isinstance(exc, _BrokenManifest) else exc.strerror or type(exc).__name__
            problems.append(f"{where}: its manifest is broken ({why.rstrip('.')}); re-pull it with "
                            f"`ollama pull {name}`.")
            continue
        short = f"blob sha256-{digest[:12]}…"
        try:
            st = blob.stat()
        except OSError:  # not there, a link that leads nowhere, or a loop
            problems.append(f"{where}: its weights ({short}) are missing; re-pull it with `ollama pull {name}`.")
            continue
        if size is not None and stat.S_ISREG(st.st_mode) and st.st_size != size:  # not a file: _found says so
            problems.append(f"{where}: its weights ({short}) are {st.st_size:,} bytes where the manifest says "
                            f"{size:,} (an interrupted pull, or damaged); re-pull it with `ollama pull {name}`.")
            continue
        found.append((name, OLLAMA, blob, where))
    # Ollama's own library first: a blob pulled under two names is listed by its shortest one
    return sorted(found, key=lambda c: ("/" in c[0], c[0]))


def _model_layer(data: object) -> tuple[str, int | None]:
    """(sha256 hex, size or None) of a manifest's model layer; _BrokenManifest saying what is
    missing or of the wrong type."""
    layers = data.get("layers") if isinstance(data, dict) else None
    if not isinstance(layers, list):
        raise _BrokenManifest("it is not an object with a list of layers")
    layer = next((x for x in layers if isinstance(x, dict) and x.get("mediaType") == MODEL_LAYER), None)
    if layer is None:
        raise _BrokenManifest("it names no model layer")
    raw = layer.get("digest")
    digest = _DIGEST.match(raw) if isinstance(raw, str) else None
    if digest is None:
        raise _BrokenManifest(f"its model digest {str(raw)[:80]!r} is not a sha256 digest")
    size = layer.get("size")
    return digest.group(1), size if isinstance(size, int) and not isinstance(size, bool) and size >= 0 else None


def _walk(root: Path, depth: int, problems: list[str], owner: str, wanted: Callable[[str], bool]) -> list[str]:
    """Relative paths ("a/b/c") of the files under root that `wanted` picks, at most `depth`
    levels down and MAX_WALK_ENTRIES entries in all, in order; each checked before it is used (a
    name or link that would leave the folder is a problem). A folder, pipe, socket, device or
    dangling link where `wanted` says a model file would be is a problem too; other entries are
    passed over. At most MAX_WALK_PROBLEMS lines, then one that counts the rest."""
    out: list[str] = []
    found: list[str] = []  # this walk's problems
    left = MAX_WALK_ENTRIES  # a settings file may name "/" as the models folder: the walk stays bounded

    def visit(folder: Path, prefix: str, level: int) -> None:
        nonlocal left
        if left <= 0:
            return
        try:
            with os.scandir(folder) as listing:
                entries = sorted(itertools.islice(listing, left + 1), key=lambda e: e.name)
        except OSError as exc:
            found.append(f"{owner}: cannot read {folder} ({exc.strerror or exc}).")
            return
        left -= len(entries)
        if left < 0:
            found.append(f"{owner} holds more than {MAX_WALK_ENTRIES:,} files and folders; only some were "
                         "searched for models.")
            entries = entries[:-1]
        for entry in entries:
            if entry.name.startswith("."):
                continue
            rel = f"{prefix}{entry.name}"
            want = wanted(rel)
            try:
                if _is_file(entry):
                    if want:
                        inside(root, rel, owner)  # a file symlinked from elsewhere is not the app's
                        out.append(rel)
                elif want:
                    check_file_name(rel, owner)
                    found.append(f"{owner}: {rel!r} is {_kind(entry)}, not a file; skipped.")
                elif level < depth and _is_dir(entry):
                    visit(inside(root, rel, owner), rel + "/", level + 1)
            except UnsupportedModel:
                found.append(f"{owner}: {rel!r} leads outside the folder (a link or an odd name); skipped.")
            except OSError:
                continue

    visit(root, "", 1)
    problems += found[:MAX_WALK_PROBLEMS]
    if len(found) > MAX_WALK_PROBLEMS:
        problems.append(f"{owner}: {len(found) - MAX_WALK_PROBLEMS} more problems like these.")
    return out


def _is_dir(entry: os.DirEntry[str]) -> bool:
    try:
        return entry.is_dir()
    except OSError:  # a symlink loop
        return False


def _is_file(entry: os.DirEntry[str]) -> bool:
    try:
        return entry.is_file()
    except OSError:  # a symlink loop
        return False


def _kind(entry: os.DirEntry[str]) -> str:
    try:
        mode = entry.stat().st_mode
    except OSError:
        return "a link that leads nowhere (a loop or a missing target)"
    if stat.S_ISDIR(mode):
        return "a folder"
    if stat.S_ISFIFO(mode):
        return "a named pipe (FIFO)"
    return "a socket or device"


def _found(name: str, app: str, path: Path, where: str, facts: HeaderFacts, problems: list[str]) -> FoundModel | None:
    try:
        arch, quant, parts = facts.of(path)
        files = split_parts(path) if parts > 1 else [path]
        missing = [f.name for f in files if not f.exists()]
        if len(files) > 1 and not missing:
            facts.check_parts(files)  # every part whole, and the parts of one model
        size = sum(f.stat().st_size for f in files if f.exists())
    except (CorruptGGUF, OSError) as exc:
        problems.append(f"{where}: not a readable GGUF ({str(exc).rstrip('.')}).")
        return None
    note = ""
    if arch not in RUNNABLE:
        note = f"a {arch} model; SpecChat runs GGUF files of {RUNS}"
    elif parts > 1 and len(files) != parts:
        note = f"split into {parts} files whose names do not say which part is which (rename as llama.cpp named them)"
    elif missing:
        note = f"part{'s' if len(missing) > 1 else ''} {', '.join(missing[:2])} of {parts} missing: download every part"
    return FoundModel(name, app, path, size, arch, quant, not note, note)


def _describe(header: GGUFHeader) -> tuple[str, str, int]:
    from gguf.constants import LlamaFileType

    md = header.metadata
    quant = ""
    file_type = md.get("general.file_type")
    if isinstance(file_type, int):
        try:
            quant = LlamaFileType(file_type).name.removeprefix("MOSTLY_").removeprefix("ALL_")
        except ValueError:
            quant = ""
    if not quant:
        counts: dict[str, int] = {}
        for t in header.tensors:
            if len(t.shape) == 2:
                counts[t.type_name] = counts.get(t.type_name, 0) + t.nbytes
        quant = max(counts, key=counts.__getitem__) if counts else "?"
    parts = md.get("split.count", 1)
    return header.architecture or "unknown", quant, parts if isinstance(parts, int) else 1
