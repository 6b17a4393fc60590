"""API keys on HTTP and WebSocket, Origin checks, open routes."""
from __future__ import annotations

import asyncio
import json

import httpx
import pytest
import websockets
from websockets.exceptions import InvalidStatus

from specserve.client import Client, SpecserveError
from specserve.server.security import allowed_host_names, host_allowed, origin_allowed
from tests.server.conftest import TINY_ENGINE
from tests.server.harness import ServerThread, engine_factory

KEY = "sk-test-123"


@pytest.fixture(scope="module")
def keyed_server(tiny_chat_dir):
    server = ServerThread(engine_factory(tiny_chat_dir, **TINY_ENGINE), "tiny", api_key=KEY)
    yield server
    server.stop()


def test_http_needs_the_bearer_key_on_v1_only(keyed_server):
    url = keyed_server.http
    missing = httpx.get(url + "/v1/models")
    wrong = httpx.get(url + "/v1/models", headers={"Authorization": "Bearer nope"})
    right = httpx.get(url + "/v1/models", headers={"Authorization": f"Bearer {KEY}"})
    post = httpx.post(url + "/v1/completions", json={"prompt": [5], "max_tokens": 1})
    assert missing.status_code == wrong.status_code == post.status_code == 401
    assert missing.json()["error"]["type"] == "authentication_error"
    assert wrong.json()["error"] == {"message": "incorrect API key", "type": "authentication_error",
                                     "param": None, "code": "invalid_api_key"}
    assert right.status_code == 200 and right.json()["data"][0]["id"] == "tiny"
    for open_path in ("/health", "/metrics", "/version", "/"):
        assert httpx.get(url + open_path).status_code == 200, open_path


def test_websocket_key_in_header_or_first_message(keyed_server):
    async def main():
        # no key at all: an error event says why, then the server closes the socket (1008)
        async with websockets.connect(keyed_server.ws) as ws:
            await ws.send(json.dumps({"type": "response.create", "response": {"prompt": "x"}}))
            refused = json.loads(await ws.recv())
            await ws.wait_closed()
            close_code = ws.close_code
        # wrong key in the header: the handshake itself is refused with 401
        with pytest.raises(InvalidStatus) as bad_header:
            await websockets.connect(keyed_server.ws, additional_headers={"Authorization": "Bearer nope"})
        # right key in the header
        auth = {"Authorization": f"Bearer {KEY}"}
        async with websockets.connect(keyed_server.ws, additional_headers=auth) as ws:
            by_header = json.loads(await ws.recv())
        # right key in a first message (what browsers do)
        async with websockets.connect(keyed_server.ws) as ws:
            await ws.send(json.dumps({"type": "session.auth", "api_key": KEY}))
            by_message = json.loads(await ws.recv())
        # wrong key in a first message
        async with websockets.connect(keyed_server.ws) as ws:
            await ws.send(json.dumps({"type": "session.auth", "api_key": "nope"}))
            wrong_message = json.loads(await ws.recv())
        return refused, close_code, bad_header.value, by_header, by_message, wrong_message

    refused, close_code, bad_header, by_header, by_message, wrong_message = asyncio.run(main())
    assert refused["type"] == "error" and refused["error"]["code"] == "invalid_api_key"
    assert close_code == 1008
    assert bad_header.response.status_code == 401
    assert by_header["type"] == by_message["type"] == "session.created"
    assert wrong_message["error"]["code"] == "invalid_api_key"


def test_client_reports_key_problems(keyed_server):
    with pytest.raises(SpecserveError) as no_key:  # the server waits for a session.auth that never comes
        Client(keyed_server.ws, connect_timeout=0.5)
    with pytest.raises(SpecserveError) as bad_key:
        Client(keyed_server.ws, api_key="nope")
    assert no_key.value.code == "timeout" and "API key" in no_key.value.message
    assert bad_key.value.code == "invalid_api_key"
    for auth_in_message in (False, True):
        with Client(keyed_server.ws, api_key=KEY, auth_in_message=auth_in_message) as client:
            assert client.generate([5, 6], max_output_tokens=2, ignore_eos=True).usage.output_tokens == 2


