"""engine.untrusted: bounded JSON and regular-file reads, on real FIFOs, folders and devices."""

from __future__ import annotations

import json
import os
import random
import threading
import time
import tracemalloc
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


@pytest.mark.parametrize("text", ["a" * 7_000_000, '\\"[' * 1_000_000, "é" * 3_000_000, '"' * 3_000_000],
                         ids=["plain", "escapes", "utf-8", "quotes"])
def test_a_long_string_is_read_in_memory_proportional_to_it(text: str) -> None:
    """A body at the size bound holding one long string: the depth scan once kept state for
    every character of it (an 8 MiB string took 1 GB, and four such requests at once 4 GB)."""
    body = json.dumps({"content": text}, ensure_ascii=False).encode()
    tracemalloc.start()
    try:
        assert parse_json(body, what="the body") == {"content": text}
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 8 * len(body), f"{peak / len(body):.0f} bytes per byte read"


def test_depth_agrees_with_the_parsed_value_across_escapes_and_chunks() -> None:
    rng = random.Random(11)

    def depth(value: object) -> int:
        if isinstance(value, list):
            return 1 + max((depth(v) for v in value), default=0)
        if isinstance(value, dict):
            return 1 + max((depth(v) for v in value.values()), default=0)
        return 0

    def value(level: int) -> object:
        roll = rng.random()
        if level > 6 or roll < 0.3:
            return rng.choice(['a\\"[', "\\\\", ']"{', "", 1, '\\\\\\"}}', '""', None])
        if roll < 0.65:
            return [value(level + 1) for _ in range(rng.randint(0, 4))]
        return {rng.choice(["[", "\\", '"', "k"]) + str(i): value(level + 1) for i in range(rng.randint(0, 4))}

    for _ in range(2000):
        item = value(0)
        assert nesting_depth(json.dumps(item, ensure_ascii=rng.random() < 0.5).encode()) == depth(item)
    for n in range(65_530, 65_540):  # strings that cross the scan's 64 KiB chunks
        item = ["x" * n, [['\\"' * 3]], "]" * 70_000, {"a": [[[]]]}]
        assert nesting_depth(json.dumps(item).encode()) == depth(item) == 5


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
