"""A local HTTP server speaking the part of the Hugging Face Hub protocol huggingface_hub uses.

    GET  /api/models/{owner}/{name}[/revision/{rev}][?blobs=true]   model info with siblings
    HEAD|GET /{owner}/{name}/resolve/{rev}/{path}                   file, Range supported

Responses carry X-Repo-Commit, ETag (quoted; the sha256 for LFS files, the git blob id
otherwise), X-Linked-Etag / X-Linked-Size for LFS files, Accept-Ranges and Content-Range.
Gated repos answer 401 (no token) or 403 (wrong token) with X-Error-Code: GatedRepo.

Faults, queued per file and consumed one per GET: drop the connection after N bytes, stall
(send nothing) for S seconds after N bytes, serve corrupted bytes, answer a status code.
"""

from __future__ import annotations

import hashlib
import json
import re
import socket
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlsplit

LFS_SUFFIXES = (".safetensors", ".gguf", ".bin")


STARTER_REPO = "HuggingFaceTB/SmolLM2-135M-Instruct"


def make_model_files(weights_bytes: int = 300_000, seed: int = 1) -> dict[str, bytes]:
    """A small HF-folder-shaped repo: config, tokenizer files and one safetensors-named blob."""
    weights = bytes((i * 131 + seed * 17 + (i >> 7)) % 251 for i in range(weights_bytes))
    return {
        "config.json": b'{"model_type": "llama", "vocab_size": 49152}',
        "generation_config.json": b'{"eos_token_id": 2}',
        "tokenizer.json": b'{"version": "1.0", "model": {"type": "BPE"}}' + b" " * 5000,
        "tokenizer_config.json": b'{"chat_template": "{{ messages }}"}',
        "model.safetensors": weights,
        "README.md": b"# not downloaded: not a model file\n",
        "original/consolidated.pth": b"pickle, never fetched",
    }


@dataclass
class Fault:
    kind: str  # "drop" | "stall" | "corrupt" | "status"
    after_bytes: int = 0
    seconds: float = 0.0
    status: int = 503


@dataclass
class FakeRepo:
    repo_id: str
    files: dict[str, bytes]
    commit: str = "0123456789abcdef0123456789abcdef01234567"
    gated: bool = False
    token: str | None = None
    declared_sizes: dict[str, int] = field(default_factory=dict)  # lie about sizes (disk-full test)

    def is_lfs(self, name: str) -> bool:
        return name.endswith(LFS_SUFFIXES)


@dataclass
class RequestRecord:
    method: str
    path: str
    range: str | None
    authorization: str | None
    bytes_sent: int = 0


