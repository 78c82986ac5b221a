"""KV caches kept between turns, so a new turn reads only the tokens its prompt adds.

A `Prefix` is a token list and the target's and draft's caches over a prefix of it (the
engine's cache invariant: each holds a prefix of the committed tokens). After a generation the
engine gives its Prefix back to the pool; the next request takes the one that shares the
longest token prefix with its prompt and reads only the rest:

- the same conversation (GenerationRequest.conversation) continues in place: the next turn, a
  regenerated answer or an edited last message cut the caches back to where the prompts agree;
- another request (another conversation sharing a system prompt, an API client without a
  conversation key) gets a copy of the matching prefix, so the cached conversation is kept;
- with no useful match in memory, a saved file (engine.model.cache_files) is read when it
  covers more of the prompt.

Parked prefixes live in host memory within a RAM budget (on a GPU they leave the device: its
memory is the target's); the least recently used leave first, written to disk when long
enough; at most CacheSettings.max_parked stay. `persist()` writes every long prefix (the app calls it on closing).

What this module does not do: run models (the engine prefills what a prefix lacks).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.model.cache import KVCache
from engine.model.cache_files import CacheFiles, CacheShape, common_prefix, shape_of
from engine.model.head_draft import HeadCache
from engine.types import CacheSettings

log = logging.getLogger(__name__)

MIN_COPIED_TOKENS = 16  # a shorter shared prefix is read again rather than copied


@dataclass
class Prefix:
    """Tokens and the caches over a prefix of them: target.length <= len(tokens) and likewise
    draft.length."""

    tokens: list[int]
    target: KVCache
    draft: KVCache | None
    conversation: str | None = None
    used: float = 0.0
    saved: Path | None = None  # its file on disk, replaced when a longer version is saved

    def nbytes(self) -> int:
        return self.target.nbytes() + (self.draft.nbytes() if self.draft is not None else 0)


NewCaches = Callable[[], tuple[KVCache, KVCache | None]]


class PrefixPool:
    """The engine's prefixes between generations (not thread-safe: one generate at a time)."""

    def __init__(self, settings: CacheSettings, files: CacheFiles | None, target_device: torch.device,
                 draft_device: torch.device | None) -> None:
        self.settings = settings
        self.files = files
        self.target_device = target_device
        self.draft_device = draft_device
        self._parked: list[Prefix] = []

    def __len__(self) -> int:
        return len(self._parked)

    # ---- taking a prefix for a request -------------------------------------------------------
    def open(self, prompt: list[int], conversation: str | None, new_caches: NewCaches,
             spare: int) -> tuple[Prefix, int]:
        """The caches a generation of `prompt` starts from (`take`, or fresh ones when caching
        is off), with room for `spare` more target entries, and each marked at the prompt's end
        (the next turn's prompt starts with this one)."""
        if self.settings.enabled:
            prefix, cached = self.take(prompt, conversation, new_caches)
        else:
            target, draft = new_caches()
            prefix, cached = Prefix([], target, draft, conversation), 0
        prefix.target.reserve(len(prompt) - prefix.target.length + spare)
        for cache in (prefix.target, prefix.draft):
            if cache is not None:
                cache.mark(len(prompt) - 1)
        return prefix, cached

    def take(self, prompt: list[int], conversation: str | None, new_caches: NewCaches) -> tuple[Prefix, int]:
        """A Prefix for `prompt`, owned by the caller until `give_back`, and how many prompt
        tokens its target cache already holds. The caches hold at most len(prompt) - 1 tokens:
        the prompt's last token is the first root, which the first pass reads."""
        entry, shared = self._best(prompt, conversation)
        limit = len(prompt) - 1
        files = self.files
        if files is not None and min(shared, limit) < limit - MIN_COPIED_TOKENS:  # memory misses a part
            disk_path, disk_shared = files.best_match(prompt)
            if min(disk_shared, limit) > min(shared, limit) + MIN_COPIED_TOKENS:
                loaded = self._load(disk_path)
                if loaded is not None:
                    entry, shared = loaded, disk_shared
        if entry is None or min(shared, limit) < MIN_COPIED_TOKENS and entry.conversation != conversation:
            target, draft = new_caches()
            prefix = Prefix([], target, draft, conversation)
        elif entry in self._parked and self._copy_needed(entry, shared, conversation):
            prefix = Prefix(prompt[:shared], entry.target.copy_prefix(min(shared, entry.target.length)),
                            entry.draft.copy_prefix(min(shared, entry.draft.length)) if entry.draft else None,
                            conversation)
            self._touch(entry)
        else:
            if entry in self._parked:
                self._parked.remove(entry)
            prefix = entry
            prefix.conversation = conversation if conversation is not None else entry.conversation
        keep = min(shared, limit)
        prefix.tokens = prompt[:keep]
        prefix.target.truncate(min(prefix.target.length, keep))
        if prefix.draft is not None:
            prefix.draft.truncate(min(prefix.draft.length, keep))
        if isinstance(prefix.draft, HeadCache):  # the target's hidden states of the text kept
            prefix.draft.forget_from(keep)
        prefix.target.to(self.target_device)
        if prefix.draft is not None and self.draft_device is not None:
            prefix.draft.to(self.draft_device)
        return prefix, prefix.target.length

    def _best(self, prompt: list[int], conversation: str | None) -> tuple[Prefix | None, int]:
        if conversation is not None:
            own = next((p for p in self._parked if p.conversation == conversation), None)
            if own is not None:
                return own, common_prefix(own.tokens, prompt)
        best, shared = None, 0
        for p in self._parked:
            n = common_prefix(p.tokens, prompt)
            if n > shared:
                best, shared = p, n
        return best, shared

    @staticmethod
    def _copy_needed(entry: Prefix, shared: int, conversation: str | None) -> bool:
        """A conversation's own prefix is cut back in place; another conversation's is copied,
        so it stays cached; a prefix of no conversation is taken over only when the prompt
        extends all of it (nothing is lost), else copied."""
        if entry.conversation is not None:
            return entry.conversation != conversation
        return shared < len(entry.tokens)

    def _load(self, path: Path) -> Prefix | None:
        assert self.files is not None
        loaded = self.files.load(path, self._shape_target, self._shape_draft, self.target_device, self.draft_device)
        if loaded is None:
            return None
        tokens, target, draft = loaded
        if self._head is not None:  # a file holds no head state: it reads what follows the restored text
            draft = self._head.like(target.length + 1)
            draft.blank(target.length)
        log.info("read a saved KV cache of %d tokens", target.length)
        return Prefix(tokens, target, draft, saved=path)

    # the cache shapes a loaded file must match: set by the engine
    _shape_target: CacheShape
    _shape_draft: CacheShape | None
    _head: HeadCache | None = None  # the draft is a head (head_draft.py): its cache is never restored

    def expect(self, target: KVCache, draft: KVCache | None) -> None:
        """Record the loaded models' cache shapes (saved files must match them)."""
        self._shape_target = shape_of(target)
        self._shape_draft = shape_of(draft) if draft is not None else None
        self._head = draft if isinstance(draft, HeadCache) else None

    # ---- giving it back ----------------------------------------------------------------------
    def give_back(self, prefix: Prefix) -> None:
        """Park a prefix after a generation. It stays where it is (on a GPU: the KV room the
        placement reserved), the others move to host memory; over the RAM budget the least
        recently used leave (saved first when long enough), and so they do over settings.max_parked
        prefixes. The newest always stays."""
        for p in self._parked:  # device memory belongs to the target's layers and one context
            p.target.to("cpu")
            if p.draft is not None:
                p.draft.to("cpu")
        if prefix.conversation is not None:
            self._parked = [p for p in self._parked if p.conversation != prefix.conversation]
        self._touch(prefix)
        self._parked.append(prefix)
        while len(self._parked) > 1 and (len(self._parked) > self.settings.max_parked or sum(
                p.nbytes() for p in self._parked[:-1]) > self.settings.ram_budget_bytes):
            oldest = min(self._parked[:-1], key=lambda p: p.used)
            self._parked.remove(oldest)
            self._save(oldest)

    def persist(self) -> int:
        """Save every parked prefix long enough to be worth it; the number saved."""
        return sum(self._save(p) for p in self._parked)

    def clear(self) -> None:
        self._parked.clear()

    def _save(self, prefix: Prefix) -> bool:
        if self.files is None or prefix.target.length < self.settings.min_saved_tokens:
            return False
        path = self.files.save(prefix.tokens, prefix.target, prefix.draft)
        if path is None:
            return False
        if prefix.saved is not None and prefix.saved != path:  # a shorter version of the same prefix
            try:
                prefix.saved.unlink(missing_ok=True)
            except OSError as exc:  # the budget's pruning takes it later
                log.debug("could not remove %s: %s", prefix.saved, exc)
        prefix.saved = path
        return True

    @staticmethod
    def _touch(prefix: Prefix) -> None:
        prefix.used = time.monotonic()
