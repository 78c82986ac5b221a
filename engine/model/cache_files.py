"""KV caches saved to disk and read back, so a long conversation continues after a restart
without reading its history again.

One safetensors file per saved prefix, in <dir>/<pair>/<hash of the tokens>.safetensors:
tensors "tokens" (n,) int64, "target.<layer>.k|v" (1, H_kv, n_t, D) and, with a draft,
"draft.<layer>.k|v"; metadata: the format version, the model pair's fingerprint (weights,
quantisation, dtype, device kind of target and draft: engine.loading.load.model_fingerprint),
and a keyed BLAKE2b tag over the metadata and every tensor's bytes. The key is a per-install
secret in the user data folder, so a file that was truncated, damaged, edited, or written
anywhere but by this installation fails the check. The folder's size stays under a disk
budget; the least recently used file leaves first.

Files are untrusted: a file that does not parse, names another pair, fails its tag, or whose
tensors do not fit the loaded models' caches is ignored and deleted with a log line; the
caller then reads the prompt again. safetensors never runs code. Only regular files are opened
(never through a link, never blocking on a FIFO), at most the disk budget in size; any other
entry named like a cache file (a folder, a FIFO, a link, a device) is skipped, and removed when
that is only unlinking a name in our folder (a folder is left alone, a link is never followed).

Saving is optional: a read-only or full disk, or a key file that cannot be read or written,
costs the saved caches (one warning per CacheFiles) and never an answer.

What this module does not do: decide what to keep in memory or when to save
(engine.decoding.prefix_cache does).
"""

from __future__ import annotations

import errno
import hashlib
import hmac
import json
import logging
import os
import secrets
import stat
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from engine.errors import MalformedInput
from engine.model.cache import KVCache, LayerShapes
from engine.model.hybrid_cache import HybridCache, LinearSpec
from engine.model.window_cache import WindowedCache
from engine.untrusted import read_bytes

log = logging.getLogger(__name__)

# 2: a Qwen3.5 GGUF's Gated DeltaNet states are in the file's value-head order (gguf_hybrid), which
# a version-1 file of the same pair holds grouped: those are not read
FORMAT = "specchat-kv-2"
KEY_BYTES = 32
MAX_TOKENS = 1 << 24  # no model reads 16M tokens: a longer token list is not one of ours
SUFFIX = ".safetensors"


@dataclass(frozen=True)
class CacheShape:
    """What a cache of a loaded model looks like: a file must match it to be used."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    linear: tuple[LinearSpec | None, ...] = ()  # a hybrid model's linear layers' state shapes
    layers: LayerShapes = ()  # each layer's (kv heads, head dim) where layers differ (KVCache.layer_shapes)
    windows: tuple[int | None, ...] = ()  # each layer's sliding window where any has one (WindowedCache)


def shape_of(cache: KVCache) -> CacheShape:
    linear = tuple(cache.linear) if isinstance(cache, HybridCache) else ()
    windows = cache.windows if isinstance(cache, WindowedCache) else ()
    return CacheShape(cache.num_layers, cache.num_kv_heads, cache.head_dim, cache.dtype, linear,
                      cache.layer_shapes or (), windows)


def install_key(path: Path) -> bytes | None:
    """The per-install secret that tags saved caches (created on first use, owner-only); None,
    with one warning, when it can be neither read nor created (a read-only data folder): caches
    are then not kept."""
    try:
        key = read_bytes(path, what="the KV cache key file", max_bytes=KEY_BYTES + 1)
        if len(key) == KEY_BYTES:
            return key
    except (OSError, MalformedInput):  # missing, unreadable, or not a file: made afresh below
        pass
    key = secrets.token_bytes(KEY_BYTES)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_private(path, key)
    except OSError as exc:
        log.warning("saved KV caches are not kept: the key file that tags them, %s, cannot be written (%s); "
                    "long conversations are read again after a restart", path, exc.strerror or exc)
        return None
    return key


def write_private(path: Path, data: bytes) -> None:
    """Write `data` to `path` atomically, owner-only: through a new temporary file beside it
    (created exclusively, so a FIFO or link of that name is never opened), renamed over `path`."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def tokens_hash(tokens: list[int]) -> str:
    return hashlib.sha256(torch.tensor(tokens, dtype=torch.int64).numpy().tobytes()).hexdigest()[:32]


