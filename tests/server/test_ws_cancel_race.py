"""A `response.cancel` that lands while the response's `response.done` waits for the socket (other
responses are sending) must not lose the done: every response ends with exactly one done."""
from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

from specserve.server.settings import ServerSettings
from specserve.server.ws import Session


class _GatedSocket:
    """send_text waits until the gate opens, like a socket whose buffer is full for a moment."""

    def __init__(self) -> None:
        self.gate = asyncio.Event()
        self.sent: list[dict] = []

    async def send_text(self, data: str) -> None:
        await self.gate.wait()
        self.sent.append(json.loads(data))


class _FinishedStream:
    """A request that already finished in the engine: no more deltas, its done is due."""

    request_id = "resp-1"
    prompt_ids = [1, 2]
    final = None
    outcome = "completed"
    error = None
    num_cached_tokens = 0

    async def deltas(self):
        return
        yield

    def ttft_seconds(self):
        return None

    def decode_seconds_per_token(self):
        return None

    def spec_counts(self):
        return 0, 0, 0


def test_a_cancel_during_the_done_send_does_not_lose_the_done():
    async def main():
        ws = _GatedSocket()
        state = SimpleNamespace(settings=ServerSettings(), new_id=lambda prefix: f"{prefix}-x")
        session = Session(ws, state)
        task = asyncio.create_task(session._respond(_FinishedStream(), None))
        await asyncio.sleep(0.05)  # the done waits at the gate
        task.cancel()  # the client's response.cancel arrives now
        await asyncio.sleep(0.05)
        ws.gate.set()
        await asyncio.wait_for(task, 5)
        return ws.sent

    sent = asyncio.run(main())
    assert [e["type"] for e in sent] == ["response.done"]
    assert sent[0]["response"]["id"] == "resp-1"


def test_every_cancel_of_a_streaming_response_takes_effect(tiny_chat_dir):
    """A `response.cancel` sent while deltas stream stops the response every time (a cancel that lands
    as a frame's send completes used to be swallowed by asyncio.wait_for before Python 3.12, and the
    response then ran to its end)."""
    import time

    from specserve.client import Client
    from tests.server.harness import ServerThread, engine_factory
    from tests.server.test_health_metrics import _metrics

    server = ServerThread(engine_factory(tiny_chat_dir, dtype="float32", device="cpu", num_kv_blocks=64,
                                         max_model_len=512), "tiny")
    name = "specserve:request_cancelled_total"
    try:
        with Client(server.ws) as client:
            for i in range(10):
                before = _metrics(server).get(name, 0.0)
                stream = client.create(messages=[{"role": "user", "content": "hello"}], max_output_tokens=490,
                                       ignore_eos=True)
                for n, _ in enumerate(stream):
                    if n == 20:
                        break
                stream.close()
                deadline = time.monotonic() + 3
                while _metrics(server).get(name, 0.0) < before + 1:
                    assert time.monotonic() < deadline, f"cancel {i} did not stop the response"
                    time.sleep(0.02)
        assert server.wait_blocks(0)["num_used_blocks"] == 0
    finally:
        server.stop()
