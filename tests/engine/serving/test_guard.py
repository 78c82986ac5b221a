"""What a web page in the user's browser can send to a server on this computer, as raw HTTP to a
real server on 127.0.0.1: foreign Host headers (DNS rebinding), foreign and null Origins, and
POSTs that are not application/json (forms, text/plain) are refused in OpenAI's error shape,
naming the option that allows them, before any generation; what a local client sends works;
origins and hosts the user allows work, with CORS for the browser."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from scripted import CHAT, JSON, ScriptedBackend, raw, start_server
from serve_process import API_KEY, ServeProcess

from engine.cli.main import main
from engine.serving.guard import AccessPolicy, check_allowed_hosts, machine_names
from engine.serving.server import Server, ServeSettings


@pytest.fixture(scope="module")
def backend() -> ScriptedBackend:
    return ScriptedBackend()


@pytest.fixture(scope="module")
def server(backend: ScriptedBackend) -> Iterator[Server]:
    served = start_server(backend)
    yield served
    served.stop()


def refused(reply, status: int, code: str) -> str:  # type: ignore[no-untyped-def]
    assert reply.status == status, reply
    error = reply.error()
    assert error["code"] == code and error["type"] == "invalid_request_error"
    assert "access-control-allow-origin" not in reply.headers
    return str(error["message"])


@pytest.mark.parametrize("content_type", [
    "text/plain", "text/plain;charset=UTF-8", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x",
    None, "", "application/jsonp", "json", "application/json-patch+json",
])
def test_a_post_that_is_not_json_is_415(server: Server, backend: ScriptedBackend, content_type: str | None) -> None:
    before = backend.calls
    headers = [] if content_type is None else [("Content-Type", content_type)]
    for path in ("/v1/chat/completions", "/v1/completions"):
        reply = raw(server.port, "POST", path, CHAT, headers)
        message = refused(reply, 415, "unsupported_media_type")
        assert "Content-Type: application/json" in message
    form = raw(server.port, "POST", "/v1/chat/completions", "model=x&messages=hi",
               [("Content-Type", "application/x-www-form-urlencoded"), ("Origin", f"http://127.0.0.1:{server.port}")])
    refused(form, 415, "unsupported_media_type")
    assert backend.calls == before  # no generation ran


@pytest.mark.parametrize("origin, shown", [
    ("null", "--allowed-origins null"),
    ("https://evil.example", "--allowed-origins https://evil.example"),
    ("http://localhost:3000", "--allowed-origins http://localhost:3000"),  # another local app: a page too
    ("http://127.0.0.1", "--allowed-origins http://127.0.0.1"),  # this address, another port
    ("HTTPS://EVIL.example:443", "--allowed-origins https://evil.example"),
    ("chrome-extension://abcdef", "--allowed-origins chrome-extension://abcdef"),
    ("not an origin", "--allowed-origins"),
])
def test_a_foreign_origin_is_403(server: Server, backend: ScriptedBackend, origin: str, shown: str) -> None:
    before = backend.calls
    reply = raw(server.port, "POST", "/v1/chat/completions", CHAT, [*JSON, ("Origin", origin)])
    message = refused(reply, 403, "origin_not_allowed")
    assert shown in message and "Settings > Server" in message
    # a script's GET from the page (it could read the model list) and a preflight: refused alike
    refused(raw(server.port, "GET", "/v1/models", headers=[("Origin", origin)]), 403, "origin_not_allowed")
    preflight = raw(server.port, "OPTIONS", "/v1/chat/completions",
                    headers=[("Origin", origin), ("Access-Control-Request-Method", "POST")])
    refused(preflight, 403, "origin_not_allowed")
    assert backend.calls == before


@pytest.mark.parametrize("host", [
    "evil.example", "evil.example:{port}", "127.0.0.1.evil.example", "localhost.evil.example:{port}",
    "127.0.0.1:{other}", "localhost:{other}", "[::1]:{other}", "192.168.1.20:{port}", "10.0.0.1", "", " ",
    "127.0.0.1:{port}@evil.example", "evil.example, 127.0.0.1:{port}", "127.0.0.1:99999", "[::1", "*",
    "0.0.0.0:{port}", "[::]:{port}", "127.1:{port}", "2130706433:{port}", "localhost..:{port}",
])
def test_a_host_that_is_not_this_server_is_403(server: Server, backend: ScriptedBackend, host: str) -> None:
    before = backend.calls
    value = host.format(port=server.port, other=server.port + 1)
    for method, path in (("POST", "/v1/chat/completions"), ("GET", "/v1/models"), ("GET", "/health")):
        reply = raw(server.port, method, path, CHAT if method == "POST" else None, JSON, host=value)
        message = refused(reply, 403, "host_not_allowed")
        assert "--allowed-hosts" in message and "rebinding" in message
    assert backend.calls == before


def test_two_host_headers_are_403(server: Server) -> None:
    reply = raw(server.port, "GET", "/v1/models", headers=[("Host", "evil.example")])  # beside 127.0.0.1:PORT
    assert reply.status in (400, 403)  # the HTTP parser may refuse it first


@pytest.mark.parametrize("host", ["127.0.0.1:{port}", "localhost", "localhost:{port}", "127.0.0.1", "[::1]:{port}",
                                  "LOCALHOST:{port}", "localhost.:{port}"])
@pytest.mark.parametrize("content_type", ["application/json", "application/json; charset=utf-8",
                                          "Application/JSON;charset=UTF-8"])
def test_what_a_local_client_sends_is_answered(server: Server, backend: ScriptedBackend, host: str | None,
                                               content_type: str) -> None:
    before = backend.calls
    value = None if host is None else host.format(port=server.port)
    reply = raw(server.port, "POST", "/v1/chat/completions", CHAT, [("Content-Type", content_type)], host=value)
    assert reply.status == 200, reply.body
    assert reply.json()["choices"][0]["message"]["content"] == "hello world" and backend.calls == before + 1
    assert "access-control-allow-origin" not in reply.headers  # no CORS by default
    own = raw(server.port, "POST", "/v1/completions", {"prompt": "x"},  # the server's own origin is not foreign
              [*JSON, ("Origin", f"http://127.0.0.1:{server.port}")])
    assert own.status == 200 and "access-control-allow-origin" not in own.headers


def test_allowed_hosts_and_origins_work_from_a_browser(backend: ScriptedBackend) -> None:
    server = start_server(backend, allowed_hosts=("gpu-box.lan", "*.example.com", "proxy:8443"),
                          allowed_origins=("http://localhost:3000", "null"))
    try:
        port = server.port
        for host in ("gpu-box.lan", f"gpu-box.lan:{port}", "GPU-BOX.LAN:1", "api.example.com", "proxy:8443"):
            assert raw(port, "GET", "/v1/models", host=host).status == 200, host
        for host in ("proxy:8444", "example.com.evil", "evil.example"):
            refused(raw(port, "GET", "/v1/models", host=host), 403, "host_not_allowed")

        app = ("Origin", "http://localhost:3000")
        preflight = raw(port, "OPTIONS", "/v1/chat/completions", headers=[
            app, ("Access-Control-Request-Method", "POST"), ("Access-Control-Request-Headers", "authorization,content-type")])
        assert preflight.status == 204 and preflight.headers["access-control-allow-origin"] == "http://localhost:3000"
        assert "POST" in preflight.headers["access-control-allow-methods"]
        assert preflight.headers["access-control-allow-headers"] == "authorization,content-type"
        reply = raw(port, "POST", "/v1/chat/completions", CHAT, [*JSON, app])
        assert reply.status == 200 and reply.headers["access-control-allow-origin"] == "http://localhost:3000"
        assert "origin" in reply.headers["vary"].lower()
        streamed = raw(port, "POST", "/v1/chat/completions", {**CHAT, "stream": True}, [*JSON, app])
        assert streamed.headers["access-control-allow-origin"] == "http://localhost:3000"
        assert streamed.body.endswith(b"data: [DONE]\n\n")
        # errors reach the page too (it can show them), and a form is still no JSON
        wrong = raw(port, "POST", "/v1/chat/completions", {**CHAT, "model": "other"}, [*JSON, app])
        assert wrong.status == 404 and wrong.headers["access-control-allow-origin"] == "http://localhost:3000"
        form = raw(port, "POST", "/v1/chat/completions", "a=b", [("Content-Type", "text/plain"), app])
        assert form.status == 415 and form.headers["access-control-allow-origin"] == "http://localhost:3000"
        assert raw(port, "POST", "/v1/completions", {"prompt": "x"}, [*JSON, ("Origin", "null")]).status == 200
        refused(raw(port, "POST", "/v1/completions", {"prompt": "x"}, [*JSON, ("Origin", "http://localhost:3001")]),
                403, "origin_not_allowed")
    finally:
        server.stop()


def test_with_a_key_the_guard_comes_first_and_preflights_need_no_key(backend: ScriptedBackend) -> None:
    server = start_server(backend, api_key="sk-k", allowed_origins=("https://chat.example",))
    try:
        before = backend.calls
        refused(raw(server.port, "POST", "/v1/chat/completions", CHAT, [*JSON, ("Authorization", "Bearer sk-k")],
                    host="evil.example"), 403, "host_not_allowed")
        preflight = raw(server.port, "OPTIONS", "/v1/chat/completions", headers=[
            ("Origin", "https://chat.example"), ("Access-Control-Request-Method", "POST")])
        assert preflight.status == 204
        no_key = raw(server.port, "POST", "/v1/chat/completions", CHAT, [*JSON, ("Origin", "https://chat.example")])
        assert no_key.status == 401 and no_key.headers["access-control-allow-origin"] == "https://chat.example"
        assert backend.calls == before
    finally:
        server.stop()


def test_on_the_network_addresses_and_this_computers_names_are_accepted() -> None:
    policy = AccessPolicy("0.0.0.0", 8765, check_allowed_hosts(["models.corp"]))
    for name, port in (("192.168.1.20", 8765), ("10.1.2.3", None), ("fe80::1", 8765), ("localhost", 8765),
                       ("models.corp", 1234), *((n, 8765) for n in machine_names())):
        assert policy.host_allowed(name, port), name
    for name, port in (("evil.example", 8765), ("192.168.1.20", 8080), ("evil.example", None), ("0.0.0.0", 8765),
                       ("::", 8765)):
        assert not policy.host_allowed(name, port), name
    lan = AccessPolicy("192.168.1.20", 8765)
    assert lan.host_allowed("192.168.1.20", 8765) and not lan.host_allowed("attacker.example", 8765)
    local = AccessPolicy("127.0.0.1", 8765)
    assert not local.host_allowed("192.168.1.20", 8765) and not any(
        local.host_allowed(n, 8765) for n in machine_names() - {"localhost"})


@pytest.mark.parametrize("option, value", [("--allowed-origins", "localhost:3000"),
                                           ("--allowed-origins", "https://a.example/path"),
                                           ("--allowed-hosts", "evil/example"), ("--allowed-hosts", "http://x")])
def test_malformed_allowed_entries_are_usage_errors(capsys: pytest.CaptureFixture[str], option: str,
                                                    value: str) -> None:
    rc = main(["serve", "--port", "0", option, value])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("error: ") and option in err and len(err.strip().splitlines()) == 1
    with pytest.raises(Exception) as exc:
        ServeSettings(**{option.removeprefix("--").replace("-", "_"): (value,)})  # type: ignore[arg-type]
    assert option in str(exc.value)


def test_specchat_serve_refuses_a_rebinding_page_and_a_form(tiny_server: ServeProcess) -> None:
    """The CLI's server, keyed or not, gets the same guard: nothing reaches the engine."""
    port = int(tiny_server.url.rsplit(":", 1)[1].split("/")[0])
    start, seen = len(tiny_server.lines), len(tiny_server.request_lines())
    auth = [("Authorization", f"Bearer {API_KEY}")]
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    refused(raw(port, "POST", "/v1/chat/completions", body, [*JSON, *auth], host="evil.example"),
            403, "host_not_allowed")
    refused(raw(port, "POST", "/v1/chat/completions", body, [("Content-Type", "text/plain"), *auth]),
            415, "unsupported_media_type")
    refused(raw(port, "POST", "/v1/chat/completions", body, [*JSON, *auth, ("Origin", "null")]),
            403, "origin_not_allowed")
    ok = raw(port, "POST", "/v1/chat/completions", body, [*JSON, *auth], host=f"localhost:{port}")
    assert ok.status == 200 and ok.json()["usage"]["completion_tokens"] == 2
    tiny_server.wait_for(lambda line: line.startswith("request ") and "+ 2 tokens" in line, start=start)
    assert len(tiny_server.request_lines()) == seen + 1  # only the allowed one ran