class CacheFiles:
    """The saved caches of one model pair (`pair`: the pair's fingerprint). `key` None: nothing
    is kept (install_key could not make one)."""

    def __init__(self, root: Path, pair: str, key: bytes | None, budget_bytes: int) -> None:
        self.dir = root / hashlib.sha256(pair.encode()).hexdigest()[:16]
        self.root = root
        self.pair = pair
        self.key = key
        self.budget_bytes = budget_bytes
        self._warned: set[str] = set()  # what was said once already (a failed save, a skipped entry)

    # ---- writing ---------------------------------------------------------------------------
    def save(self, tokens: list[int], target: KVCache, draft: KVCache | None) -> Path | None:
        """Write (or refresh) the file of this prefix; None when the budget allows no file, or
        when it could not be written (a full or read-only disk: said once, and not kept)."""
        if self.budget_bytes <= 0 or not tokens or self.key is None:
            return None
        if not target.complete or (draft is not None and not draft.complete):
            return None  # a pass's pending entries: never between generations
        tensors: dict[str, torch.Tensor] = {"tokens": torch.tensor(tokens, dtype=torch.int64)}
        for role, cache in (("target", target), ("draft", draft)):
            if cache is None:
                continue
            for i, (k, v) in enumerate(cache.tensors()):
                tensors[f"{role}.{i}.k"] = k.detach().to("cpu").contiguous()
                tensors[f"{role}.{i}.v"] = v.detach().to("cpu").contiguous()
            for name, t in cache.state_tensors().items():  # a hybrid model's recurrent states
                tensors[f"{role}.{name}"] = t.detach().to("cpu").contiguous()
        meta = {"format": FORMAT, "pair": self.pair, "tokens": str(len(tokens)), "draft": str(draft is not None)}
        meta["tag"] = self._tag(meta, tensors)
        path = self.dir / f"{tokens_hash(tokens)}{SUFFIX}"
        tmp: str | None = None
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            if not _is_folder(self.dir):  # a link or a file where our folder belongs
                raise NotADirectoryError(errno.ENOTDIR, "not a folder of ours", str(self.dir))
            # a new file of our own (created exclusively: never a FIFO or link already there)
            fd, tmp = tempfile.mkstemp(dir=self.dir, prefix=".", suffix=".tmp")
            os.close(fd)
            save_file(tensors, tmp, metadata=meta)
            os.replace(tmp, path)
        except OSError as exc:  # a full or read-only disk: the conversation simply is not saved
            self._warn_once("save", "saved KV caches are not kept: %s cannot be written (%s); long conversations "
                            "are read again after a restart", self.dir, exc.strerror or exc)
            if tmp is not None:
                _remove(Path(tmp))
            return None
        self.prune()
        return path

    def prune(self) -> None:
        """Delete the least recently used files of every pair until all fit the budget."""
        files = sorted(((p, info) for folder in _pair_folders(self.root) for p, info in _entries(folder)
                        if stat.S_ISREG(info.st_mode)), key=lambda e: e[1].st_mtime)
        total = sum(info.st_size for _, info in files)
        for path, info in files:
            if total <= self.budget_bytes:
                break
            total -= info.st_size
            _remove(path)

    # ---- reading ---------------------------------------------------------------------------
    def best_match(self, prompt: list[int]) -> tuple[Path, int]:
        """The file whose tokens share the longest prefix with `prompt`, and that length
        ((no path, 0) without one). Reads only each file's token list."""
        best: tuple[Path, int] = (Path(), 0)
        if self.key is None or not _is_folder(self.dir):
            return best
        for path, info in _entries(self.dir):
            if not self._usable(path, info):
                continue
            try:
                with self._opened(path) as f:
                    if f is None:
                        continue
                    tokens_slice = f.get_slice("tokens")
                    shape = tokens_slice.get_shape()
                    if len(shape) != 1 or shape[0] > MAX_TOKENS or tokens_slice.get_dtype() != "I64":
                        self._reject(path, "no token list")
                        continue
                    tokens = f.get_tensor("tokens").tolist()
            except (SafetensorError, OSError, KeyError, RuntimeError, ValueError, TypeError) as exc:
                self._reject(path, f"unreadable ({exc})")
                continue
            n = common_prefix(tokens, prompt)
            if n > best[1]:
                best = (path, n)
        return best

    def load(self, path: Path, target: CacheShape, draft: CacheShape | None,
             device: torch.device, draft_device: torch.device | None) -> tuple[list[int], KVCache, KVCache | None] | None:
        """The tokens and caches of a file, checked against its tag and the loaded models'
        cache shapes; None (the file deleted, a log line) when anything does not fit."""
        try:
            with self._opened(path) as f:
                if f is None:
                    return None
                meta = dict(f.metadata() or {})
                tensors = {name: f.get_tensor(name) for name in f.keys()}
        except (SafetensorError, OSError, RuntimeError, ValueError, TypeError) as exc:
            self._reject(path, f"unreadable ({exc})")
            return None
        tag = meta.pop("tag", "")
        if meta.get("format") != FORMAT or meta.get("pair") != self.pair:
            self._reject(path, "saved for other models, another quantisation or another SpecChat")
            return None
        if not hmac.compare_digest(tag, self._tag(meta, tensors)):
            self._reject(path, "its contents do not match their tag (damaged or changed)")
            return None
        tokens_t = tensors.get("tokens")
        if tokens_t is None or tokens_t.dim() != 1 or str(tokens_t.numel()) != meta.get("tokens"):
            self._reject(path, "no token list")
            return None
        tokens = tokens_t.tolist()
        caches: list[KVCache | None] = []
        for role, shape, where in (("target", target, device), ("draft", draft, draft_device)):
            if shape is None or where is None:
                caches.append(None)
                continue
            cache = _rebuild(tensors, role, shape, len(tokens), where)
            if cache is None:
                self._reject(path, f"its {role} cache does not fit the loaded {role} model")
                return None
            caches.append(cache)
        try:
            os.utime(path)  # recently used: the last to leave the disk budget
        except OSError:  # a read-only disk: the order of leaving is only a little less right
            pass
        assert caches[0] is not None
        return tokens, caches[0], caches[1]

    @contextmanager
    def _opened(self, path: Path) -> Iterator[safe_open | None]:
        """safe_open of `path` if it is still a regular file within the budget, else None (the
        entry rejected). The file is opened here first, not following a link and not blocking
        on a FIFO, and checked; on Linux safetensors then opens that very file through
        /proc/self/fd, so nothing can be swapped in between."""
        flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_BINARY", 0)
        try:
            fd = os.open(path, flags)
        except FileNotFoundError:  # gone meanwhile
            yield None
            return
        except OSError as exc:  # ELOOP: a link (O_NOFOLLOW); no permission
            self._reject(path, f"unreadable ({exc.strerror or exc})")
            yield None
            return
        try:
            info = os.fstat(fd)
            if not self._usable(path, info):
                yield None
                return
            via = Path(f"/proc/self/fd/{fd}")
            with safe_open(str(via if via.exists() else path), framework="pt") as f:
                yield f
        finally:
            os.close(fd)

    def _usable(self, path: Path, info: os.stat_result) -> bool:
        """A regular file within the budget; anything else is rejected here."""
        if stat.S_ISLNK(info.st_mode):
            self._reject(path, "a link, not a file of ours")
        elif not stat.S_ISREG(info.st_mode):
            self._reject(path, f"{_kind(info.st_mode)}, not a file")
        elif info.st_size > max(self.budget_bytes, 0):
            self._reject(path, "larger than the disk budget for saved caches")
        else:
            return True
        return False

    def _tag(self, meta: dict[str, str], tensors: dict[str, torch.Tensor]) -> str:
        assert self.key is not None
        mac = hashlib.blake2b(key=self.key, digest_size=32)
        mac.update(json.dumps(meta, sort_keys=True).encode())
        for name in sorted(tensors):
            t = tensors[name]
            mac.update(f"{name}:{t.dtype}:{tuple(t.shape)};".encode())
            mac.update(t.contiguous().view(torch.uint8).numpy().tobytes() if t.numel() else b"")
        return mac.hexdigest()

    def _reject(self, path: Path, why: str) -> None:
        """Skip a bad entry, and remove it unless it is a folder (unlinking a file, FIFO or link
        removes only its name here; a link is never followed)."""
        try:
            folder = stat.S_ISDIR(path.lstat().st_mode)
        except OSError:
            return  # gone meanwhile
        self._warn_once(str(path), "ignoring the saved KV cache %s: %s; the conversation is read again%s",
                        path.name, why, " (a folder: left where it is)" if folder else "")
        if not folder:
            _remove(path)

    def _warn_once(self, what: str, message: str, *args: object) -> None:
        if what not in self._warned:
            self._warned.add(what)
            log.warning(message, *args)


