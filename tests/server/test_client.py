"""specserve.client (AsyncClient, Client) against a real server."""
from __future__ import annotations

import asyncio
import json
import socket
import time

import pytest

from specserve.client import AsyncClient, Client, OutputTextDelta, ResponseDone, SpecserveError


def test_sync_client_streams_typed_events(tiny_server):
    with Client(tiny_server.ws) as client:
        assert client.session.model == "tiny"
        with client.create("abc", max_output_tokens=6, ignore_eos=True, temperature=0) as stream:
            events = list(stream)
        assert all(isinstance(e, OutputTextDelta) for e in events[:-1])
        assert isinstance(events[-1], ResponseDone)
        assert stream.done.status == "incomplete" and stream.done.usage.output_tokens == 6
        assert stream.text == stream.done.output[0].text
        done = client.generate([5, 6, 7], max_output_tokens=4, ignore_eos=True, temperature=0)
        assert done.usage.output_tokens == 4 and done.usage.input_tokens == 3


def test_sync_client_cancel_and_early_exit_free_blocks(tiny_server):
    baseline = tiny_server.wait_blocks(0)["num_used_blocks"]
    with Client(tiny_server.ws) as client:
        stream = client.create([5, 6, 7], max_output_tokens=150, ignore_eos=True)
        first = next(stream)
        assert isinstance(first, OutputTextDelta)
        stream.cancel()
        rest = list(stream)
        assert rest[-1].response.status == "cancelled"
        assert tiny_server.wait_blocks(baseline)["num_used_blocks"] == baseline

        with client.create([8, 9], max_output_tokens=150, ignore_eos=True) as stream:
            next(stream)
            next(stream)  # leaving the block early cancels the response on the server
        assert tiny_server.wait_blocks(baseline)["num_used_blocks"] == baseline
        # the socket is still good afterwards
        assert client.generate("ok", max_output_tokens=2, ignore_eos=True).usage.output_tokens == 2


def test_async_client_concurrent_streams_and_errors(tiny_server):
    async def main():
        async with AsyncClient(tiny_server.ws) as client:
            streams = [await client.create([5 + i, 6], max_output_tokens=5, ignore_eos=True, temperature=0)
                       for i in range(3)]
            finals = await asyncio.gather(*(s.final() for s in streams))
            with pytest.raises(SpecserveError) as too_long:
                await client.create([5] * 300)
            with pytest.raises(SpecserveError) as bad_param:
                await client.create("x", temperature=-1.0)
            ok = await client.generate("still fine", max_output_tokens=2, ignore_eos=True)
            return finals, too_long.value, bad_param.value, ok

    finals, too_long, bad_param, ok = asyncio.run(main())
    assert [f.usage.output_tokens for f in finals] == [5, 5, 5]
    assert too_long.code == "context_length_exceeded" and "256" in too_long.message
    assert bad_param.code == "invalid_event" and "temperature" in bad_param.message
    assert ok.usage.output_tokens == 2


def test_connect_errors_and_timeouts(tiny_server):
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(SpecserveError) as refused:
        Client(f"ws://127.0.0.1:{port}/v1/ws", connect_timeout=2)
    assert refused.value.code == "connection_failed"


def test_read_timeout_when_the_server_goes_quiet():
    """A server that accepts a request and then never answers: the client's read timeout fires."""
    from websockets.asyncio.server import serve

    from specserve.server.protocol import ResponseCreated, ResponseInfo, SessionCreated

    async def quiet(ws):
        await ws.send(SessionCreated(session_id="s", model="m", max_model_len=8, max_frame_size=1024,
                                     version="0").model_dump_json())
        async for raw in ws:
            event_id = json.loads(raw).get("event_id")
            created = ResponseCreated(event_id=event_id, response=ResponseInfo(id="r1"))
            await ws.send(created.model_dump_json())

    async def main():
        async with serve(quiet, "127.0.0.1", 0) as server:
            port = server.sockets[0].getsockname()[1]
            async with AsyncClient(f"ws://127.0.0.1:{port}", read_timeout=0.2) as client:
                stream = await client.create("hi")
                t0 = time.monotonic()
                with pytest.raises(SpecserveError) as err:
                    await stream.__anext__()
                return err.value, time.monotonic() - t0

    err, waited = asyncio.run(main())
    assert err.code == "timeout" and 0.15 < waited < 5


def _scripted_server(script):
    """A websockets server in a thread that runs `script(ws, event_id)` for each response.create."""
    import threading

    from websockets.asyncio.server import serve

    from specserve.server.protocol import SessionCreated

    async def handler(ws):
        await ws.send(SessionCreated(session_id="s", model="m", max_model_len=8, max_frame_size=1024,
                                     version="0").model_dump_json())
        async for raw in ws:
            event = json.loads(raw)
            if event["type"] == "response.create":
                await script(ws, event["event_id"])

    ready, box = threading.Event(), {}

    def run():
        async def main():
            async with serve(handler, "127.0.0.1", 0) as server:
                box["port"] = server.sockets[0].getsockname()[1]
                ready.set()
                await asyncio.Future()
        asyncio.run(main())

    threading.Thread(target=run, daemon=True).start()
    assert ready.wait(10)
    return f"ws://127.0.0.1:{box['port']}"


def test_sync_client_interrupted_wait_loses_no_event_and_a_dropped_socket_fails_waits_at_once():
    import _thread
    import threading

    from specserve.server.protocol import DoneResponse, ResponseCreated, ResponseInfo, Usage

    num_created = 0

    async def script(ws, event_id):
        nonlocal num_created
        num_created += 1
        rid = f"r{num_created}"
        await ws.send(ResponseCreated(event_id=event_id, response=ResponseInfo(id=rid)).model_dump_json())
        await asyncio.sleep(0.6)
        await ws.send(OutputTextDelta(response_id=rid, delta="late", token_ids=[5]).model_dump_json())
        if num_created == 1:
            usage = Usage(input_tokens=1, output_tokens=1, cached_tokens=0)
            await ws.send(ResponseDone(response=DoneResponse(id=rid, status="completed", usage=usage))
                          .model_dump_json())
        else:
            await asyncio.sleep(0.3)
            ws.transport.abort()  # the server "dies" mid-stream: no close frame

    with Client(_scripted_server(script)) as client:
        stream = client.create("hi")
        threading.Timer(0.1, _thread.interrupt_main).start()
        t0 = time.monotonic()
        with pytest.raises(KeyboardInterrupt):
            next(stream)  # Ctrl-C while waiting: the wait (and its coroutine) stops at once
        assert time.monotonic() - t0 < 0.5
        events = list(stream)  # the interrupted read took nothing: every event is still here
        assert [type(e) for e in events] == [OutputTextDelta, ResponseDone] and stream.text == "late"

        stream = client.create("again")
        next(stream)
        t0 = time.monotonic()
        with pytest.raises(SpecserveError) as err:
            list(stream)
        assert time.monotonic() - t0 < 3 and err.value.code == "connection_closed"
        assert "the server closed the connection" in err.value.message
        assert client.wait_closed(timeout=5) is not None


def test_chat_repl(tiny_server):
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "specserve.cli", "chat", "--url", tiny_server.ws, "--max-tokens", "5",
           "--temperature", "0", "--stats"]
    proc = subprocess.run(cmd, input="hello\n/reset\nagain\n/exit\n", capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "connected to tiny" in proc.stderr
    assert proc.stderr.count("[5 tokens, TTFT") == 2 and "incomplete" in proc.stderr
    assert len(proc.stdout.splitlines()) >= 2  # the two streamed replies
