"""A client of any OpenAI-compatible server (vLLM, llama.cpp's server, TGI, LM Studio, another
SpecChat) with the Engine's interface, so a conversation can run on a remote model the way it
runs on the local one.

`RemoteEngine(RemoteModel).generate(request, cancel)` streams /chat/completions (or
/completions for a raw prompt) and yields a TokenEvent per text delta and one Completion.
Reasoning a server already split off (vLLM's reasoning parsers send `reasoning_content`, newer
versions `reasoning`) comes back the way the local engine's text carries a thinking model's
reasoning: inside a `<think>` ... `</think>` block before the answer, which the app's answer
splitter (and engine.serving.formats' parser) takes apart again. The
HTTP exchange runs in a reader thread that hands lines to generate() through a queue, so a
cancel takes effect at once, even while the server has not answered yet (it may be queueing
the request); the connection is then closed, which is how the server learns to stop.

Errors are EngineErrors a user can act on: RemoteUnreachable (nothing answers), RemoteUnauthorized
(401/403), RemoteModelGone (the model is no longer served), RemoteDisconnected (the server went
away mid-answer: the text that came was already yielded, so the caller keeps it), RemoteError
(anything else, with the server's own message).

A server's answers are data from outside: every body and stream event goes through
engine.untrusted.parse_json (depth, size and number bounds), reads are bounded (a model list,
an error body, one stream line), and every field used is checked for its shape (`choices` a
list of objects, `delta` an object, `content` a string, ...). An answer that is not what an
OpenAI-compatible server sends is a RemoteError saying so, never a crash. A server that answers
with one JSON object although a stream was asked for is read as that object. Bounded too: the
reader runs at most QUEUED_LINES stream lines ahead, an answer longer than max_tokens can be
(MAX_CHARS_PER_TOKEN characters a token) is stopped, and redirects are not followed (the
request carries the API key): the error names where one points. A URL or key that no request
can carry is a RemoteError before anything is sent.

What this does not do: retry, pick models, or import torch.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlsplit

import httpx2

from engine.errors import InvalidRequest, MalformedInput, RemoteDisconnected, RemoteError
from engine.serving.remote_wire import (
    MAX_ERROR_BYTES,
    MAX_LINE_BYTES,
    POLL_SECONDS,
    as_int,
    as_object,
    auth_headers,
    bad_event,
    bounded_lines,
    error_text,
    is_number,
    kind_of,
    not_a_stream,
    put_line,
    read_some,
    redirected,
    server_message,
    sse_data,
    status_error,
    too_long,
    unreachable,
    with_reasoning,
)
from engine.types import (
    Completion,
    FinishReason,
    GenerationRequest,
    GenerationStats,
    RemoteModel,
    SamplingSettings,
    TokenEvent,
)
from engine.untrusted import MIB, parse_json

log = logging.getLogger(__name__)


CONNECT_SECONDS = 10.0
LIST_SECONDS = 15.0
MAX_LIST_BYTES = 8 * MIB  # a model list (thousands of models are far below this)
MAX_CHARS_PER_TOKEN = 1024  # no vocabulary has longer tokens: more text than this per token asked for is a flood
QUEUED_LINES = 256  # stream lines the reader may be ahead of generate() (a server can send faster than we read)
_OPEN, _END = object(), object()


def normalise_url(url: str) -> str:
    """What users type -> the API's base URL: a scheme is added (http), a trailing slash
    dropped, and a bare host:port gets /v1 (where vLLM, llama.cpp and SpecChat serve it)."""
    url = url.strip()
    if not url:
        raise RemoteError("The server's URL is empty: give one like http://gpu-box:8000/v1.")
    if "://" not in url:
        url = "http://" + url
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - raises ValueError for a port out of range or not a number
        httpx2.URL(url)  # what the client refuses: a host name that is not IDNA, control characters
    except (ValueError, httpx2.InvalidURL):
        parts = None
    if parts is None or parts.scheme not in ("http", "https") or not parts.hostname:
        raise RemoteError(f"'{url}' is not an http(s) URL: give one like http://gpu-box:8000/v1.")
    url = url.rstrip("/")
    return url + "/v1" if parts.path in ("", "/") else url


def list_models(url: str, api_key: str = "", timeout: float = LIST_SECONDS) -> tuple[str, ...]:
    """The ids of the models a server offers (GET /models), sorted."""
    base = normalise_url(url)
    try:
        with httpx2.Client(timeout=httpx2.Timeout(timeout, connect=CONNECT_SECONDS)) as client, \
                client.stream("GET", f"{base}/models", headers=auth_headers(api_key)) as resp:
            if resp.status_code >= 400:
                raise status_error(resp.status_code, server_message(read_some(resp, MAX_ERROR_BYTES)), base, None)
            body = read_some(resp, MAX_LIST_BYTES + 1)
    except httpx2.TransportError as exc:
        raise unreachable(base, exc) from exc
    except httpx2.HTTPError as exc:
        raise RemoteError(f"The server at {base} sent an answer that cannot be read ({type(exc).__name__}: "
                          f"{exc}).") from exc
    not_a_list = (f"The server at {base} answered, but not with an OpenAI model list: check the URL (it usually "
                  "ends in /v1).")
    try:
        value = parse_json(body, what="Its answer", max_bytes=MAX_LIST_BYTES)
    except MalformedInput as exc:
        raise RemoteError(f"{not_a_list} {exc.user_message}") from None
    data = value.get("data") if isinstance(value, dict) else None
    if not isinstance(data, list) or not all(isinstance(m, dict) and isinstance(m.get("id"), str) for m in data):
        raise RemoteError(not_a_list)
    return tuple(sorted(m["id"] for m in data))


class RemoteEngine:
    """A remote model behind the Engine's generate(request, cancel) (engine.types.GenerationBackend)."""

    def __init__(self, remote: RemoteModel) -> None:
        self.remote = remote
        self.url = normalise_url(remote.url)

    def generate(self, request: GenerationRequest,
                 cancel: threading.Event | None = None) -> Iterator[TokenEvent | Completion]:
        """Send the request and wait for the server's status (errors raise here); the answer
        streams from the returned iterator."""
        if request.constraint is not None:  # its grammar is SpecChat's own: nothing to forward it as
            raise InvalidRequest(f"{request.constraint.what} needs constrained decoding, which a remote model is not "
                                 "asked for here: use a local model.")
        if request.logprobs is not None:
            raise InvalidRequest("Log-probabilities are not asked of a remote model here: use a local model.")
        cancel = cancel or threading.Event()
        chat = request.raw_prompt is None
        path = "/chat/completions" if chat else "/completions"
        lines: queue.Queue[object] = queue.Queue(QUEUED_LINES)
        stop = threading.Event()
        started = time.perf_counter()
        reader = threading.Thread(target=self._read, args=(path, self._body(request), lines, stop),
                                  name="specchat-remote", daemon=True)
        reader.start()
        first = self._next(lines, cancel)
        if first is None:  # cancelled before the server answered
            stop.set()
            return iter([self._completion("", "cancelled", {}, started, None, 0)])
        if isinstance(first, BaseException):
            raise first
        return self._stream(request, lines, cancel, stop, started)

    # ---- the reader thread -------------------------------------------------------------------
    def _read(self, path: str, body: dict[str, Any], lines: queue.Queue[object], stop: threading.Event) -> None:
        timeout = httpx2.Timeout(None, connect=CONNECT_SECONDS)  # an answer may take minutes to start
        opened = False
        try:
            with httpx2.Client(timeout=timeout) as client, client.stream(
                    "POST", self.url + path, json=body, headers=auth_headers(self.remote.api_key)) as resp:
                if resp.status_code >= 400:
                    put_line(lines, status_error(resp.status_code, server_message(read_some(resp, MAX_ERROR_BYTES)),
                                              self.url, self.remote.model), stop)
                    return
                if 300 <= resp.status_code < 400:  # not followed: the request carries the API key
                    put_line(lines, redirected(self.url, resp), stop)
                    return
                opened = True
                put_line(lines, _OPEN, stop)
                kind = resp.headers.get("content-type", "").split(";")[0].strip().lower()
                if kind == "application/json":
                    whole = read_some(resp, MAX_LINE_BYTES + 1)  # one object, not a stream: one event
                    put_line(lines, b"data: " + whole if len(whole) <= MAX_LINE_BYTES else too_long(self.url), stop)
                else:
                    for line in bounded_lines(resp, self.url):
                        if stop.is_set():
                            return  # leaving the block closes the connection: the server stops too
                        if line.startswith(b"data:"):  # comments, blank lines and other fields are skipped here
                            put_line(lines, line, stop)
                    if kind != "text/event-stream":  # an answer, but no stream: a web page, an empty 200
                        put_line(lines, not_a_stream(self.url, resp.status_code, kind), stop)
            put_line(lines, _END, stop)
        except httpx2.TransportError as exc:
            if not opened:  # refused, timed out, or closed before it answered
                put_line(lines, unreachable(self.url, exc), stop)
            else:
                put_line(lines, RemoteDisconnected(f"The server at {self.url} went away in the middle of the answer "
                                               f"({type(exc).__name__}); the part that arrived is kept."), stop)
        except httpx2.HTTPError as exc:  # a body that cannot be decoded (bad gzip), too many redirects
            put_line(lines, RemoteError(f"The server at {self.url} sent an answer that cannot be read "
                                    f"({type(exc).__name__}: {exc})."), stop)
        except Exception as exc:  # noqa: BLE001 - handed to generate(), which raises it in the caller
            put_line(lines, exc, stop)

    @staticmethod
    def _next(lines: queue.Queue[object], cancel: threading.Event) -> object | None:
        """The reader's next item, or None once `cancel` is set."""
        while not cancel.is_set():
            try:
                return lines.get(timeout=POLL_SECONDS)
            except queue.Empty:
                continue
        return None

    # ---- the answer --------------------------------------------------------------------------
    def _stream(self, request: GenerationRequest, lines: queue.Queue[object], cancel: threading.Event,
                stop: threading.Event, started: float) -> Iterator[TokenEvent | Completion]:
        text, deltas = "", 0
        thinking = False  # inside the <think> block that carries the server's reasoning
        most = request.max_new_tokens * MAX_CHARS_PER_TOKEN
        finish: str | None = None
        usage: dict[str, Any] = {}
        ttft: float | None = None
        try:
            while True:
                item = self._next(lines, cancel)
                if item is None:
                    yield self._completion(text, "cancelled", usage, started, ttft, deltas)
                    return
                if item is _END:
                    break
                if isinstance(item, BaseException):
                    raise item
                assert isinstance(item, bytes)
                data = sse_data(item)
                if data is None:
                    continue
                if data.strip() == b"[DONE]":
                    finish = finish or "stop"
                    continue
                chunk = self._event(data)
                if isinstance(chunk.get("usage"), dict):
                    usage = chunk["usage"]
                for content, reasoning, reason in self._choices(chunk, data):
                    piece, thinking = with_reasoning(content, reasoning, thinking)
                    if piece and len(text) + len(piece) > most:
                        raise RemoteError(f"The server at {self.url} sent more text than the "
                                          f"{request.max_new_tokens} tokens asked for, so the answer was stopped "
                                          "there (the part that arrived is kept): it does not honour max_tokens.")
                    if piece:
                        ttft = ttft if ttft is not None else time.perf_counter() - started
                        text += piece
                        deltas += 1
                        yield TokenEvent(token_ids=(), text=piece)
                    if reason:
                        finish = reason
        finally:
            stop.set()
        if finish is None:  # the stream ended without a finish reason or [DONE]: cut off
            raise RemoteDisconnected(f"The server at {self.url} closed the connection in the middle of the answer; "
                                     "the part that arrived is kept.")
        ended: FinishReason = "length" if finish == "length" else "stop" if request.stop else "eos"
        yield self._completion(text, ended, usage, started, ttft, deltas)

    def _event(self, data: bytes) -> dict[str, Any]:
        """One stream event (or a whole answer) as an object; RemoteError for anything else,
        and for an error the server reports in it."""
        try:
            # its usage figures are checked where they are read: an overflowing one is not worth the answer
            chunk = parse_json(data, what="the event", max_bytes=MAX_LINE_BYTES, finite=False)
        except MalformedInput as exc:
            raise RemoteError(f"The server at {self.url} sent an answer this client cannot read: "
                              f"{exc.user_message}") from None
        if not isinstance(chunk, dict):
            raise bad_event(self.url, "an event is not a JSON object", data)
        if chunk.get("error") not in (None, False, "", {}):
            raise RemoteError(f"The server at {self.url} stopped the answer: {error_text(chunk)}")
        return chunk

    def _choices(self, chunk: dict[str, Any],
                 data: bytes) -> Iterator[tuple[str | None, str | None, str | None]]:
        """(text, reasoning, finish reason) of the first choice in an event, after checking the
        shapes OpenAI's API gives them: `choices` a list of objects; `delta` (streamed chat) or
        `message` (a whole chat answer) an object whose `content` is text, and so its
        `reasoning_content` or `reasoning` (a reasoning parser's); `text` (completions) text;
        `finish_reason` text."""
        choices = chunk.get("choices")
        if choices is None:
            return
        if not isinstance(choices, list):
            raise bad_event(self.url, f"'choices' is {kind_of(choices)}, not a list", data)
        for choice in choices:
            if not isinstance(choice, dict):
                raise bad_event(self.url, f"a choice is {kind_of(choice)}, not an object", data)
            index = choice.get("index", 0)
            if not isinstance(index, int) or isinstance(index, bool):
                raise bad_event(self.url, f"a choice's 'index' is {kind_of(index)}, not a number", data)
            if index != 0:
                continue
            key = "delta" if "delta" in choice else "message" if "message" in choice else None
            part = choice.get(key) if key else None
            if part is not None and not isinstance(part, dict):
                raise bad_event(self.url, f"'{key}' is {kind_of(part)}, not an object", data)
            if key is None:
                piece, thought = choice.get("text"), None
            else:  # a null delta or message carries no text
                piece = part.get("content") if part is not None else None
                thought = part.get("reasoning_content", part.get("reasoning")) if part is not None else None
            if piece is not None and not isinstance(piece, str):
                raise bad_event(self.url, f"the text of a choice is {kind_of(piece)}, not a string", data)
            if thought is not None and not isinstance(thought, str):
                raise bad_event(self.url, f"the reasoning of a choice is {kind_of(thought)}, not a string", data)
            reason = choice.get("finish_reason")
            if reason is not None and not isinstance(reason, str):
                raise bad_event(self.url, f"'finish_reason' is {kind_of(reason)}, not a string", data)
            yield piece, thought, reason

    def _body(self, request: GenerationRequest) -> dict[str, Any]:
        s, default = request.sampling, SamplingSettings()
        body: dict[str, Any] = {"model": self.remote.model, "stream": True, "stream_options": {"include_usage": True},
                                "max_tokens": request.max_new_tokens, "temperature": s.temperature}
        if request.raw_prompt is None:
            body["messages"] = [{"role": m.role, "content": m.content} for m in request.messages]
        else:
            body["prompt"] = request.raw_prompt
        if s.top_p != default.top_p:
            body["top_p"] = s.top_p
        if s.seed is not None:
            body["seed"] = s.seed
        if request.stop:
            body["stop"] = list(request.stop)
        # vLLM's (and SpecChat's) extras; sent only when set, since OpenAI itself refuses them
        for name in ("top_k", "min_p", "repetition_penalty"):
            if getattr(s, name) != getattr(default, name):
                body[name] = getattr(s, name)
        return body

    def _completion(self, text: str, reason: FinishReason, usage: dict[str, Any], started: float,
                    ttft: float | None, deltas: int) -> Completion:
        seconds = time.perf_counter() - started
        extra, details = as_object(usage.get("specchat")), as_object(usage.get("prompt_tokens_details"))
        new = as_int(usage.get("completion_tokens"), deltas)
        stats = GenerationStats(
            prompt_tokens=as_int(usage.get("prompt_tokens"), 0), new_tokens=new,
            target_passes=as_int(extra.get("target_passes"), 0),
            tokens_per_pass=float(extra["tokens_per_pass"]) if is_number(extra.get("tokens_per_pass")) else 0.0,
            draft_passes=0, budget=as_int(extra.get("budget"), 0), seconds=seconds,
            ttft_seconds=ttft if ttft is not None else seconds,
            tokens_per_second=new / seconds if seconds > 0 else 0.0, peak_rss_bytes=0,
            mode="specexec" if extra.get("mode") == "specexec" else "autoregressive",
            cached_tokens=as_int(details.get("cached_tokens"), 0))
        return Completion(text=text, token_ids=(), finish_reason=reason, stats=stats)
