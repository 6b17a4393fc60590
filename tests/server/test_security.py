"""API keys on HTTP and WebSocket, Origin checks, open routes."""
from __future__ import annotations

import asyncio
import json

import httpx
import pytest
import websockets
from websockets.exceptions import InvalidStatus

from specserve.client import Client, SpecserveError
from specserve.server.security import origin_allowed
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
    assert origin_allowed(None, "h:1", None)  # non-browser clients send no Origin
    assert origin_allowed("http://h:1", "h:1", allowed)  # same host always
    assert origin_allowed("https://chat.example.com", "h:1", allowed)
    # a list replaces the localhost default
    assert not origin_allowed("http://localhost:3000", "h:1", allowed)
    assert origin_allowed("http://localhost:3000", "h:1", None)
    assert origin_allowed("https://anything.example", "h:1", ["*"])
    assert not origin_allowed("https://chat.example.com.evil.io", "h:1", allowed)
