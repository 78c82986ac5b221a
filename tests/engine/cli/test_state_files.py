"""`specchat generate` against the files it reads and writes beside the model: saved KV caches,
the key that tags them, the shared settings file and the hardware profile (issue 26.3, 33.1).

Saving caches is optional: a read-only data folder or a key file that cannot be written costs
them, with one warning, never the answer. A folder, FIFO, socket, link or device named like a
saved cache is skipped (and removed when that only unlinks a name in our folder: never a
folder, never through a link), and the answer is the same as without it. Nothing blocks on a
FIFO: every test here runs under an alarm."""

from __future__ import annotations

import logging
import os
import signal
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest
from filesystems import read_only

from engine.cli.main import main
from engine.decoding.pair import cache_files
from engine.loading.load import LoadedModel
from engine.types import CacheSettings

PROMPT = "Tell me a long story about the little robot who loved to read books about the sea and the stars"


class Blocked(BaseException):
    """Raised by the timer: not an OSError (TimeoutError is one), so no `except OSError` in the
    code under test can swallow it."""


@pytest.fixture(autouse=True)
def _no_hang() -> Iterator[None]:
    def expire(signum: int, frame: object) -> None:
        raise Blocked("blocked for 60 s (a FIFO opened for reading?)")

    old = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, 60, 60)  # again and again: each blocked read fails
    yield
    signal.setitimer(signal.ITIMER_REAL, 0)
    signal.signal(signal.SIGALRM, old)


@pytest.fixture
def folders(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, Path]:
    """Fresh data, cache and config folders for this test (the model stays in the session's)."""
    made = {name: tmp_path / name for name in ("data", "cache", "config")}
    for path in made.values():
        path.mkdir()
    monkeypatch.setenv("SPECCHAT_DATA_DIR", str(made["data"]))
    monkeypatch.setenv("SPECCHAT_CACHE_DIR", str(made["cache"]))
    monkeypatch.setenv("SPECCHAT_CONFIG_DIR", str(made["config"]))
    return made


def generate(capsys: pytest.CaptureFixture[str], model: Path, *extra: object) -> tuple[int, str, str]:
    rc = main(["generate", "--target", str(model), "--device", "cpu", "--prompt", PROMPT, "--max-new-tokens", "6",
               "--temperature", "0", *map(str, extra)])
    out, err = capsys.readouterr()
    assert "Traceback" not in err and "This is a bug" not in err, err
    return rc, out, err


def answer_of(capsys: pytest.CaptureFixture[str], model: Path) -> str:
    rc, out, err = generate(capsys, model)
    assert rc == 0, err
    return out


def warnings(caplog: pytest.LogCaptureFixture, fragment: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING and fragment in r.getMessage()]


# ---- special entries in the saved-cache folder (26.3) ------------------------------------------
def test_folders_fifos_links_and_devices_named_like_saved_caches_are_skipped(
        capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture, folders: dict[str, Path],
        tmp_path: Path, tiny_target: LoadedModel, tiny_target_path: Path) -> None:
    expected = answer_of(capsys, tiny_target_path)
    files = cache_files(CacheSettings(), tiny_target.model, None)
    assert files is not None and files.dir.parent == folders["cache"] / "kv"  # where the CLI's pair looks
    pair = files.dir
    pair.mkdir(parents=True, exist_ok=True)
    (pair / "a-folder.safetensors").mkdir()
    (pair / "a-folder.safetensors" / "keep.txt").write_text("someone's")
    os.mkfifo(pair / "a-fifo.safetensors")
    (pair / "to-dev-zero.safetensors").symlink_to("/dev/zero")
    victim = tmp_path / "victim.safetensors"
    victim.write_bytes(b"not ours")
    (pair / "to-elsewhere.safetensors").symlink_to(victim)
    (pair / "garbage.safetensors").write_bytes(os.urandom(4096))
    sock = socket.socket(socket.AF_UNIX)
    cwd = os.getcwd()
    os.chdir(pair)  # a socket's path is limited to ~100 bytes
    try:
        sock.bind("a-socket.safetensors")
    finally:
        os.chdir(cwd)
    try:
        for _ in range(2):  # every run answers, not only the first
            with caplog.at_level(logging.WARNING):
                assert answer_of(capsys, tiny_target_path) == expected
    finally:
        sock.close()
    assert sorted(p.name for p in pair.iterdir()) == ["a-folder.safetensors"]  # the others were only names
    assert (pair / "a-folder.safetensors" / "keep.txt").read_text() == "someone's"
    assert victim.read_bytes() == b"not ours"  # a link is removed, never followed
    assert warnings(caplog, "a folder: left where it is")


