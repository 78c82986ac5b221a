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
