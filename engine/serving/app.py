"""The HTTP side of the OpenAI-compatible server: a Starlette app over a GenerationQueue.

    GET  /v1/models                 the served model (with max_model_len when known); none when
                                    its load failed or no model is chosen
    GET  /v1/models/{id}            one model, or 404
    POST /v1/chat/completions       chat messages through the model's chat template
    POST /v1/completions            a plain-text prompt
    GET  /health                    200 when ready, 503 while loading (no API key needed), with
                                    the queue: {"running": bool, "waiting": n}

Before anything else, guard.RequestGuard refuses what a web page in the user's browser could
send (a foreign Host or Origin, a POST that is not application/json), then the API key is
checked. Bodies are read with engine.untrusted.parse_json (size, depth and number bounds), so
hostile JSON is a 400, never a crash.

Streaming answers are server-sent events (`data: {chunk}` ... `data: [DONE]`). A request's
status is decided before its first byte: it waits its turn in the queue, the engine validates
it, and only then does a stream start, so a prompt that does not fit still gets its 413. Every
error is OpenAI's JSON shape (protocol.ApiError). A stream that ends other than by the model's
own end (the server shuts down, the engine fails mid-answer) ends with an error event,
`data: {"error": {...}}`, and no `[DONE]`: it must not look complete (OpenAI's clients raise on
it); an answer not streamed gets an error status instead. While a request waits or runs, a task
reads the connection: a client that goes away cancels its job (protocol: http.disconnect).

What this does not do: run the engine (scheduler.py), bind sockets or run uvicorn (server.py).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

from starlette.applications import Starlette
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from engine.errors import ContextTooLong, EngineError, InvalidRequest, MalformedInput
from engine.serving.formats import OutputParser, OutputSettings
from engine.serving.guard import AccessPolicy, RequestGuard
from engine.serving.logprobs import LogprobStream
from engine.serving.protocol import ApiError, Kind, RequestDefaults, error_body, parse_request
from engine.serving.responses import ChunkWriter, model_card, new_id, response
from engine.serving.scheduler import (
    Finished,
    GenerationQueue,
    Interrupted,
    Job,
    ModelState,
    NotReady,
    QueueFull,
    Started,
)
from engine.types import Completion, TokenEvent
from engine.untrusted import parse_json

log = logging.getLogger(__name__)

BODY_STALL_SECONDS = 30.0  # most time between two pieces of a request body
MAX_BODY_BYTES = 8 * 1024 * 1024  # a long conversation is far below this; a flood is refused early
RETRY_AFTER_SECONDS = "5"


def build_app(queue: GenerationQueue, defaults: Callable[[], RequestDefaults], api_key: str | None = None,
              max_body_bytes: int = MAX_BODY_BYTES, access: AccessPolicy | None = None,
              body_stall_s: float = BODY_STALL_SECONDS) -> ASGIApp:
    """The ASGI app. `defaults()` is read per request (the app's settings can change);
    `api_key` None or "" = no key needed; `access` what the guard lets in (default: this
    computer's loopback names on any port, no web pages)."""

    async def list_models(request: Request) -> Response:
        model = queue.model
        data = [model_card(model.id, model.created, model.context_length)] if _listed(model) else []
        return JSONResponse({"object": "list", "data": data})

    async def get_model(request: Request) -> Response:
        model = queue.model
        if not _listed(model) or request.path_params["model"] != model.id:
            raise _unknown_model(request.path_params["model"], model)
        return JSONResponse(model_card(model.id, model.created, model.context_length))

    async def health(request: Request) -> Response:
        model = queue.model
        ready = model.status == "ready"
        state = queue.state()
        return JSONResponse({"status": "ok" if ready else model.status, "model": model.id, "detail": model.detail,
                             "running": state.running, "waiting": state.waiting}, status_code=200 if ready else 503)

    async def chat(request: Request) -> Response:
        return await _complete(request, "chat")

    async def completions(request: Request) -> Response:
        return await _complete(request, "completion")

    async def _complete(request: Request, kind: Kind) -> Response:
        body = await _read_json(request, max_body_bytes, body_stall_s)
        model = queue.model
        parsed = parse_request(kind, body, defaults(), model.context_length, model.chat_template)
        if parsed.model is not None and model.id and parsed.model != model.id:
            raise _unknown_model(parsed.model, model)
        try:
            job = queue.submit(parsed.choices, asyncio.get_running_loop())
        except NotReady as exc:
            raise ApiError(503, str(exc), "server_error", "model_not_ready",
                           headers={"Retry-After": RETRY_AFTER_SECONDS}) from exc
        except QueueFull as exc:
            raise ApiError(429, str(exc), "server_busy", "queue_full",
                           headers={"Retry-After": RETRY_AFTER_SECONDS}) from exc
        watcher: asyncio.Task[None] | None  # None once the stream owns it
        watcher = asyncio.create_task(_cancel_on_disconnect(request.receive, job))
        try:
            first = await job.events.get()
            if isinstance(first, BaseException):
                raise _api_error(first)
            if isinstance(first, Finished):  # the client left while it waited; nobody reads this
                raise ApiError(499, "The request was cancelled.", "invalid_request_error", "cancelled")
            assert isinstance(first, Started)
            rid, name = new_id(kind), model.id or parsed.model or ""
            writer = ChunkWriter(kind, rid, name, parsed.include_usage)
            logprobs = parsed.choices[0].logprobs is not None
            if parsed.stream:
                stream = EventStream(_chunks(job, writer, parsed.output, logprobs), watcher)
                watcher = None  # the stream ends it
                return stream
            await _drain(job)
            if any(c.finish_reason == "cancelled" for c in job.completions):
                raise _cut(job.cut)
            return JSONResponse(response(kind, rid, name, writer.created, job.completions, parsed.output, logprobs))
        finally:
            if watcher is not None:
                watcher.cancel()

    routes = [
        Route("/v1/models", list_models, methods=["GET"]),
        Route("/v1/models/{model:path}", get_model, methods=["GET"]),
        Route("/v1/chat/completions", chat, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/health", health, methods=["GET"]),
    ]
    handlers: dict[Any, Callable[..., Any]] = {ApiError: _error_response, HTTPException: _http_error,
                                              Exception: _unexpected_error}
    app: ASGIApp = Starlette(routes=routes, exception_handlers=handlers)
    app = ApiKeyCheck(app, api_key) if api_key else app
    return RequestGuard(app, access or AccessPolicy())


def _listed(model: ModelState) -> bool:
    """Whether /v1/models shows the model: it is served or on its way (not after a failed load)."""
    return bool(model.id) and model.status in ("ready", "loading")


# ---- the pieces of a request ------------------------------------------------------------------------
async def _read_json(request: Request, limit: int, stall_s: float) -> object:
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:  # refused before a byte is read (no "100 Continue")
        raise _too_large(limit)
    body = bytearray()
    chunks = request.stream().__aiter__()
    try:
        while True:
            try:  # a client that stops sending mid-body would otherwise hold the connection forever
                chunk = await asyncio.wait_for(chunks.__anext__(), stall_s)
            except StopAsyncIteration:
                break
            body += chunk
            if len(body) > limit:
                raise _too_large(limit)
    except ClientDisconnect:
        raise ApiError(400, "The client disconnected while sending the request.") from None
    except asyncio.TimeoutError:
        raise ApiError(408, f"The request body stopped arriving for {stall_s:g} s; send it whole.",
                       "invalid_request_error", "request_timeout") from None
    try:
        value = parse_json(body, what="The request body", max_bytes=limit)
        _check_strings(value)
    except MalformedInput as exc:
        raise ApiError(400, exc.user_message, "invalid_request_error", "invalid_json") from None
    return value


def _too_large(limit: int) -> ApiError:
    return ApiError(413, f"The request body is larger than {limit // (1024 * 1024)} MiB.", "invalid_request_error",
                    "request_too_large")


def _check_strings(value: object) -> None:
    """MalformedInput when a string in the body cannot be UTF-8 encoded (an unpaired surrogate
    escape such as \\ud800): it could be neither tokenized nor quoted back in an answer."""
    stack = [value]
    while stack:  # no recursion: the depth is bounded already, but a loop costs nothing
        item = stack.pop()
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                raise MalformedInput("The request body holds text that is not valid Unicode (an unpaired "
                                     "surrogate escape such as \\ud800).") from None
        elif isinstance(item, dict):
            stack.extend(item)
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)


async def _cancel_on_disconnect(receive: Receive, job: Job) -> None:
    """Read the connection until the client goes away, then cancel its job. (Once the body is
    read, an ASGI server's receive() returns only http.disconnect.)"""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            job.stop()
            return


async def _drain(job: Job) -> None:
    """Wait for a non-streamed job's end; an error on the way is the answer."""
    while not isinstance(event := await job.events.get(), Finished):
        if isinstance(event, BaseException):
            raise _api_error(event)


async def _chunks(job: Job, writer: ChunkWriter, output: OutputSettings | None = None,
                  logprobs: bool = False) -> AsyncIterator[bytes]:
    """The job's events as server-sent events; with `output`, each choice's text goes through
    its own OutputParser (content, reasoning and tool-call deltas); with `logprobs`, each
    token's entry rides on the first chunk sent after it came (logprobs.LogprobStream). A
    stream the model did not end itself (an error after the stream started, a server shutting
    down) gets an `error` event (the status line is long gone) and no [DONE], and no choice in
    it says "stop"."""
    opened: set[int] = set()
    parsers: dict[int, OutputParser] = {}
    entries: dict[int, LogprobStream] = {}
    try:
        while not isinstance(event := await job.events.get(), Finished):
            if isinstance(event, BaseException):
                yield _sse(_api_error(event).body())
                return
            if isinstance(event, Started):
                continue
            index, item = event
            if isinstance(item, Completion) and item.finish_reason == "cancelled":
                yield _sse(_cut(job.cut).body())
                return
            if index not in opened:
                opened.add(index)
                if (chunk := writer.opened(index)) is not None:
                    yield _sse(chunk)
                if output is not None:
                    parsers[index] = output.parser()
                if logprobs:
                    entries[index] = LogprobStream(writer.kind)
            parser, sent = parsers.get(index), entries.get(index)
            chunks: list[dict[str, Any]] = []
            if isinstance(item, TokenEvent):
                if sent is not None:
                    sent.add(item.logprobs)
                if item.text:
                    chunks = writer.parsed(index, parser.feed(item.text)) if parser else [writer.text(index, item.text)]
            elif isinstance(item, Completion):
                chunks = writer.parsed(index, parser.finish()) if parser is not None else []
                chunks.append(writer.finished(index, item, bool(parser and parser.calls)))
                if sent is not None:
                    sent.rest(item.logprobs)
            if sent is not None:
                sent.attach(chunks)
            for chunk in chunks:
                yield _sse(chunk)
        if writer.include_usage and job.completions:
            yield _sse(writer.usage(job.completions))
        yield b"data: [DONE]\n\n"
    finally:
        job.stop()  # however the stream ended, nothing more of this job is wanted


def _sse(data: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(data, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


class EventStream(Response):
    """A text/event-stream response fed by an async iterator; ends `watcher` when it is done."""

    media_type = "text/event-stream"

    def __init__(self, chunks: AsyncIterator[bytes], watcher: asyncio.Task[None]) -> None:
        self.status_code = 200
        self.background = None
        # no Content-Length: the body's end is the end of the stream
        self.raw_headers = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
                            (b"x-accel-buffering", b"no")]
        self._chunks = chunks
        self._watcher = watcher

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
            async for chunk in self._chunks:  # after a disconnect the server drops these sends
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            self._watcher.cancel()


class ApiKeyCheck:
    """Every route but /health needs `Authorization: Bearer <key>` (compared in constant time)."""

    def __init__(self, app: ASGIApp, key: str) -> None:
        self.app = app
        self.key = key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] != "/health":
            header = Headers(scope=scope).get("authorization", "")
            scheme, _, token = header.partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), self.key):
                error = ApiError(401, "Incorrect or missing API key: send it as 'Authorization: Bearer <key>'.",
                                 "invalid_request_error", "invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
                await _error_response(None, error)(scope, receive, send)
                return
        await self.app(scope, receive, send)


# ---- errors -------------------------------------------------------------------------------------------
def _unknown_model(asked: str, model: ModelState) -> ApiError:
    asked = asked if len(asked) <= 100 else asked[:100] + "…"
    if _listed(model):
        why = f"this server serves '{model.id}'"
    elif model.status == "failed":
        why = f"this server's model failed to load ({model.detail})"
    else:
        why = "no model is loaded"
    return ApiError(404, f"The model '{asked}' does not exist: {why}.", "invalid_request_error", "model_not_found",
                    "model")


def _cut(why: str) -> ApiError:
    """The answer to a job that ended before the model ended it: not a whole answer."""
    why = why or "it was cancelled"
    return ApiError(503, f"The answer was cut off before its end: {why}. The text received is incomplete; "
                         "retry the request.", "server_error", "answer_interrupted",
                    headers={"Retry-After": RETRY_AFTER_SECONDS})


def _api_error(exc: BaseException) -> ApiError:
    """An exception from the queue or the engine as the answer to send."""
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, Interrupted):
        return _cut(str(exc))
    if isinstance(exc, ContextTooLong):
        return ApiError(413, exc.user_message, "invalid_request_error", "context_length_exceeded", "messages")
    if isinstance(exc, InvalidRequest):
        return ApiError(400, exc.user_message)
    if isinstance(exc, NotReady):
        return ApiError(503, str(exc), "server_error", "model_not_ready", headers={"Retry-After": RETRY_AFTER_SECONDS})
    if isinstance(exc, EngineError):
        return ApiError(500, exc.user_message, "server_error")
    log.error("request failed", exc_info=exc)
    return ApiError(500, f"The server failed ({type(exc).__name__}: {exc}); details are in its log.", "server_error")


def _error_response(request: Request | None, exc: Exception) -> Response:
    error = exc if isinstance(exc, ApiError) else _api_error(exc)
    return JSONResponse(error.body(), status_code=error.status, headers=error.headers)


def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    message = {404: f"There is no route {request.url.path}.",
               405: f"{request.method} is not allowed on {request.url.path}."}.get(exc.status_code, str(exc.detail))
    return JSONResponse(error_body(message, "invalid_request_error"), status_code=exc.status_code,
                        headers=exc.headers)


def _unexpected_error(request: Request, exc: Exception) -> Response:
    return _error_response(request, _api_error(exc))
