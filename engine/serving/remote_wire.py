"""The wire under engine.serving.remote: bounded reads of an HTTP response and its server-sent
event lines, the checks on a server's JSON, and the errors that say what a server did wrong
(named after the server, never echoing more than the start of its text). Helpers only:
RemoteEngine drives them."""

from __future__ import annotations

import json
import logging
import math
import queue
import re
import threading
from collections.abc import Iterator
from typing import Any, TypeGuard

import httpx2

from engine.errors import MalformedInput, RemoteError, RemoteModelGone, RemoteUnauthorized, RemoteUnreachable
from engine.serving.formats import END_THINK, THINK
from engine.untrusted import MIB, parse_json

log = logging.getLogger(__name__)


POLL_SECONDS = 0.05  # how often a waiting generate() looks at its cancel Event
MAX_LINE_BYTES = 1 * MIB  # one stream line, or an answer sent whole; a chunk is a few hundred bytes
MAX_ERROR_BYTES = 64 * 1024  # an error body: only its start is shown
_LINE_END = re.compile(rb"\r\n|\r|\n")


def with_reasoning(content: str | None, reasoning: str | None, thinking: bool) -> tuple[str, bool]:
    """A delta's text as the engine's text carries it: reasoning inside <think> ... </think>
    (opened at the first reasoning, closed where the answer's text starts), then the content;
    and whether the <think> block is still open."""
    text = ""
    if reasoning:
        text += reasoning if thinking else THINK + "\n" + reasoning
        thinking = True
    if content:
        text += "\n" + END_THINK + "\n\n" + content if thinking else content
        thinking = False
    return text, thinking


def auth_headers(api_key: str) -> dict[str, str]:
    """The request's headers; RemoteError for a key no HTTP header can carry (a line break, a
    letter outside ASCII: API keys are printable ASCII)."""
    if not (api_key.isascii() and api_key.isprintable()):
        raise RemoteError("The API key holds characters an HTTP header cannot carry (a line break, a letter "
                          "outside ASCII, or bytes that are not text): check that the whole key was pasted, and "
                          "only the key.")
    headers = {"Accept": "application/json, text/event-stream"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    return headers


def read_some(resp: httpx2.Response, limit: int) -> bytes:
    """At most `limit` bytes of a streamed response's body (a hostile server may send forever)."""
    body = bytearray()
    for chunk in resp.iter_bytes():
        body += chunk
        if len(body) >= limit:
            break
    return bytes(body[:limit])


def bounded_lines(resp: httpx2.Response, url: str) -> Iterator[bytes]:
    """The body's lines (any of the three line ends), each at most MAX_LINE_BYTES."""
    pending = b""
    for chunk in resp.iter_bytes():
        *lines, pending = _LINE_END.split(pending + chunk)
        yield from lines
        if len(pending) > MAX_LINE_BYTES:
            raise too_long(url)
    if pending:
        yield pending


def put_line(lines: queue.Queue[object], item: object, stop: threading.Event) -> None:
    """Hand `item` to generate(), waiting while it is QUEUED_LINES behind; dropped once it has
    stopped reading (nobody would take it, and the reader must end)."""
    while not stop.is_set():
        try:
            lines.put(item, timeout=POLL_SECONDS)
            return
        except queue.Full:
            continue


def redirected(url: str, resp: httpx2.Response) -> RemoteError:
    where = resp.headers.get("location", "")
    shown = where[:200].encode("ascii", "replace").decode() or "nowhere"
    return RemoteError(f"The server at {url} redirects (HTTP {resp.status_code}) to {shown}. SpecChat does not follow "
                       "redirects, which would carry the API key elsewhere: if you trust that address, use it as the "
                       "server's URL.")


def not_a_stream(url: str, status: int, kind: str) -> RemoteError:
    return RemoteError(f"The server at {url} answered (HTTP {status}, {kind or 'no content type'}) but not with an "
                       "OpenAI answer: check the URL (it usually ends in /v1).")


def too_long(url: str) -> RemoteError:
    return RemoteError(f"The server at {url} sent a stream line longer than {MAX_LINE_BYTES // MIB} MiB: that is "
                       "not an OpenAI-compatible answer.")


def sse_data(line: bytes) -> bytes | None:
    """The payload of a server-sent event's `data:` line (None for comments, blanks, other fields)."""
    if not line.startswith(b"data:"):
        return None
    return line[5:].strip()


def bad_event(url: str, why: str, data: bytes) -> RemoteError:
    shown = data[:120].decode("utf-8", "replace") + ("…" if len(data) > 120 else "")
    return RemoteError(f"The server at {url} sent an answer this client cannot read: {why} (it sent {shown}). "
                       "It does not answer as an OpenAI-compatible server does.")


def kind_of(value: object) -> str:
    """A JSON value's type in words."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true/false"
    return {str: "a string", int: "a number", float: "a number", list: "a list", dict: "an object"}.get(
        type(value), type(value).__name__)


def as_object(value: object) -> dict[str, Any]:
    """A JSON object as it is; anything else as an empty one."""
    return value if isinstance(value, dict) else {}


def as_int(value: object, default: int) -> int:
    return max(0, int(value)) if is_number(value) else default


def is_number(value: object) -> TypeGuard[int | float]:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def error_text(data: dict[str, Any]) -> str:
    """The message of an error body in the shapes servers use: OpenAI's {"error": {"message"}},
    vLLM's older {"object": "error", "message"}, {"error": "Unauthorized"}, FastAPI's {"detail"}."""
    error = data.get("error")
    if isinstance(error, dict) and error.get("message"):
        return cut_text(str(error["message"]))
    if isinstance(error, str):
        return cut_text(error)
    for key in ("message", "detail"):
        if data.get(key):
            return cut_text(str(data[key]))
    return cut_text(json.dumps(data))


def cut_text(text: str, most: int = 300) -> str:
    return text if len(text) <= most else text[:most] + "…"


def server_message(body: bytes) -> str:
    try:
        data = parse_json(body, what="The error body", max_bytes=MAX_ERROR_BYTES)
    except MalformedInput:  # not JSON (an HTML page, plain text), or hostile JSON: its start as text
        return cut_text(body.decode("utf-8", "replace").strip()) or "no details"
    return error_text(data) if isinstance(data, dict) else cut_text(str(data))


def unreachable(url: str, exc: BaseException) -> RemoteUnreachable:
    return RemoteUnreachable(f"Cannot reach the server at {url} ({type(exc).__name__}). Check that it is "
                             "running, the URL and port, and the network (firewall, VPN).")


def status_error(status: int, message: str, url: str, model: str | None) -> RemoteError:
    where = f"The server at {url}"
    if status in (401, 403):
        return RemoteUnauthorized(f"{where} refused the API key (HTTP {status}: {message}). Check the key "
                                  "set for this server.")
    if status == 404:
        if model is not None and ("model" in message.lower() or model in message):
            return RemoteModelGone(f"{where} does not serve the model '{model}' (any more): {message} Choose "
                                   "another model, or refresh the server's model list.")
        return RemoteError(f"{where} has no OpenAI API there (HTTP 404: {message}). Check the URL: it usually "
                           "ends in /v1.")
    if status == 413:
        return RemoteError(f"{where} says the conversation is too long: {message} Start a new conversation.")
    if status in (429, 503):
        return RemoteError(f"{where} is busy or still loading (HTTP {status}): {message} Try again in a moment.")
    return RemoteError(f"{where} answered HTTP {status}: {message}")
