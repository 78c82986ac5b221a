"""engine.untrusted: bounded JSON and regular-file reads, on real FIFOs, folders and devices."""

from __future__ import annotations

import json
import os
import random
import threading
import time
from pathlib import Path

import pytest

from engine.errors import MalformedInput
from engine.untrusted import nesting_depth, parse_json, read_bytes, read_json_file, read_text


def test_depth_counts_brackets_outside_strings_only() -> None:
    assert nesting_depth(b'{"a": [1, {"b": "[[[[{{{{"}]}') == 3
    assert nesting_depth(b'"\\"[[["') == 0
    assert nesting_depth(b"[]") == 1 and nesting_depth(b"12") == 0


def test_a_deep_body_is_a_message_not_a_recursion_error() -> None:
    deep = "[" * 100_000 + "]" * 100_000
    with pytest.raises(MalformedInput, match="100000 levels deep"):
        parse_json(deep, what="the body")
    inside = '{"messages": [{"role": "user", "content": "hi"}], "x": ' + deep + "}"
    with pytest.raises(MalformedInput, match="levels deep"):
        parse_json(inside, what="the body")
    assert parse_json('{"a": [[["x"]]]}', what="w") == {"a": [[["x"]]]}
    assert parse_json('["\\ud83d\\ude00", 1e300]', what="w") == ["\U0001F600", 1e300]  # a pair is fine


@pytest.mark.parametrize("text, reason", [
    ('{"max_tokens": ' + "9" * 5000 + "}", "5000 digits"),
    ('{"t": NaN}', "NaN"),
    ('{"t": -Infinity}', "Infinity"),
    ('{"a": 1', "not valid JSON"),
    ('{"t": 1e400}', "too large"),
    ('{"model": "\\ud800"}', "lone surrogate"),
    ('{"\\udfff": 1}', "lone surrogate"),
    ('["ok", ["\\udc00x"]]', "lone surrogate"),
])
def test_numbers_and_constants_outside_json_are_refused(text: str, reason: str) -> None:
    with pytest.raises(MalformedInput, match=reason):
        parse_json(text, what="the body")


def test_size_and_encoding_bounds() -> None:
    with pytest.raises(MalformedInput, match="larger than 1.0 KiB"):
        parse_json(b'"' + b"x" * 2000 + b'"', what="w", max_bytes=1024)
    with pytest.raises(MalformedInput, match="not UTF-8"):
        parse_json(b'"\xff"', what="w")


def test_fuzzed_json_never_escapes_as_another_error() -> None:
    rng = random.Random(7)
    base = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hé [x] {y}"}],
                       "max_tokens": 16, "stop": ["\n"], "temperature": 0.5}).encode()
    for _ in range(2000):
        data = bytearray(base)
        for _ in range(rng.randint(1, 6)):
            op = rng.random()
            pos = rng.randrange(len(data) + 1)
            if op < 0.4:
                data[pos:pos] = bytes([rng.choice(b'[]{}",:0123456789e-\\\x00\xff')]) * rng.choice((1, 3, 100, 5000))
            elif op < 0.7 and data:
                del data[pos:pos + rng.randint(1, 8)]
            elif data:
                data[min(pos, len(data) - 1)] = rng.randrange(256)
        try:
            parse_json(bytes(data), what="w")
        except MalformedInput:
            pass


def test_regular_files_are_read_with_a_bound(tmp_path: Path) -> None:
    f = tmp_path / "m.json"
    f.write_text('[{"role": "user", "content": "ü"}]', encoding="utf-8")
    assert read_json_file(f, what="messages") == [{"role": "user", "content": "ü"}]
    assert read_text(f, what="m", max_bytes=100).startswith("[")
    with pytest.raises(MalformedInput, match="larger than 10 bytes"):
        read_bytes(f, what="m", max_bytes=10)
    with pytest.raises(FileNotFoundError):
        read_bytes(tmp_path / "missing", what="m", max_bytes=10)


def test_folders_fifos_and_devices_are_refused_without_blocking(tmp_path: Path) -> None:
    with pytest.raises(MalformedInput, match="a folder"):
        read_bytes(tmp_path, what="the cache", max_bytes=10)
    fifo = tmp_path / "kv.safetensors"
    os.mkfifo(fifo)
    done = threading.Event()
    errors: list[BaseException] = []

    def read() -> None:
        try:
            read_bytes(fifo, what="the cache", max_bytes=10)
        except BaseException as exc:  # noqa: BLE001 -- handed to the test thread
            errors.append(exc)
        done.set()

    threading.Thread(target=read, daemon=True).start()
    assert done.wait(5), "reading a FIFO blocked"
    assert isinstance(errors[0], MalformedInput) and "FIFO" in errors[0].user_message
    start = time.perf_counter()
    with pytest.raises(MalformedInput, match="a device"):
        read_bytes("/dev/zero", what="--messages", max_bytes=1024)
    assert time.perf_counter() - start < 1
