"""Reading what SpecChat does not own: request bodies, a server's answers, files other programs
wrote (LM Studio's settings, Ollama's manifests, saved caches), paths a user names.

Everything from outside goes through here, once, with bounds:

- `parse_json` refuses JSON nested deeper than `max_depth` (before Python's parser recurses: a
  body nested 100,000 deep must be a message, not a RecursionError), larger than `max_bytes`,
  numbers with more digits than any real setting has, NaN/Infinity (not JSON) and numbers that
  overflow to them (1e400), and strings that are not Unicode (a lone surrogate such as
  "\ud800": Python decodes it, then every later encode fails).
- `read_bytes` / `read_text` / `read_json_file` open a path only if it is a regular file (not a
  folder, FIFO, socket or device such as /dev/zero), without blocking on a FIFO, and read at most
  `max_bytes`.
- `run_within` runs code from outside that executes here (a model's chat template, sandboxed but
  free to loop 10^10 times) with a time limit: `Overran` is raised inside it when the time is up.

Each refusal is a `MalformedInput` whose `user_message` names `what` was read and why it was
refused; callers turn it into their own answer (HTTP 400, a `!` line in a listing, `error:` and
exit 2 on the command line). What this does not do: check the shape of the parsed value (the
caller knows what it expects).
"""

from __future__ import annotations

import ctypes
import json
import math
import os
import stat
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from engine.errors import MalformedInput

MAX_DEPTH = 64  # OpenAI requests, manifests and settings files nest < 10 deep
MAX_NUMBER_DIGITS = 40  # an int64 has 19; JSON from outside never needs a bignum
KIB = 1024
MIB = 1024 * KIB

_KEPT = b'"[]{}'  # the bytes the depth scan needs once escapes are gone
_OTHER = bytes(b for b in range(256) if b not in _KEPT)
_OPEN = frozenset(b"[{")
_CHUNK = 64 * 1024


def nesting_depth(data: bytes) -> int:
    """How deep the arrays and objects of JSON text `data` nest (brackets inside strings do not
    count). Linear time, no recursion and a few bytes of memory per quote, so it is safe on any
    input: no regular expression walks a string, because one that does keeps state for every
    character (an 8 MiB string took 1 GB)."""
    # Inside a string every backslash starts an escape, so pairing backslashes from the left is
    # JSON's own reading: drop escaped backslashes, then escaped quotes; the quotes left delimit.
    delimiters = data.replace(b"\\\\", b"").replace(b'\\"', b"").translate(None, _OTHER)
    outside, inside = [], False
    for start in range(0, len(delimiters), _CHUNK):  # in chunks: split() holds a pointer per quote
        pieces = delimiters[start:start + _CHUNK].split(b'"')
        outside.append(b"".join(pieces[1 if inside else 0::2]))
        inside ^= len(pieces) % 2 == 0  # an odd number of quotes in this chunk
    depth = deepest = 0
    for b in b"".join(outside):
        if b in _OPEN:
            depth += 1
            if depth > deepest:
                deepest = depth
        else:
            depth -= 1
    return deepest


def parse_json(data: str | bytes | bytearray, *, what: str, max_bytes: int = 8 * MIB,
               max_depth: int = MAX_DEPTH, finite: bool = True) -> object:
    """JSON text from outside -> Python value, or MalformedInput saying what is wrong with it.
    `finite=False` lets a number that overflows (1e400) through as infinity, for a reader that
    checks its numbers itself and must not lose the rest of the message over one of them (a
    foreign server's usage figures beside an answer)."""
    raw = data.encode("utf-8", "surrogatepass") if isinstance(data, str) else bytes(data)
    if len(raw) > max_bytes:
        raise MalformedInput(f"{what} is larger than {_size(max_bytes)} ({_size(len(raw))}).")
    depth = nesting_depth(raw)
    if depth > max_depth:
        raise MalformedInput(f"{what} nests arrays or objects {depth} levels deep; at most {max_depth} "
                             "are accepted.")
    try:
        text = raw.decode("utf-8")
        value = json.loads(text, parse_int=_bounded_int, parse_float=_finite_float if finite else float,
                           parse_constant=_no_constant)
        _check_strings(value)
        return value
    except UnicodeDecodeError as exc:
        raise MalformedInput(f"{what} is not UTF-8 text ({exc.reason} at byte {exc.start}).") from None
    except RecursionError:  # a depth the scan cannot see (it counts every bracket, so never in practice)
        raise MalformedInput(f"{what} nests too deeply to read.") from None
    except ValueError as exc:  # JSONDecodeError, or a refusal from the hooks below
        raise MalformedInput(f"{what} is not valid JSON ({exc}).") from None


