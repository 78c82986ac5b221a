"""Saved KV caches on a disk that will not have them, and a folder with things that are not
ours (issue 26.3, 33.1): saving is optional, so a read-only or odd folder costs the saved
caches with one warning, never an answer; only regular files are read, and removing a bad
entry never removes a folder or follows a link."""

from __future__ import annotations

import logging
import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest
from filesystems import read_only

from engine.decoding.generation import Engine
from engine.decoding.pair import cache_files
from engine.loading.load import LoadedModel
from engine.model.cache_files import KEY_BYTES, CacheFiles, install_key
from engine.types import CacheSettings, Completion, GenerationRequest, Message, SpeculationSettings

SYSTEM = Message("system", "You are a helpful robot who loved to read books about the sea.")
TURNS = ("Paris is the capital of", "def add(a, b):", "Once upon a time there was")


class Blocked(BaseException):
    """Raised by the timer: not an OSError (TimeoutError is one), so no `except OSError` in the
    code under test can swallow it."""


@pytest.fixture(autouse=True)
def _no_hang() -> Iterator[None]:
    def expire(signum: int, frame: object) -> None:
        raise Blocked("blocked for 30 s (a FIFO opened?)")

    old = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, 30, 30)  # again and again: each blocked read fails
    yield
    signal.setitimer(signal.ITIMER_REAL, 0)
    signal.signal(signal.SIGALRM, old)


def answer(engine: Engine, text: str, conversation: str) -> Completion:
    request = GenerationRequest(messages=(SYSTEM, Message("user", text)), max_new_tokens=8, conversation=conversation,
                                speculation=SpeculationSettings(budget=8, max_depth=4))
    final = list(engine.generate(request))[-1]
    assert isinstance(final, Completion)
    return final


def not_kept(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING and "not kept" in r.getMessage()]


def test_a_read_only_cache_folder_costs_the_saved_caches_with_one_warning(
        tiny_target: LoadedModel, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    kv = tmp_path / "kv"
    kv.mkdir()
    settings = CacheSettings(ram_budget_bytes=0, min_saved_tokens=8, disk_dir=str(kv))
    fresh = Engine(tiny_target.model, tiny_target.tokenizer, None, CacheSettings(enabled=False))
    expected = [answer(fresh, text, "x").token_ids for text in TURNS]
    with read_only(kv), caplog.at_level(logging.WARNING):
        engine = Engine(tiny_target.model, tiny_target.tokenizer, None, settings,
                        cache_files(settings, tiny_target.model, None))
        # each turn evicts the one before (no RAM budget): a save that fails, three times over
        got = [answer(engine, text, f"c{i}").token_ids for i, text in enumerate(TURNS)]
        assert engine.persist_caches() == 0
    assert got == expected
    assert len(not_kept(caplog)) == 1, caplog.text
    assert list(kv.iterdir()) == []


def test_the_key_file_when_it_is_not_a_32_byte_file(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    key = tmp_path / "data" / "kv-cache.key"
    first = install_key(key)
    assert first is not None and install_key(key) == first and (key.stat().st_mode & 0o777) == 0o600
    key.write_bytes(b"short")  # damaged: a new key (old caches then fail their tags)
    second = install_key(key)
    assert second is not None and second != first and len(second) == KEY_BYTES
    key.unlink()
    os.mkfifo(key)  # replaced without being opened
    assert install_key(key) is not None and key.is_file()
    key.unlink()
    key.mkdir()
    with caplog.at_level(logging.WARNING):
        assert install_key(key) is None
    assert len(not_kept(caplog)) == 1 and key.is_dir()
    assert [p.name for p in key.parent.iterdir()] == ["kv-cache.key"]  # no temporary file left behind


def test_a_read_only_data_folder_without_a_key_keeps_no_caches(tmp_path: Path, caplog: pytest.LogCaptureFixture,
                                                               tiny_target: LoadedModel) -> None:
    data = tmp_path / "data"
    data.mkdir()
    with read_only(data), caplog.at_level(logging.WARNING):
        key = install_key(data / "kv-cache.key")
    assert key is None and len(not_kept(caplog)) == 1
    files = CacheFiles(tmp_path / "kv", "pair", key, 10**9)
    engine = Engine(tiny_target.model, tiny_target.tokenizer, None,
                    CacheSettings(ram_budget_bytes=0, min_saved_tokens=8), files)
    answer(engine, TURNS[0], "a")
    answer(engine, TURNS[1], "b")
    assert engine.persist_caches() == 0 and not (tmp_path / "kv").exists()
    assert files.best_match([1, 2, 3]) == (Path(), 0)


def test_pruning_removes_only_our_files_and_never_follows_a_link(tmp_path: Path) -> None:
    root = tmp_path / "kv"
    pair = root / "0123456789abcdef"
    pair.mkdir(parents=True)
    for i in range(3):
        (pair / f"{i}.safetensors").write_bytes(b"x" * 1000)
        os.utime(pair / f"{i}.safetensors", (1000 + i, 1000 + i))
    big = tmp_path / "big.safetensors"  # someone's file, linked in
    big.write_bytes(b"y" * 5000)
    (pair / "link.safetensors").symlink_to(big)
    (pair / "folder.safetensors").mkdir()
    os.mkfifo(pair / "fifo.safetensors")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "z.safetensors").write_bytes(b"z" * 5000)
    (root / "linked-pair").symlink_to(elsewhere)
    CacheFiles(root, "pair", b"k" * KEY_BYTES, budget_bytes=1500).prune()
    assert sorted(p.name for p in pair.iterdir()) == ["2.safetensors", "fifo.safetensors", "folder.safetensors",
                                                      "link.safetensors"]  # the oldest two left
    assert big.read_bytes() == b"y" * 5000 and (elsewhere / "z.safetensors").exists()
