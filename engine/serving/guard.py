"""Who may talk to the API: the checks that keep web pages in the user's own browser from
driving a server that listens on this computer (cross-site requests, DNS rebinding).

A page on any site can make the browser send requests to 127.0.0.1. The browser sends a
"simple" POST (text/plain, a form) without asking the server first, and a page whose own name
is re-pointed at 127.0.0.1 (DNS rebinding) can even read the answers. So, before the API key
and before any generation, `RequestGuard` refuses:

- a `Host` header that does not name the server: by default localhost, 127.0.0.1 and [::1]
  (with the served port, or none), the address given as --host, and, when the server listens
  on the network (0.0.0.0, ::, a LAN address), any IP address (an address cannot be rebound: a
  browser sends it only to a page loaded from that very address) and this computer's own names
  (its host name, its fully qualified name, NAME.local); plus `allowed_hosts`. A rebound page
  sends its own name, so it is refused. -> 403 `host_not_allowed`.
- an `Origin` header (every browser sends one on a POST from a page, and on a script's GET to
  another site) that is not the server's own origin or in `allowed_origins`; `Origin: null`
  (local files, sandboxed frames) included. -> 403 `origin_not_allowed`.
- a POST whose `Content-Type` is not application/json (a charset parameter is fine): forms and
  text/plain are what a page can send without the browser asking first. -> 415.

An allowed origin gets CORS: preflight OPTIONS answered (204), and `Access-Control-Allow-Origin`
echoed on every answer, so a page the user allowed works from the browser. Without allowed
origins no CORS header is ever sent. Every refusal is OpenAI's error JSON naming the option
that allows it (`--allowed-hosts`, `--allowed-origins`; Settings > Server in the app).

What this does not do: check the API key (app.ApiKeyCheck, inside this), or TLS.
"""

from __future__ import annotations

import ipaddress
import json
import re
import socket
from collections.abc import Iterable
from dataclasses import dataclass
from functools import cached_property
from urllib.parse import urlsplit

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from engine.errors import InvalidRequest
from engine.serving.protocol import ApiError

LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")
WILDCARDS = ("0.0.0.0", "::", "")
DEFAULT_PORTS = {"http": 80, "https": 443}
CORS_METHODS = "GET, POST, OPTIONS"
CORS_HEADERS = "Authorization, Content-Type"
CORS_MAX_AGE = "600"
HOSTS_OPTION = ("--allowed-hosts", "Allowed hosts")  # the CLI option, the app's field (Settings > Server)
ORIGINS_OPTION = ("--allowed-origins", "Allowed web pages")
_HOST = re.compile(r"(?:\[(?P<v6>[0-9a-f:.]+)\]|(?P<name>[a-z0-9_.-]+))(?::(?P<port>[0-9]{1,5}))?")
_SHOWN = 120  # most characters of a header quoted back in a message