def test_a_pair_folder_that_is_a_link_is_not_read_or_written(
        capsys: pytest.CaptureFixture[str], folders: dict[str, Path], tmp_path: Path,
        tiny_target: LoadedModel, tiny_target_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "x.safetensors").write_bytes(b"someone else's")
    files = cache_files(CacheSettings(), tiny_target.model, None)
    assert files is not None
    files.dir.parent.mkdir(parents=True)
    files.dir.symlink_to(elsewhere)
    assert answer_of(capsys, tiny_target_path)
    assert [p.name for p in elsewhere.iterdir()] == ["x.safetensors"]
    assert (elsewhere / "x.safetensors").read_bytes() == b"someone else's"


# ---- a read-only data folder and the key file (33.1) ------------------------------------------
@pytest.mark.parametrize("case", ["read-only data folder", "read-only data folder with a key",
                                  "key file is a folder", "key file is a FIFO"])
def test_saved_caches_are_optional_one_warning_and_the_answer_comes(
        case: str, capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture,
        folders: dict[str, Path], tiny_target_path: Path) -> None:
    expected = answer_of(capsys, tiny_target_path)  # also writes the key file
    key = folders["data"] / "kv-cache.key"
    assert key.is_file()
    if case != "read-only data folder with a key":
        key.unlink()
    if case == "key file is a folder":
        key.mkdir()
        (key / "x").write_text("")
    elif case == "key file is a FIFO":
        os.mkfifo(key)
    caplog.clear()
    if case.startswith("read-only"):
        with read_only(folders["data"]), caplog.at_level(logging.WARNING):
            assert _write_fails(folders["data"])  # really read-only, for root too
            rc, out, err = generate(capsys, tiny_target_path)
    else:
        with caplog.at_level(logging.WARNING):
            rc, out, err = generate(capsys, tiny_target_path)
    assert rc == 0 and out == expected, err
    not_kept = warnings(caplog, "not kept")
    if case == "read-only data folder with a key":
        assert not_kept == []  # the key is read; caches go to the cache folder as ever
    elif case == "key file is a FIFO":  # replaced by a real key: nothing lost but old caches
        assert not_kept == [] and key.is_file() and len(key.read_bytes()) == 32
    else:
        assert len(not_kept) == 1 and "kv-cache.key" in not_kept[0], not_kept
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


def _write_fails(folder: Path) -> bool:
    try:
        (folder / ".probe").write_text("")
    except OSError:
        return True
    (folder / ".probe").unlink()
    return False


# ---- the shared settings file and the hardware profile (the reads beside the model) ------------
@pytest.mark.parametrize("kind", ["fifo", "folder", "nested", "huge"])
def test_a_hostile_settings_file_or_hardware_profile_never_stops_an_answer(
        kind: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, folders: dict[str, Path],
        tiny_target_path: Path, tiny_draft_path: Path) -> None:
    from engine.planning.profile import profile_path

    monkeypatch.setenv("HF_HUB_CACHE", str(folders["cache"] / "hub"))

    for path in (folders["config"] / "settings.json", profile_path()):
        path.parent.mkdir(parents=True, exist_ok=True)
        if kind == "fifo":
            os.mkfifo(path)
        elif kind == "folder":
            path.mkdir()
        elif kind == "nested":
            path.write_text("[" * 100_000 + "]" * 100_000)
        else:
            with open(path, "wb") as f:
                f.truncate(1 << 32)  # sparse 4 GiB
    # --budget auto with a draft reads the profile; the models folder comes from the settings file
    rc, out, err = generate(capsys, tiny_target_path, "--draft", tiny_draft_path)
    assert rc == 0 and out, err
    rc, out, err = (main(["models", "list", "--json"]), *capsys.readouterr())
    assert rc == 0 and '"local"' in out, err
