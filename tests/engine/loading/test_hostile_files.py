"""Damaged and hostile model files (issue 18, item 5, and its fuzz test): every outcome is a
loaded model or an EngineError with a user message, never another exception type, and the
CLI prints one `error:` line with exit code 1.

The fuzz cases are seeded: random bytes, mutated bytes of a valid file (header region, where
the parsers look) and truncations, for safetensors headers, GGUF headers and config.json."""

from __future__ import annotations

import json
import random
import shutil
import struct
from collections.abc import Callable
from pathlib import Path

import gguf as gguf_format
import pytest

from engine.cli.main import main
from engine.errors import EngineError, UnsupportedModel
from engine.loading.load import LoadedModel, load_model

FUZZ_CASES = 120  # per format: a few hundred in all, a few seconds


def copy_model(tiny_target_path: Path, dest: Path) -> Path:
    shutil.copytree(tiny_target_path, dest)
    return dest


def safetensors_with_header(header: bytes, body: bytes = b"") -> bytes:
    return struct.pack("<Q", len(header)) + header + body


def outcome(path: Path, cache: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """'loaded' or 'refused'; any other exception fails the test (with the case in its message)."""
    monkeypatch.setenv("SPECCHAT_CACHE_DIR", str(cache))
    try:
        loaded = load_model(path)
    except EngineError as exc:
        assert exc.user_message.strip(), "an EngineError without a message"
        return "refused"
    assert isinstance(loaded, LoadedModel)
    return "loaded"


def cli_refuses(capsys: pytest.CaptureFixture[str], target: Path) -> str:
    code = main(["generate", "--target", str(target), "--prompt", "hi"])
    out, err = capsys.readouterr()
    assert code == 1 and out == "" and "Traceback" not in err
    assert err.startswith("error: ") and len(err.splitlines()) == 1, err
    return err


# ---- named cases -------------------------------------------------------------------------------
@pytest.mark.parametrize("header", [b"[]", b'"text"', b"7", b'{"w": 5}', b'{"w": []}',
                                    b'{"w": {"dtype": "F32", "shape": "2", "data_offsets": [0, 8]}}',
                                    b'{"w": {"dtype": "F32", "shape": [2], "data_offsets": [8, 0]}}',
                                    b'{"w": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 8]}}',
                                    b'{"w": {"dtype": "F32", "shape": [1000000], "data_offsets": [0, 8]}}',
                                    b"[" * 100_000 + b"]" * 100_000])
def test_a_safetensors_header_of_the_wrong_shape_is_one_error_line(
        header: bytes, tmp_path: Path, tiny_target_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    folder = copy_model(tiny_target_path, tmp_path / "model")
    (folder / "model.safetensors").write_bytes(safetensors_with_header(header, b"\0" * 8))
    with pytest.raises(UnsupportedModel):
        load_model(folder)
    assert "model.safetensors" in cli_refuses(capsys, folder)


@pytest.mark.parametrize("config", ["[1, 2]", '"llama"', "null", '{"model_type": "llama", "num_hidden_layers": 1e9}',
                                    '{"model_type": "llama", "hidden_size": "64"}',
                                    '{"model_type": "llama", "vocab_size": -3}'])
def test_a_config_that_is_not_an_object_or_has_absurd_sizes_is_one_error_line(
        config: str, tmp_path: Path, tiny_target_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    folder = copy_model(tiny_target_path, tmp_path / "model")
    (folder / "config.json").write_text(config)
    with pytest.raises(UnsupportedModel, match="config.json"):
        load_model(folder)
    assert "config.json" in cli_refuses(capsys, folder)


def test_a_chat_template_that_raises_is_one_error_line_with_a_hint(
        tmp_path: Path, tiny_target_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    folder = copy_model(tiny_target_path, tmp_path / "model")
    (folder / "chat_template.jinja").write_text(
        "{% for m in messages %}{% if m['role'] == 'system' %}"
        "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
        "{% endif %}{{ m['content'] }}{% endfor %}")
    code = main(["generate", "--target", str(folder), "--system", "be brief", "--prompt", "hi"])
    out, err = capsys.readouterr()
    assert code == 1 and out == "" and "Traceback" not in err
    [line] = [line for line in err.splitlines() if line.startswith("error: ")]
    assert "roles must alternate" in line and "system message" in line and "--raw-prompt" in line
    assert main(["generate", "--target", str(folder), "--prompt", "hi", "--max-new-tokens", "2"]) == 0


# ---- hostile GGUF headers: whatever the file claims, the parse is bounded ----------------------------
GiB = 1 << 30


def gguf_string(text: str | bytes) -> bytes:
    raw = text.encode() if isinstance(text, str) else text
    return struct.pack("<Q", len(raw)) + raw


def gguf_head(n_tensors: int, n_kv: int) -> bytes:
    return b"GGUF" + struct.pack("<IQQ", 3, n_tensors, n_kv)


def tensor_info(name: str, dims: tuple[int, ...], qtype: int, offset: int) -> bytes:
    return gguf_string(name) + struct.pack("<I", len(dims)) + struct.pack(f"<{len(dims)}Q", *dims) + \
        struct.pack("<IQ", qtype, offset)


def one_tensor(offset: int = 0, name2: str | None = None, align: bytes = b"") -> bytes:
    """A GGUF of one (or two) 8-float tensor(s) at `offset`, with its data; `align` is an extra
    metadata entry."""
    infos = tensor_info("w", (8,), 0, offset) + (tensor_info(name2, (8,), 0, 32) if name2 else b"")
    head = gguf_head(2 if name2 else 1, 1 if align else 0) + align + infos
    head += b"\0" * (-len(head) % 32)
    return head + b"\0" * (min(offset, 1024) + 64)


HOSTILE_GGUFS: dict[str, tuple[bytes, int]] = {  # name: (bytes, size to extend the file to, as a hole)
    # 2^31 empty strings in a 17 GiB sparse file: room for every one of them, a walk of hours
    "billions of empty strings": (gguf_head(0, 1) + gguf_string("tokenizer.ggml.tokens") +
                                  struct.pack("<IIQ", 9, 8, 2**31), 17 * GiB),
    # 2^31 zero metadata entries (an empty key, uint8 0): a sparse file of zeros parses as such
    "billions of metadata entries": (gguf_head(0, 2**31), 32 * GiB),
    "billions of tensors": (gguf_head(2**30, 0), 32 * GiB),
    # one string or array of a GiB: a GiB allocated and copied from a sparse file
    "a string of a GiB": (gguf_head(0, 1) + gguf_string("general.name") + struct.pack("<IQ", 8, GiB), 2 * GiB),
    "an array of a GiB": (gguf_head(0, 1) + gguf_string("tokenizer.ggml.scores") + struct.pack("<IIQ", 9, 0, GiB),
                          2 * GiB),
    "an array of arrays": (gguf_head(0, 1) + gguf_string("x") + struct.pack("<IIQ", 9, 9, 1) +
                           struct.pack("<IQ", 0, 1) + b"\0", 0),
    "a string length past the end": (gguf_head(0, 1) + gguf_string("k") + struct.pack("<IQ", 8, 2**63), 0),
    "an array count past the end": (gguf_head(0, 1) + gguf_string("k") + struct.pack("<IIQ", 9, 8, 2**62), 0),
    "five dimensions": (gguf_head(1, 0) + tensor_info("w", (1, 1, 1, 1, 1), 0, 0), 1024),
    "no dimensions": (gguf_head(1, 0) + tensor_info("w", (), 0, 0), 1024),
    "dimensions that overflow": (gguf_head(1, 0) + tensor_info("w", (2**63, 2**63), 0, 0), 1024),
    "an unknown tensor type": (gguf_head(1, 0) + tensor_info("w", (8,), 999, 0), 1024),
    "an offset past the end": (one_tensor(offset=2**62), 0),
    "a misaligned offset": (one_tensor(offset=4), 0),
    "a tensor named twice": (one_tensor(name2="w"), 0),
    "alignment zero": (one_tensor(align=gguf_string("general.alignment") + struct.pack("<II", 4, 0)), 0),
    "alignment three": (one_tensor(align=gguf_string("general.alignment") + struct.pack("<II", 4, 3)), 0),
    "alignment of a GiB": (one_tensor(align=gguf_string("general.alignment") + struct.pack("<II", 4, GiB)), 0),
    "alignment true": (one_tensor(align=gguf_string("general.alignment") + struct.pack("<IB", 7, 1)), 0),
}


@pytest.mark.timeout(30)
@pytest.mark.parametrize("case", sorted(HOSTILE_GGUFS))
def test_a_hostile_gguf_header_is_refused_quickly_and_in_bounded_memory(case: str, tmp_path: Path) -> None:
    import time
    import tracemalloc

    from engine.store.gguf_header import CorruptGGUF, read_header, read_model

    data, size = HOSTILE_GGUFS[case]
    path = tmp_path / "hostile.gguf"
    with path.open("wb") as f:
        f.write(data)
        f.truncate(max(size, len(data)))  # the rest a hole: no disk used
    for read in (lambda: read_header(path), lambda: read_model(path, ("tokenizer.ggml.tokens",))):
        started = time.perf_counter()
        tracemalloc.start()
        try:
            with pytest.raises(CorruptGGUF):
                read()
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert time.perf_counter() - started < 5 and peak < 64 << 20, (case, peak)


def test_the_valid_counterparts_of_the_hostile_cases_parse(tmp_path: Path) -> None:
    from engine.store.gguf_header import read_header

    path = tmp_path / "ok.gguf"
    path.write_bytes(one_tensor())
    assert [t.name for t in read_header(path).tensors] == ["w"]
    path.write_bytes(one_tensor(offset=32, align=gguf_string("general.alignment") + struct.pack("<II", 4, 32)))
    assert read_header(path).tensors[0].offset % 32 == 0


@pytest.mark.timeout(30)
@pytest.mark.parametrize("kind", ["fifo", "folder"])
def test_a_pipe_or_folder_named_like_a_gguf_is_refused_without_blocking(
        kind: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import os

    path = tmp_path / "model.gguf"
    os.mkfifo(path) if kind == "fifo" else path.mkdir()
    from engine.store.gguf_header import CorruptGGUF, read_header

    with pytest.raises(CorruptGGUF, match="named pipe" if kind == "fifo" else "folder"):
        read_header(path)
    if kind == "fifo":
        assert "model.gguf" in cli_refuses(capsys, path)


# ---- fuzz --------------------------------------------------------------------------------------
def tiny_gguf(path: Path) -> bytes:
    """A small GGUF: a tiny Llama's metadata and one tensor (no tokenizer: it loads no model,
    so every case here must end in a refusal)."""
    import numpy as np

    writer = gguf_format.GGUFWriter(str(path), "llama")
    for add, value in ((writer.add_context_length, 64), (writer.add_embedding_length, 16),
                       (writer.add_block_count, 1), (writer.add_feed_forward_length, 32),
                       (writer.add_head_count, 2), (writer.add_head_count_kv, 2), (writer.add_vocab_size, 8)):
        add(value)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_tensor("token_embd.weight", np.zeros((8, 16), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path.read_bytes()


def mutations(valid: bytes, rng: random.Random, head: int, prefix: bytes = b"") -> Callable[[], bytes]:
    """One random case: random bytes after `prefix`, bytes of `valid` changed in its first
    `head` bytes, or `valid` truncated."""
    def make() -> bytes:
        kind = rng.randrange(3)
        if kind == 0:
            return prefix + rng.randbytes(rng.randrange(0, 400))
        if kind == 1:
            data = bytearray(valid)
            for _ in range(rng.randrange(1, 8)):
                i = rng.randrange(min(head, len(data)))
                data[i] = rng.choice([0, 0xFF, 0x7F, 0x80, rng.randrange(256)])
            return bytes(data)
        return valid[:rng.randrange(len(valid))]
    return make


def random_json(rng: random.Random, depth: int = 0) -> object:
    kind = rng.randrange(7 if depth < 3 else 5)
    if kind == 0:
        return rng.choice([0, -1, 1, 2**63, 10**30, 64])
    if kind == 1:
        return rng.choice([0.5, float("nan"), 1e308, -0.0])
    if kind == 2:
        return rng.choice(["", "llama", "x" * 300, "\udcff".encode("utf-8", "surrogatepass").decode("latin-1")])
    if kind == 3:
        return rng.choice([None, True, False])
    if kind == 4:
        return []
    if kind == 5:
        return [random_json(rng, depth + 1) for _ in range(rng.randrange(3))]
    return {rng.choice(["model_type", "hidden_size", "num_hidden_layers", "vocab_size", "eos_token_id",
                        "rope_scaling", "torch_dtype", "architectures"]): random_json(rng, depth + 1)
            for _ in range(rng.randrange(4))}


def test_fuzzed_safetensors_headers_load_or_are_refused(tmp_path: Path, tiny_target_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    rng = random.Random(18)
    folder = copy_model(tiny_target_path, tmp_path / "model")
    shard = folder / "model.safetensors"
    valid = shard.read_bytes()
    head = 8 + struct.unpack("<Q", valid[:8])[0]
    make = mutations(valid, rng, head)
    seen = set()
    for case in range(FUZZ_CASES):
        data = make()
        shard.write_bytes(data)
        try:
            seen.add(outcome(folder, tmp_path / "cache", monkeypatch))
        except AssertionError:
            raise
        except BaseException as exc:
            pytest.fail(f"case {case} ({len(data)} bytes, {data[:60]!r}...): {type(exc).__name__}: {exc}")
    assert "refused" in seen


def test_fuzzed_gguf_headers_are_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    rng = random.Random(18)
    path = tmp_path / "fuzz.gguf"
    valid = tiny_gguf(tmp_path / "valid.gguf")
    make = mutations(valid, rng, len(valid) - 8 * 16 * 4, prefix=b"GGUF")
    for case in range(FUZZ_CASES):
        data = make()
        path.write_bytes(data)
        try:
            assert outcome(path, tmp_path / "cache", monkeypatch) == "refused"
        except AssertionError:
            raise
        except BaseException as exc:
            pytest.fail(f"case {case} ({len(data)} bytes, {data[:60]!r}...): {type(exc).__name__}: {exc}")


def test_fuzzed_configs_load_or_are_refused(tmp_path: Path, tiny_target_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    rng = random.Random(18)
    folder = copy_model(tiny_target_path, tmp_path / "model")
    config = folder / "config.json"
    valid = json.loads(config.read_text())
    make = mutations(config.read_bytes(), rng, 10_000)
    seen = set()
    for case in range(FUZZ_CASES):
        if case % 2:
            data = make()
        else:  # valid JSON, values of the wrong types and sizes
            broken = dict(valid)
            for _ in range(rng.randrange(1, 4)):
                broken[rng.choice(sorted(valid))] = random_json(rng)
            data = json.dumps(broken).encode()
        config.write_bytes(data)
        try:
            seen.add(outcome(folder, tmp_path / "cache", monkeypatch))
        except AssertionError:
            raise
        except BaseException as exc:
            pytest.fail(f"case {case} ({data[:200]!r}): {type(exc).__name__}: {exc}")
    assert "refused" in seen