def is_loopback(host: str) -> bool:
    """Whether `host` is this computer only (a host name other than localhost may resolve to
    anything, so it counts as the network)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def split_list(text: str | Iterable[str]) -> tuple[str, ...]:
    """A comma- or space-separated list (a CLI option, a settings field) -> its entries."""
    items = re.split(r"[,\s]+", text) if isinstance(text, str) else [i for t in text for i in re.split(r"[,\s]+", t)]
    return tuple(i for i in items if i)


def parse_host(value: str) -> tuple[str, int | None] | None:
    """A Host header (or an allowed-hosts entry) -> (name, port), lower case, an IPv6 address
    without brackets, no trailing dot; None when it is not a host name or address."""
    match = _HOST.fullmatch(value.strip().lower())
    if match is None:
        return None
    port = int(match["port"]) if match["port"] else None
    if port is not None and not 0 < port < 65536:
        return None
    if match["v6"]:
        try:
            return str(ipaddress.IPv6Address(match["v6"])), port
        except ValueError:
            return None
    name = match["name"].removesuffix(".")
    return (name, port) if name and ".." not in name else None


def normalise_origin(value: str) -> str | None:
    """An Origin header (or an allowed-origins entry) -> "scheme://host[:port]" without a
    default port, lower case; "null" as is; None when it is not an origin."""
    value = value.strip().lower()
    if value == "null":
        return value
    try:
        parts = urlsplit(value)
        port = parts.port
    except ValueError:
        return None
    if not parts.scheme or not parts.hostname or parts.path not in ("", "/") or parts.query or parts.fragment \
            or parts.username is not None or parts.password is not None:
        return None
    host = parts.hostname.removesuffix(".")
    host = f"[{host}]" if ":" in host else host
    port = None if port == DEFAULT_PORTS.get(parts.scheme) else port
    return f"{parts.scheme}://{host}" + (f":{port}" if port is not None else "")


def check_allowed_hosts(entries: Iterable[str]) -> tuple[str, ...]:
    """Validated allowed-hosts entries ("name", "name:port", "*.example.com", an address, "*");
    InvalidRequest naming a bad one."""
    out = []
    for entry in entries:
        bare = entry.removeprefix("*.")
        if entry != "*" and parse_host(bare) is None:
            raise InvalidRequest(f"'{entry}' is not a host name or address for --allowed-hosts: give names like "
                                 "gpu-box, gpu-box.lan:8765, *.example.com or 192.168.1.20 (or * for any).")
        out.append(entry.lower())
    return tuple(out)


def check_allowed_origins(entries: Iterable[str]) -> tuple[str, ...]:
    """Validated allowed-origins entries ("https://app.example", "http://localhost:3000",
    "null", "*"); InvalidRequest naming a bad one."""
    out = []
    for entry in entries:
        origin = "*" if entry == "*" else normalise_origin(entry)
        if origin is None:
            raise InvalidRequest(f"'{entry}' is not a web page's origin for --allowed-origins: give the scheme, "
                                 "host and port only, like http://localhost:3000 or https://chat.example.com "
                                 "(or null, or * for any page).")
        out.append(origin)
    return tuple(out)


def machine_names() -> frozenset[str]:
    """This computer's own names, as a LAN client may type them: its host name, the fully
    qualified name and the short one, and NAME.local (mDNS)."""
    names: set[str] = set()
    for name in (socket.gethostname(), socket.getfqdn()):
        name = name.lower().removesuffix(".")
        if name:
            short = name.split(".")[0]
            names.update({name, short, f"{short}.local"})
    return frozenset(names)


@dataclass(frozen=True)
class AccessPolicy:
    """What the guard accepts. host: the address listened on; port: the port served (None: any
    port); allowed_hosts / allowed_origins: validated entries (check_allowed_*)."""

    host: str = "127.0.0.1"
    port: int | None = None
    allowed_hosts: tuple[str, ...] = ()
    allowed_origins: tuple[str, ...] = ()

    @cached_property
    def network(self) -> bool:
        """Listening beyond this computer (a wildcard or a non-loopback address)."""
        return self.host in WILDCARDS or not is_loopback(self.host)

    @cached_property
    def own_names(self) -> frozenset[str]:
        names = set(LOOPBACK_NAMES)
        served = parse_host(self.host if ":" not in self.host else f"[{self.host}]")
        if self.host not in WILDCARDS and served is not None:
            names.add(served[0])
        if self.network:
            names |= machine_names()
        return frozenset(names)

    def host_allowed(self, name: str, port: int | None) -> bool:
        for entry in self.allowed_hosts:
            if entry == "*":
                return True
            if entry.startswith("*."):
                if name.endswith(entry[1:]):
                    return True
                continue
            parsed = parse_host(entry)
            if parsed is not None and parsed[0] == name and (parsed[1] is None or parsed[1] == port):
                return True
        if port is not None and self.port is not None and port != self.port:
            return False
        return name in self.own_names or (self.network and _is_address(name))

    def origin_allowed(self, origin: str, host: str | None) -> bool:
        """An allowed origin, or the server's own (the Origin names exactly the Host asked)."""
        if "*" in self.allowed_origins or origin in self.allowed_origins:
            return True
        if origin == "null" or host is None:
            return False
        parts = urlsplit(origin)
        own = parse_host(host)
        if own is None or parts.scheme != "http" or parts.hostname is None:
            return False
        return (parts.hostname.strip("[]"), parts.port or 80) == (own[0], own[1] or 80)

    def served(self) -> str:
        """The names this server answers to, for messages."""
        names = ", ".join(f"[{n}]" if ":" in n else n for n in sorted(self.own_names))
        where = f" on port {self.port}" if self.port else ""
        return f"{names}{' or any IP address' if self.network else ''}{where}"


def _is_address(name: str) -> bool:
    """An IP address a client can connect to (0.0.0.0 and :: are not: a browser sending them
    reaches this computer from any page, the "0.0.0.0 day" route to local servers)."""
    try:
        return not ipaddress.ip_address(name).is_unspecified
    except ValueError:
        return False


def _shown(value: str) -> str:
    return value if len(value) <= _SHOWN else value[:_SHOWN] + "…"