def _rebuild(tensors: dict[str, torch.Tensor], role: str, shape: CacheShape, n_tokens: int,
             device: torch.device) -> KVCache | None:
    layers: list[tuple[torch.Tensor, torch.Tensor]] = []
    for i in range(shape.num_layers):
        k, v = tensors.get(f"{role}.{i}.k"), tensors.get(f"{role}.{i}.v")
        if k is None or v is None or k.shape != v.shape or k.dtype != shape.dtype or v.dtype != shape.dtype:
            return None
        heads, width = shape.num_kv_heads, shape.head_dim
        if shape.layers:
            heads, width = shape.layers[i]
        elif shape.linear and shape.linear[i] is not None:
            width = 0  # linear layers: no K/V
        if k.dim() != 4 or k.shape[0] != 1 or k.shape[1] != heads or k.shape[3] != width:
            return None
        if k.shape[2] > n_tokens or (not shape.windows and layers and k.shape[2] != layers[0][0].shape[2]):
            return None
        layers.append((k, v))
    if f"{role}.{shape.num_layers}.k" in tensors:  # more layers than the model has
        return None
    own = f"{role}."
    states = {name[len(own):]: t for name, t in tensors.items()
              if name.startswith(own) and name[len(own):].startswith(("lin.", "snap.", "win.", "wsnap."))}
    if shape.linear:
        return HybridCache.from_saved(layers, states, list(shape.linear), shape.num_kv_heads, shape.head_dim,
                                      shape.dtype, device)
    if shape.windows:  # sliding layers hold their last entries: each layer's count checked there
        shapes = shape.layers or ((shape.num_kv_heads, shape.head_dim),) * shape.num_layers
        n = _windowed_length(layers, shape.windows, states)
        if n is None or n > n_tokens:
            return None
        return WindowedCache.from_saved(layers, states, n, shape.windows, shapes, shape.dtype, device)
    if states:  # recurrent states for a model that has none
        return None
    return KVCache.from_tensors(layers, device)