def _bounded_int(digits: str) -> int:
    if len(digits.lstrip("-")) > MAX_NUMBER_DIGITS:
        raise ValueError(f"a number with {len(digits.lstrip('-'))} digits; at most {MAX_NUMBER_DIGITS} are accepted")
    return int(digits)


def _finite_float(text: str) -> float:
    value = float(text)
    if math.isinf(value):
        raise ValueError(f"{text[:20]} is too large for a number")
    return value


def _check_strings(value: object) -> None:
    """Every string (keys included) must be Unicode; the value is at most MAX_DEPTH deep, so
    this walk's recursion is bounded."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise ValueError("a string holds a lone surrogate (\\ud800-\\udfff), which is not Unicode") from None
    elif isinstance(value, dict):
        for k, v in value.items():
            _check_strings(k)
            _check_strings(v)
    elif isinstance(value, list):
        for v in value:
            _check_strings(v)


def _no_constant(name: str) -> object:
    raise ValueError(f"{name} is not a JSON number")


def read_bytes(path: str | os.PathLike[str], *, what: str, max_bytes: int) -> bytes:
    """The bytes of a regular file, at most `max_bytes`. A folder, FIFO, socket or device is
    refused without reading (a FIFO is opened non-blocking, so it cannot hang us); OSError
    (missing, no permission) passes through for the caller to word."""
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_BINARY", 0)
    try:
        fd = os.open(path, flags)
    except IsADirectoryError:
        raise MalformedInput(f"{what} ({path}) is a folder, not a file.") from None
    except PermissionError:
        if Path(path).is_dir():  # Windows refuses to open a folder with EACCES
            raise MalformedInput(f"{what} ({path}) is a folder, not a file.") from None
        raise
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise MalformedInput(f"{what} ({path}) is {_kind(info.st_mode)}, not a regular file.")
        if info.st_size > max_bytes:
            raise MalformedInput(f"{what} ({path}) is larger than {_size(max_bytes)} ({_size(info.st_size)}).")
        chunks, total = [], 0
        while chunk := os.read(fd, min(1 * MIB, max_bytes + 1 - total)):
            chunks.append(chunk)
            total += len(chunk)
            if total > max_bytes:  # a file that grew after fstat, or a /proc file that says 0
                raise MalformedInput(f"{what} ({path}) is larger than {_size(max_bytes)}.")
        return b"".join(chunks)
    finally:
        os.close(fd)


def read_text(path: str | os.PathLike[str], *, what: str, max_bytes: int) -> str:
    data = read_bytes(path, what=what, max_bytes=max_bytes)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise MalformedInput(f"{what} ({path}) is not UTF-8 text ({exc.reason} at byte {exc.start}).") from None


def read_json_file(path: str | os.PathLike[str], *, what: str, max_bytes: int = 4 * MIB,
                   max_depth: int = MAX_DEPTH) -> object:
    """read_bytes + parse_json; the message names the file."""
    data = read_bytes(path, what=what, max_bytes=max_bytes)
    return parse_json(data, what=f"{what} ({path})", max_bytes=max_bytes, max_depth=max_depth)


T = TypeVar("T")


class Overran(BaseException):
    """Raised inside `run_within`'s work when its time is up. A BaseException, so that no
    `except Exception` in the code it interrupts (a template engine's own) can swallow it."""


def run_within(seconds: float, work: Callable[[], T]) -> T:
    """work() in this thread, or Overran once it has run `seconds`. The exception lands at the
    next Python instruction, so loops and recursion stop; one long C call (a huge power of a
    number) runs to its end first."""
    me, lock, done = threading.get_ident(), threading.Lock(), threading.Event()

    def expire() -> None:
        with lock:
            if not done.is_set():
                ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(me), ctypes.py_object(Overran))

    timer = threading.Timer(seconds, expire)
    timer.daemon = True
    timer.start()
    try:
        return work()
    finally:
        timer.cancel()
        with lock:  # an Overran set but not landed yet is taken back: it must not hit the caller later
            done.set()
            ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(me), None)


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


def _size(n: int) -> str:
    if n >= MIB:
        return f"{n / MIB:.1f} MiB"
    if n >= KIB:
        return f"{n / KIB:.1f} KiB"
    return f"{n} bytes"
