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
caller then reads the prompt again. safetensors never runs code.

What this module does not do: decide what to keep in memory or when to save
(engine.decoding.prefix_cache does).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import secrets
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from engine.model.cache import KVCache

log = logging.getLogger(__name__)

FORMAT = "specchat-kv-1"
KEY_BYTES = 32


@dataclass(frozen=True)
class CacheShape:
    """What a cache of a loaded model looks like: a file must match it to be used."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype


def shape_of(cache: KVCache) -> CacheShape:
    return CacheShape(cache.num_layers, cache.num_kv_heads, cache.head_dim, cache.dtype)


def install_key(path: Path) -> bytes:
    """The per-install secret that tags saved caches (created on first use, owner-only)."""
    try:
        key = path.read_bytes()
        if len(key) == KEY_BYTES:
            return key
    except OSError:
        pass
    path.parent.mkdir(parents=True, exist_ok=True)
    key = secrets.token_bytes(KEY_BYTES)
    tmp = path.with_suffix(".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(key)
    os.replace(tmp, path)
    return key


def tokens_hash(tokens: list[int]) -> str:
    return hashlib.sha256(torch.tensor(tokens, dtype=torch.int64).numpy().tobytes()).hexdigest()[:32]


class CacheFiles:
    """The saved caches of one model pair (`pair`: the pair's fingerprint)."""

    def __init__(self, root: Path, pair: str, key: bytes, budget_bytes: int) -> None:
        self.dir = root / hashlib.sha256(pair.encode()).hexdigest()[:16]
        self.root = root
        self.pair = pair
        self.key = key
        self.budget_bytes = budget_bytes

    # ---- writing ---------------------------------------------------------------------------
    def save(self, tokens: list[int], target: KVCache, draft: KVCache | None) -> Path | None:
        """Write (or refresh) the file of this prefix; None when the budget allows no file."""
        if self.budget_bytes <= 0 or not tokens:
            return None
        tensors: dict[str, torch.Tensor] = {"tokens": torch.tensor(tokens, dtype=torch.int64)}
        for role, cache in (("target", target), ("draft", draft)):
            if cache is None:
                continue
            for i, (k, v) in enumerate(cache.tensors()):
                tensors[f"{role}.{i}.k"] = k.detach().to("cpu").contiguous()
                tensors[f"{role}.{i}.v"] = v.detach().to("cpu").contiguous()
        meta = {"format": FORMAT, "pair": self.pair, "tokens": str(len(tokens)), "draft": str(draft is not None)}
        meta["tag"] = self._tag(meta, tensors)
        self.dir.mkdir(parents=True, exist_ok=True)
        path = self.dir / f"{tokens_hash(tokens)}.safetensors"
        tmp = path.with_suffix(".tmp")
        try:
            save_file(tensors, str(tmp), metadata=meta)
            os.replace(tmp, path)
        except OSError as exc:  # a full or read-only disk: the conversation simply is not saved
            log.warning("could not save a KV cache to %s: %s", self.dir, exc)
            tmp.unlink(missing_ok=True)
            return None
        self.prune()
        return path

    def prune(self) -> None:
        """Delete the least recently used files of every pair until all fit the budget."""
        files = sorted(self.root.glob("*/*.safetensors"), key=_mtime)
        total = sum(_size(f) for f in files)
        for f in files:
            if total <= self.budget_bytes:
                break
            total -= _size(f)
            f.unlink(missing_ok=True)

    # ---- reading ---------------------------------------------------------------------------
    def best_match(self, prompt: list[int]) -> tuple[Path, int]:
        """The file whose tokens share the longest prefix with `prompt`, and that length
        ((no path, 0) without one). Reads only each file's token list."""
        best: tuple[Path, int] = (Path(), 0)
        for path in self.dir.glob("*.safetensors") if self.dir.is_dir() else ():
            try:
                with safe_open(str(path), framework="pt") as f:
                    tokens = f.get_tensor("tokens").tolist()
            except (SafetensorError, OSError, KeyError, RuntimeError, ValueError) as exc:
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
            with safe_open(str(path), framework="pt") as f:
                meta = dict(f.metadata() or {})
                tensors = {name: f.get_tensor(name) for name in f.keys()}
        except (SafetensorError, OSError, RuntimeError, ValueError) as exc:
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
        caches = []
        for role, shape, where in (("target", target, device), ("draft", draft, draft_device)):
            if shape is None or where is None:
                caches.append(None)
                continue
            cache = _rebuild(tensors, role, shape, len(tokens), where)
            if cache is None:
                self._reject(path, f"its {role} cache does not fit the loaded {role} model")
                return None
            caches.append(cache)
        os.utime(path)  # recently used: the last to leave the disk budget
        assert caches[0] is not None
        return tokens, caches[0], caches[1]

    def _tag(self, meta: dict[str, str], tensors: dict[str, torch.Tensor]) -> str:
        mac = hashlib.blake2b(key=self.key, digest_size=32)
        mac.update(json.dumps(meta, sort_keys=True).encode())
        for name in sorted(tensors):
            t = tensors[name]
            mac.update(f"{name}:{t.dtype}:{tuple(t.shape)};".encode())
            mac.update(t.contiguous().view(torch.uint8).numpy().tobytes() if t.numel() else b"")
        return mac.hexdigest()

    def _reject(self, path: Path, why: str) -> None:
        log.warning("ignoring the saved KV cache %s: %s; the conversation is read again", path.name, why)
        path.unlink(missing_ok=True)


def _rebuild(tensors: dict[str, torch.Tensor], role: str, shape: CacheShape, n_tokens: int,
             device: torch.device) -> KVCache | None:
    layers = []
    for i in range(shape.num_layers):
        k, v = tensors.get(f"{role}.{i}.k"), tensors.get(f"{role}.{i}.v")
        if k is None or v is None or k.shape != v.shape or k.dtype != shape.dtype or v.dtype != shape.dtype:
            return None
        if k.dim() != 4 or k.shape[0] != 1 or k.shape[1] != shape.num_kv_heads or k.shape[3] != shape.head_dim:
            return None
        if k.shape[2] > n_tokens or (layers and k.shape[2] != layers[0][0].shape[2]):
            return None
        layers.append((k, v))
    if f"{role}.{shape.num_layers}.k" in tensors:  # more layers than the model has
        return None
    return KVCache.from_tensors(layers, device)


def common_prefix(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix of two token lists."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0
