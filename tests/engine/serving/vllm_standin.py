"""A local HTTP server that answers like vLLM's OpenAI server (`vllm serve MODEL --api-key K`),
for the remote-engine tests: nothing here runs a model.

    GET  /v1/models             {"object": "list", "data": [{"id", "object": "model", "created",
                                 "owned_by": "vllm", "root", "parent": null, "max_model_len",
                                 "permission": [...]}]}
    POST /v1/chat/completions   streamed as vLLM streams: a first chunk with the assistant role
                                and empty content, one chunk per word, a last chunk with
                                finish_reason and stop_reason, with include_usage a chunk with
                                "choices": [] and the usage, then `data: [DONE]`; chunked
                                transfer encoding, as uvicorn sends it. Not streamed: one object.
    POST /v1/completions        the same for a plain prompt

Errors in vLLM's shapes: its API-key middleware answers 401 {"error": "Unauthorized"}; an
unknown model is 404 {"error": {"message": "The model `x` does not exist.", "type":
"NotFoundError", "param": "model", "code": 404}}; a bad field is 400 with "BadRequestError".

The answer is scripted: "You said: <the last user message>" word by word. Faults: `pause`
(seconds between chunks), `die_after` (after that many words the server goes away: the
connection is cut mid-stream and nothing listens any more). A hostile server: `models_body`
(raw bytes sent as the model list), `events` (raw payloads sent as the stream's `data:` lines,
then [DONE]), `answer` ((content type, raw bytes) sent whole instead of a stream). Requests are
recorded.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

MODEL = "meta-llama/Llama-3.1-70B-Instruct"


class VllmStandIn:
    """Start with `start()`; `url` is the API base (…/v1)."""

    def __init__(self, models: tuple[str, ...] = (MODEL,), api_key: str = "", port: int = 0) -> None:
        self.models = models
        self.api_key = api_key
        self.pause = 0.0
        self.die_after: int | None = None
        self.models_body: bytes | None = None
        self.events: list[bytes] | None = None
        self.answer: tuple[str, bytes] | None = None
        self.requests: list[dict[str, Any]] = []
        self.disconnects = 0  # streams whose client went away before the end
        self._port = port
        self._server: ThreadingHTTPServer | None = None

    @property
    def url(self) -> str:
        assert self._server is not None
        return f"http://127.0.0.1:{self._server.server_address[1]}/v1"

    @property
    def port(self) -> int:
        assert self._server is not None
        return int(self._server.server_address[1])

    def start(self) -> VllmStandIn:
        stand_in = self

        class Handler(_Handler):
            owner = stand_in

        self._server = ThreadingHTTPServer(("127.0.0.1", self._port), Handler)
        self._server.daemon_threads = True
        self._port = self.port  # a restart comes back on the same port
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        return self

    def stop(self) -> None:
        """Nothing listens any more (connections are refused)."""
        server, self._server = self._server, None  # a start() right after gets a fresh one
        if server is not None:
            server.shutdown()
            server.server_close()


class _Handler(BaseHTTPRequestHandler):
    owner: VllmStandIn
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - quiet in tests
        pass

    # ---- plumbing ---------------------------------------------------------------------------
    def _json(self, status: int, body: object) -> None:
        self._raw(status, "application/json", json.dumps(body).encode())

    def _raw(self, status: int, content_type: str, data: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _authorised(self) -> bool:
        key = self.owner.api_key
        if key and self.headers.get("Authorization") != f"Bearer {key}":
            self._json(401, {"error": "Unauthorized"})
            return False
        return True

    def _bad(self, message: str) -> None:
        self._json(400, {"error": {"message": message, "type": "BadRequestError", "param": None, "code": 400}})

    # ---- routes -----------------------------------------------------------------------------
    def do_GET(self) -> None:  # noqa: N802
        if not self._authorised():
            return
        if self.path == "/v1/models" and self.owner.models_body is not None:
            self._raw(200, "application/json", self.owner.models_body)
        elif self.path == "/v1/models":
            now = int(time.time())
            self._json(200, {"object": "list", "data": [
                {"id": m, "object": "model", "created": now, "owned_by": "vllm", "root": m, "parent": None,
                 "max_model_len": 8192, "permission": [{"id": "modelperm-0", "object": "model_permission",
                                                        "created": now, "allow_sampling": True}]}
                for m in self.owner.models]})
        else:
            self._json(404, {"detail": "Not Found"})

    def do_POST(self) -> None:  # noqa: N802
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
        if not self._authorised():
            return
        self.owner.requests.append(body)
        chat = self.path == "/v1/chat/completions"
        if not chat and self.path != "/v1/completions":
            self._json(404, {"detail": "Not Found"})
            return
        if body.get("model") not in self.owner.models:
            self._json(404, {"error": {"message": f"The model `{body.get('model')}` does not exist.",
                                       "type": "NotFoundError", "param": "model", "code": 404}})
            return
        if not isinstance(body.get("max_tokens", 16), int) or body.get("max_tokens", 16) < 1:
            self._bad("max_tokens must be at least 1, got 0.")
            return
        if self.owner.answer is not None:
            self._raw(200, *self.owner.answer)
            return
        if self.owner.events is not None:
            self._hostile_stream(self.owner.events)
            return
        said = body["messages"][-1]["content"] if chat else body.get("prompt", "")
        words = [w + " " for w in f"You said: {said}".split()]
        words = words[: body.get("max_tokens", 16)]
        finish = "length" if len(words) == body.get("max_tokens") else "stop"
        if body.get("stream"):
            self._stream(body, chat, words, finish)
        else:
            text = "".join(words)
            choice = ({"index": 0, "message": {"role": "assistant", "content": text, "tool_calls": []}}
                      if chat else {"index": 0, "text": text})
            self._json(200, {"id": "chatcmpl-1", "object": "chat.completion" if chat else "text_completion",
                             "created": int(time.time()), "model": body["model"],
                             "choices": [{**choice, "logprobs": None, "finish_reason": finish, "stop_reason": None}],
                             "usage": {"prompt_tokens": 7, "total_tokens": 7 + len(words),
                                       "completion_tokens": len(words)}})

    def _stream(self, body: dict[str, Any], chat: bool, words: list[str], finish: str) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream; charset=utf-8")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        base = {"id": "chatcmpl-9f8e", "object": "chat.completion.chunk" if chat else "text_completion",
                "created": int(time.time()), "model": body["model"]}

        def choice(text: str | None, role: bool = False, reason: str | None = None) -> dict[str, Any]:
            if chat:
                delta: dict[str, Any] = {"role": "assistant"} if role else {}
                if text is not None:
                    delta["content"] = text
                out: dict[str, Any] = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}
            else:
                out = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": reason}
            if reason is not None:
                out["stop_reason"] = None
            return out

        events = [{**base, "choices": [choice("", role=True)]}] if chat else []
        events += [{**base, "choices": [choice(w)]} for w in words]
        events.append({**base, "choices": [choice("", reason=finish)]})
        if (body.get("stream_options") or {}).get("include_usage"):
            events.append({**base, "choices": [], "usage": {"prompt_tokens": 7, "total_tokens": 7 + len(words),
                                                             "completion_tokens": len(words)}})
        try:
            for i, event in enumerate(events):
                if self.owner.die_after is not None and i > self.owner.die_after:
                    self._die()
                    return
                self._chunk(b"data: " + json.dumps(event).encode() + b"\n\n")
                time.sleep(self.owner.pause)
            self._chunk(b"data: [DONE]\n\n")
            self._chunk(b"")
        except (BrokenPipeError, ConnectionResetError):
            self.owner.disconnects += 1

    def _hostile_stream(self, events: list[bytes]) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        try:
            for event in events:
                self._chunk(b"data: " + event + b"\n\n")
            self._chunk(b"data: [DONE]\n\n")
            self._chunk(b"")
        except (BrokenPipeError, ConnectionResetError):
            self.owner.disconnects += 1

    def _chunk(self, data: bytes) -> None:
        self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
        self.wfile.flush()

    def _die(self) -> None:
        """The server goes away mid-answer: this connection is cut, nothing listens afterwards."""
        threading.Thread(target=self.owner.stop, daemon=True).start()
        self.connection.shutdown(socket.SHUT_RDWR)
        self.close_connection = True
