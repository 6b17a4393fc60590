"""A WebSocket client that stops reading: its session is closed after ws_send_timeout, its responses
are cancelled and their KV freed, and nobody else waits for it (the engine never stalls)."""
from __future__ import annotations

import asyncio
import json
import socket
import time

import pytest
import websockets

from specserve.client import Client
from tests.server.conftest import TINY_ENGINE
from tests.server.harness import ServerThread, engine_factory

SEND_TIMEOUT = 1.0
NUM_RESPONSES = 64


@pytest.fixture(scope="module")
def impatient_server(tiny_chat_dir):
    engine_args = TINY_ENGINE | dict(num_kv_blocks=1200)  # every response runs at once: output comes fast
    server = ServerThread(engine_factory(tiny_chat_dir, **engine_args), "tiny", ws_send_timeout=SEND_TIMEOUT)
    # small kernel send buffers (accepted sockets inherit them from the listening one), as on a slow
    # link: otherwise loopback buffers megabytes before a send has to wait
    for listener in server.server.servers:
        for sock in listener.sockets:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    yield server
    server.stop()


def test_a_client_that_stops_reading_is_dropped_without_stalling_others(impatient_server):
    server = impatient_server

    async def stalled_client() -> float:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # a small window: the server's sends back up
        sock.connect(("127.0.0.1", server.port))
        async with websockets.connect(server.ws, sock=sock, max_queue=1) as ws:
            await ws.recv()  # session.created; from now on this client reads nothing
            for i in range(NUM_RESPONSES):
                await ws.send(json.dumps({"type": "response.create", "event_id": f"e{i}", "response": {
                    "prompt": [5 + i, 6, 7], "max_output_tokens": 240, "ignore_eos": True}}))
            t0 = time.monotonic()
            # meanwhile another client is served as usual
            with Client(server.ws) as other:
                done = await asyncio.to_thread(other.generate, [9, 10], max_output_tokens=20, ignore_eos=True)
            assert done.status == "incomplete" and done.usage.output_tokens == 20  # length
            deadline = t0 + 30
            while time.monotonic() < deadline:
                s = server.stats()
                if s["num_requests_running"] == s["num_requests_waiting"] == s["num_used_blocks"] == 0:
                    return time.monotonic() - t0
                await asyncio.sleep(0.05)
            raise AssertionError(f"the stalled client's requests still hold the engine: {server.stats()}")

    freed_after = asyncio.run(stalled_client())
    cancelled = server.get("/metrics").text
    assert freed_after < 15
    # its responses were cancelled, not run to the end
    line = next(x for x in cancelled.splitlines() if x.startswith("specserve:request_cancelled_total"))
    assert float(line.split()[-1]) >= 1