def _allow(option: tuple[str, str], entry: str) -> str:
    """How to allow `entry`, on the command line and in the app."""
    return f"start the server with {option[0]} {entry} (in the app: Settings > Server > {option[1]}: {entry})"


class RequestGuard:
    """The ASGI middleware (see the module docstring); it wraps the API-key check."""

    def __init__(self, app: ASGIApp, policy: AccessPolicy) -> None:
        self.app = app
        self.policy = policy

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers: dict[bytes, list[str]] = {}
        for key, value in scope["headers"]:
            headers.setdefault(key.lower(), []).append(value.decode("latin-1"))
        try:
            host = self._check_host(headers.get(b"host", []))
            origin = self._check_origin(headers.get(b"origin", []), host)
        except ApiError as error:
            await _refuse(error, send)
            return
        reply = send if origin is None or self._own(origin, host) else _with_cors(send, origin)
        if origin is not None and scope["method"] == "OPTIONS" and b"access-control-request-method" in headers:
            requested = headers.get(b"access-control-request-headers", [CORS_HEADERS])[0]
            await reply({"type": "http.response.start", "status": 204, "headers": [
                (b"access-control-allow-methods", CORS_METHODS.encode()),
                (b"access-control-allow-headers", requested.encode("latin-1")),
                (b"access-control-max-age", CORS_MAX_AGE.encode()), (b"content-length", b"0")]})
            await reply({"type": "http.response.body", "body": b""})
            return
        if scope["method"] == "POST":
            kinds = headers.get(b"content-type", [])
            media = kinds[0].split(";", 1)[0].strip().lower() if len(kinds) == 1 else ""
            if media != "application/json":
                got = "none" if not kinds else _shown(", ".join(kinds))
                await _refuse(ApiError(415, f"POST requests must send 'Content-Type: application/json' (got {got}). "
                                            "Other content types are refused: a web page can send them without the "
                                            "browser asking this server first.", "invalid_request_error",
                                       "unsupported_media_type"), reply)
                return
        await self.app(scope, receive, reply)

    def _own(self, origin: str, host: str | None) -> bool:
        return origin not in self.policy.allowed_origins and "*" not in self.policy.allowed_origins \
            and self.policy.origin_allowed(origin, host)

    def _check_host(self, values: list[str]) -> str | None:
        """The Host header when it names this server; None when there is none (HTTP/1.0 tools:
        a browser always sends one)."""
        if not values:
            return None
        shown = _shown(", ".join(values))
        parsed = parse_host(values[0]) if len(values) == 1 else None
        if parsed is None or not self.policy.host_allowed(*parsed):
            entry = (f"[{parsed[0]}]" if ":" in parsed[0] else parsed[0]) if parsed else "NAME"
            raise ApiError(403, f"The Host header '{shown}' does not name this server, which answers to "
                                f"{self.policy.served()}. Web pages that point their own name at this computer "
                                "(DNS rebinding) are refused this way. If you reach the server by this name (a "
                                f"reverse proxy, a DNS name on your network), {_allow(HOSTS_OPTION, entry)}.",
                           "invalid_request_error", "host_not_allowed")
        return values[0]

    def _check_origin(self, values: list[str], host: str | None) -> str | None:
        if not values:
            return None
        origin = normalise_origin(values[0]) if len(values) == 1 else None
        if origin is not None and self.policy.origin_allowed(origin, host):
            return origin
        shown = _shown(", ".join(values))
        who = ("a page without an origin (Origin: null: a local file, a sandboxed frame or a redirect)"
               if origin == "null" else f"the web page at {shown}")
        entry = origin or "SCHEME://HOST:PORT"
        raise ApiError(403, f"Requests from {who} are refused: a page open in a browser must not use this server "
                            f"unless you allow it. To let it use the API, {_allow(ORIGINS_OPTION, entry)}.",
                       "invalid_request_error", "origin_not_allowed")


def _with_cors(send: Send, origin: str) -> Send:
    async def reply(message: Message) -> None:
        if message["type"] == "http.response.start":
            message = {**message, "headers": [*message.get("headers", []),
                                              (b"access-control-allow-origin", origin.encode("latin-1")),
                                              (b"access-control-expose-headers", b"Retry-After"),
                                              (b"vary", b"Origin")]}
        await send(message)

    return reply


async def _refuse(error: ApiError, send: Send) -> None:
    """An error answered before the app runs (the request body is never read)."""
    body = json.dumps(error.body()).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
               (b"connection", b"close")]
    await send({"type": "http.response.start", "status": error.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