def _windowed_length(layers: list[tuple[torch.Tensor, torch.Tensor]], windows: tuple[int | None, ...],
                     states: dict[str, torch.Tensor]) -> int | None:
    """The entries of a saved windowed cache: a full layer's count, or (every layer windowed)
    the first layer's count after its window's start."""
    if len(windows) != len(layers):
        return None
    for (k, _), w in zip(layers, windows):
        if w is None:
            return int(k.shape[2])
    start = states.get(f"win.{windows[0]}.start")
    if start is None or start.dtype != torch.int64 or start.numel() != 1 or int(start) < 0:
        return None
    return int(start) + int(layers[0][0].shape[2])


def common_prefix(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix of two token lists."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def _is_folder(path: Path) -> bool:
    """A real folder, not a link to one (a pair's folder is ours: a link there is not)."""
    try:
        return stat.S_ISDIR(path.lstat().st_mode)
    except OSError:
        return False


def _pair_folders(root: Path) -> list[Path]:
    try:
        return [p for p in root.iterdir() if _is_folder(p)]
    except OSError:  # no root yet, or unreadable
        return []


def _entries(folder: Path) -> list[tuple[Path, os.stat_result]]:
    """The entries of `folder` named like cache files, with what lstat says of each."""
    out = []
    try:
        names = [p for p in folder.iterdir() if p.name.endswith(SUFFIX) and not p.name.startswith(".")]
    except OSError:
        return []
    for path in names:
        try:
            out.append((path, path.lstat()))
        except OSError:  # gone meanwhile
            pass
    return out


def _remove(path: Path) -> None:
    """Unlink `path` (never a folder); a read-only disk leaves it, said at debug level."""
    try:
        path.unlink(missing_ok=True)
    except OSError as exc:
        log.debug("could not remove %s: %s", path, exc)


def _kind(mode: int) -> str:
    if stat.S_ISDIR(mode):
        return "a folder"
    if stat.S_ISFIFO(mode):
        return "a named pipe (FIFO)"
    if stat.S_ISSOCK(mode):
        return "a socket"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    return "not a regular file"