def git_blob_id(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


class HubServer:
    """Start with `start()`, point HF_ENDPOINT at `.url`, stop with `stop()`."""

    def __init__(self, bytes_per_second: float | None = None, chunk: int = 16384) -> None:
        self.repos: dict[str, FakeRepo] = {}
        self.faults: dict[str, list[Fault]] = {}
        self.requests: list[RequestRecord] = []
        self.bytes_per_second = bytes_per_second
        self.chunk = chunk
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler_class())
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> "HubServer":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)

    def add_repo(self, repo: FakeRepo) -> FakeRepo:
        self.repos[repo.repo_id.lower()] = repo
        return repo

    def add_fault(self, repo_id: str, name: str, fault: Fault) -> None:
        self.faults.setdefault(f"{repo_id.lower()}/{name}", []).append(fault)

    def file_gets(self, name: str) -> list[RequestRecord]:
        return [r for r in self.requests if r.method == "GET" and "/resolve/" in r.path and r.path.endswith("/" + name)]

    def bytes_served(self, name: str) -> int:
        return sum(r.bytes_sent for r in self.file_gets(name))

    # --- protocol -------------------------------------------------------------------------

    def _handler_class(self) -> type[BaseHTTPRequestHandler]:
        hub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: object) -> None:  # quiet
                return

            def do_GET(self) -> None:
                hub._serve(self, head=False)

            def do_HEAD(self) -> None:
                hub._serve(self, head=True)

        return Handler

    def _serve(self, h: BaseHTTPRequestHandler, head: bool) -> None:
        record = RequestRecord("HEAD" if head else "GET", urlsplit(h.path).path, h.headers.get("Range"),
                               h.headers.get("Authorization"))
        with self._lock:
            self.requests.append(record)
        path = unquote(urlsplit(h.path).path)
        api = re.fullmatch(r"/api/models/([^/]+/[^/]+)(?:/revision/([^/]+))?", path)
        if api:
            return self._model_info(h, api.group(1), api.group(2) or "main")
        resolve = re.fullmatch(r"/([^/]+/[^/]+)/resolve/([^/]+)/(.+)", path)
        if resolve:
            return self._resolve(h, record, resolve.group(1), resolve.group(2), resolve.group(3), head)
        self._error(h, 404, "RepoNotFound", "Not found")

    def _repo(self, h: BaseHTTPRequestHandler, repo_id: str, revision: str) -> FakeRepo | None:
        repo = self.repos.get(repo_id.lower())
        if repo is None:
            self._error(h, 404, "RepoNotFound", "Repository not found")
            return None
        if revision not in ("main", repo.commit):
            self._error(h, 404, "RevisionNotFound", "Invalid rev id")
            return None
        return repo

    def _model_info(self, h: BaseHTTPRequestHandler, repo_id: str, revision: str) -> None:
        repo = self._repo(h, repo_id, revision)
        if repo is None:
            return
        siblings = []
        for name, data in sorted(repo.files.items()):
            size = repo.declared_sizes.get(name, len(data))
            entry: dict[str, object] = {"rfilename": name, "size": size, "blobId": git_blob_id(data)}
            if repo.is_lfs(name):
                entry["lfs"] = {"sha256": hashlib.sha256(data).hexdigest(), "size": size, "pointerSize": 134}
            siblings.append(entry)
        body = json.dumps({
            "_id": "x", "id": repo.repo_id, "modelId": repo.repo_id, "sha": repo.commit, "private": False,
            "gated": "manual" if repo.gated else False, "disabled": False, "downloads": 0, "likes": 0,
            "tags": [], "siblings": siblings, "lastModified": "2026-11-01T00:00:00.000Z",
        }).encode()
        h.send_response(200)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(body)))
        h.end_headers()
        h.wfile.write(body)

    def _resolve(self, h: BaseHTTPRequestHandler, record: RequestRecord, repo_id: str, revision: str,
                 name: str, head: bool) -> None:
        repo = self._repo(h, repo_id, revision)
        if repo is None:
            return
        if repo.gated:
            auth = h.headers.get("Authorization")
            if auth is None:
                return self._error(h, 401, "GatedRepo", "Access to model is restricted. You must be authenticated.")
            if auth != f"Bearer {repo.token}":
                return self._error(h, 403, "GatedRepo", "Access to model is restricted and you are not in the authorized list.")
        if name not in repo.files:
            return self._error(h, 404, "EntryNotFound", "Entry not found")
        data = repo.files[name]
        fault = None
        if not head:
            with self._lock:
                queue = self.faults.get(f"{repo_id.lower()}/{name}")
                fault = queue.pop(0) if queue else None
        if fault is not None and fault.kind == "status":
            return self._error(h, fault.status, "", "injected")
        if fault is not None and fault.kind == "corrupt":
            data = bytes(b ^ 0xFF for b in data)
        start = 0
        range_header = h.headers.get("Range")
        if range_header and not head:
            match = re.fullmatch(r"bytes=(\d+)-(\d*)", range_header)
            if not match or int(match.group(1)) >= len(data):
                h.send_response(416)
                h.send_header("Content-Range", f"bytes */{len(data)}")
                h.send_header("Content-Length", "0")
                h.end_headers()
                return
            start = int(match.group(1))
        body = data[start:]
        h.send_response(206 if start else 200)
        etag = hashlib.sha256(repo.files[name]).hexdigest() if repo.is_lfs(name) else git_blob_id(repo.files[name])
        h.send_header("ETag", f'"{etag}"')
        h.send_header("X-Repo-Commit", repo.commit)
        if repo.is_lfs(name):
            h.send_header("X-Linked-Etag", f'"{etag}"')
            h.send_header("X-Linked-Size", str(len(data)))
        h.send_header("Accept-Ranges", "bytes")
        h.send_header("Content-Type", "application/octet-stream")
        h.send_header("Content-Length", str(len(body)))
        if start:
            h.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
        h.end_headers()
        if head:
            return
        self._send_body(h, record, body, fault)

    def _send_body(self, h: BaseHTTPRequestHandler, record: RequestRecord, body: bytes, fault: Fault | None) -> None:
        limit = fault.after_bytes if fault is not None and fault.kind in ("drop", "stall") else len(body)
        sent = 0
        try:
            while sent < min(limit, len(body)):
                piece = body[sent:min(sent + self.chunk, limit)]
                h.wfile.write(piece)
                h.wfile.flush()
                sent += len(piece)
                record.bytes_sent = sent
                if self.bytes_per_second:
                    time.sleep(len(piece) / self.bytes_per_second)
            if fault is not None and fault.kind == "stall":
                self._stop.wait(fault.seconds)
            if fault is not None and fault.kind in ("drop", "stall"):
                h.close_connection = True
                h.connection.shutdown(socket.SHUT_RDWR)
        except (BrokenPipeError, ConnectionResetError, OSError):
            h.close_connection = True

    @staticmethod
    def _error(h: BaseHTTPRequestHandler, status: int, code: str, message: str) -> None:
        body = json.dumps({"error": message}).encode()
        h.send_response(status)
        if code:
            h.send_header("X-Error-Code", code)
        h.send_header("X-Error-Message", message)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(body)))
        h.end_headers()
        h.wfile.write(body)
