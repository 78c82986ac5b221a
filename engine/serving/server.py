"""Where the API listens and how it runs: `ServeSettings` (host, port, key, queue size, the
Host names and web pages let in beside the defaults (guard.py); a non-loopback address needs an
API key or an explicit opt-out), the listening socket, and
uvicorn, either in the calling thread (`specchat serve`: Ctrl+C stops it) or in a background
thread (the app: `start()` / `stop()`).

The socket is bound before anything else happens, so a port in use is an error at once (not
after a model load), and port 0 picks a free port (tests read `port` back).
"""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import uvicorn

from engine.errors import EngineError, InvalidRequest
from engine.serving.app import BODY_STALL_SECONDS, build_app
from engine.serving.guard import AccessPolicy, check_allowed_hosts, check_allowed_origins, is_loopback
from engine.serving.protocol import RequestDefaults
from engine.serving.scheduler import GenerationQueue

log = logging.getLogger(__name__)

DEFAULT_PORT = 8765
DEFAULT_QUEUE = 32
SHUTDOWN_SECONDS = 3  # open streams get this long to end after their jobs are cancelled
INSECURE_FLAG = "--insecure-no-api-key"


class PortInUse(EngineError):
    """The address or port cannot be listened on."""


@dataclass(frozen=True)
class ServeSettings:
    """host: the address to listen on (127.0.0.1 = this computer only; 0.0.0.0 = every
    network this computer is on). api_key: required from clients when set ("" = none).
    insecure: listen on the network without a key (anyone who can reach the port can use the
    model and the machine's time). queue_size: most requests waiting behind the one answered.
    allowed_hosts: Host names accepted beside this computer's own (a reverse proxy's name, a
    DNS name on the network; "*" = any); allowed_origins: web pages (scheme://host:port, "null",
    "*") whose scripts may use the API, with CORS (guard.py). Both are checked and normalised
    here (InvalidRequest for a malformed entry). body_stall_s: most seconds between two pieces
    of a request body (a client that stops mid-body gets a 408 instead of holding the
    connection forever)."""

    host: str = "127.0.0.1"
    port: int = DEFAULT_PORT
    api_key: str = field(default="", repr=False)
    insecure: bool = False
    queue_size: int = DEFAULT_QUEUE
    allowed_hosts: tuple[str, ...] = ()
    allowed_origins: tuple[str, ...] = ()
    body_stall_s: float = BODY_STALL_SECONDS

    def __post_init__(self) -> None:
        object.__setattr__(self, "allowed_hosts", check_allowed_hosts(self.allowed_hosts))
        object.__setattr__(self, "allowed_origins", check_allowed_origins(self.allowed_origins))
        if not 0 <= self.port <= 65535:
            raise InvalidRequest(f"The port must be from 1 to 65535 (got {self.port}).")
        if self.queue_size < 0:
            raise InvalidRequest(f"The queue size must be 0 or more (got {self.queue_size}).")
        if not is_loopback(self.host) and not self.api_key and not self.insecure:
            raise InvalidRequest(
                f"Listening on {self.host} lets every computer that can reach this one use the model. "
                f"Set an API key (--api-key KEY) that clients must send, or pass {INSECURE_FLAG} to accept that.")

    def url(self, port: int | None = None) -> str:
        """The API's base URL as a client on this computer would use it."""
        host = "127.0.0.1" if self.host in ("0.0.0.0", "") else "[::1]" if self.host == "::" else self.host
        if ":" in host and not host.startswith("["):
            host = f"[{host}]"
        return f"http://{host}:{self.port if port is None else port}/v1"


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket; PortInUse with what to do when the address is taken."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a restarted server may reuse TIME_WAIT
        sock.bind((host, port))
        sock.listen(128)
    except OSError as exc:
        sock.close()
        raise PortInUse(f"Cannot listen on {host}:{port} ({exc.strerror or exc}). Another program (or another "
                        "SpecChat) may use that port: choose another one.") from exc
    sock.set_inheritable(False)
    return sock


class Server:
    """The API server: a bound socket, the Starlette app over `queue`, and uvicorn.

    `run()` serves in the calling thread until Ctrl+C (or `stop()`); `start()` serves in a
    background thread. Either way `stop()` cancels the queue's jobs first, so open streams
    end and the shutdown does not wait for whole answers."""

    def __init__(self, settings: ServeSettings, queue: GenerationQueue,
                 defaults: Callable[[], RequestDefaults]) -> None:
        self.settings = settings
        self.queue = queue
        self._socket = bind(settings.host, settings.port)
        self.port = int(self._socket.getsockname()[1])
        access = AccessPolicy(settings.host, self.port, settings.allowed_hosts, settings.allowed_origins)
        app = build_app(queue, defaults, settings.api_key or None, access=access, body_stall_s=settings.body_stall_s)
        config = uvicorn.Config(app, http="h11", lifespan="off", log_level="warning", access_log=False,
                                timeout_graceful_shutdown=SHUTDOWN_SECONDS)
        self._uvicorn = _Uvicorn(config, queue)
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return self.settings.url(self.port)

    def run(self) -> None:
        """Serve here until Ctrl+C or stop() (Ctrl+C is re-raised afterwards as KeyboardInterrupt)."""
        try:
            self._uvicorn.run(sockets=[self._socket])
        finally:
            self._socket.close()

    def start(self) -> None:
        self._thread = threading.Thread(target=self.run, name="specchat-api", daemon=True)
        self._thread.start()

    def stop(self, wait: float = SHUTDOWN_SECONDS + 2) -> None:
        """Cancel every job and stop serving (from any thread); waits for a background thread."""
        self._uvicorn.should_exit = True
        self.queue.close(wait=0)
        if self._thread is not None:
            self._thread.join(wait)
            if self._thread.is_alive():
                log.warning("the API server thread did not stop in %.0f s", wait)

    @property
    def running(self) -> bool:
        return self._uvicorn.started and not self._uvicorn.should_exit


class _Uvicorn(uvicorn.Server):
    """uvicorn that cancels the queue's jobs as soon as it is asked to exit (Ctrl+C): an open
    stream then ends within one decoding step instead of holding the shutdown for a whole answer."""

    def __init__(self, config: uvicorn.Config, queue: GenerationQueue) -> None:
        super().__init__(config)
        self._queue = queue

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        await asyncio.to_thread(self._queue.close, 0)
        await super().shutdown(sockets)