def test_websocket_origins(keyed_server):
    port = keyed_server.port
    headers = {"Authorization": f"Bearer {KEY}"}

    async def try_origin(origin: str) -> int:
        try:
            async with websockets.connect(keyed_server.ws, origin=origin, additional_headers=headers) as ws:
                await ws.recv()
                return 101
        except InvalidStatus as e:
            return e.response.status_code

    async def main():
        return [await try_origin(o) for o in (f"http://127.0.0.1:{port}", "http://localhost:5173",
                                              "https://evil.example.com", "null")]

    same_host, localhost, evil, null = asyncio.run(main())
    assert same_host == localhost == 101
    assert evil == null == 403


def test_origin_rules():
    allowed = ["https://chat.example.com"]
    hosts = allowed_host_names("127.0.0.1", ["h"])
    assert origin_allowed(None, hosts, None)  # non-browser clients send no Origin
    assert origin_allowed("http://h:1", hosts, allowed, server_port=1)  # the server's own pages
    assert not origin_allowed("http://h:2", hosts, allowed, server_port=1)  # another port is another site
    assert origin_allowed("https://chat.example.com", hosts, allowed, server_port=1)
    # a list replaces the localhost default
    assert not origin_allowed("http://localhost:3000", hosts, allowed, server_port=1)
    assert origin_allowed("http://localhost:3000", hosts, None, server_port=1)
    assert origin_allowed("https://anything.example", hosts, ["*"])
    assert not origin_allowed("https://chat.example.com.evil.io", hosts, allowed)
    # a rebinding page's own name is not the server's, whatever Host header it sends
    assert not origin_allowed("http://rebind.attacker.example:1", hosts, None, server_port=1)


def test_host_rules():
    hosts = allowed_host_names("127.0.0.1")
    for ok in ("127.0.0.1:8000", "localhost:8000", "localhost", "[::1]:8000", None):
        assert host_allowed(ok, hosts), ok
    for bad in ("rebind.attacker.example:8000", "127.0.0.1.nip.io:8000", "", "evil"):
        assert not host_allowed(bad or "x", hosts), bad
    assert host_allowed("chat.internal:8000", allowed_host_names("0.0.0.0", ["chat.internal"]))
    assert host_allowed("10.1.2.3:8000", allowed_host_names("10.1.2.3"))  # the bound address
    assert host_allowed("anything:1", allowed_host_names("127.0.0.1", ["*"]))


def _rebinding_attempts(server: ServerThread, headers: dict[str, str]) -> tuple[int, int, int]:
    """HTTP and WebSocket requests from a page whose name rebinds to 127.0.0.1: the page's name is in
    Host (and Origin), as a browser would send it."""
    name = f"rebind.attacker.example:{server.port}"
    http = httpx.post(server.http + "/v1/completions", json={"prompt": [5], "max_tokens": 1},
                      headers={"Host": name, **headers})
    models = httpx.get(server.http + "/v1/models", headers={"Host": name, **headers})

    async def socket() -> int:
        try:
            # the URI names the page's host (so Host says it); the connection goes to 127.0.0.1
            async with websockets.connect(f"ws://{name}/v1/ws", host="127.0.0.1", port=server.port,
                                          origin=f"http://{name}", additional_headers=headers) as ws:
                await ws.recv()
                return 101
        except InvalidStatus as e:
            return e.response.status_code

    return http.status_code, models.status_code, asyncio.run(socket())


def test_dns_rebinding_is_refused_with_and_without_a_key(keyed_server, tiny_chat_dir):
    assert _rebinding_attempts(keyed_server, {"Authorization": f"Bearer {KEY}"}) == (400, 400, 400)
    keyless = ServerThread(engine_factory(tiny_chat_dir, **TINY_ENGINE), "tiny")
    try:
        assert _rebinding_attempts(keyless, {}) == (400, 400, 400)
        body = httpx.get(keyless.http + "/v1/models", headers={"Host": "rebind.attacker.example"}).json()
        assert body["error"]["code"] == "host_not_allowed"
        # the same requests under the server's own name go through
        ok = httpx.post(keyless.http + "/v1/completions", json={"prompt": [5], "max_tokens": 1})
        assert ok.status_code == 200
    finally:
        keyless.stop()
    opened = ServerThread(engine_factory(tiny_chat_dir, **TINY_ENGINE), "tiny",
                          allowed_hosts=["rebind.attacker.example"])
    try:  # --allowed-hosts lets a name in (the operator's choice); its pages are then the server's own
        status = _rebinding_attempts(opened, {})
        assert status == (200, 200, 101)
    finally:
        opened.stop()
