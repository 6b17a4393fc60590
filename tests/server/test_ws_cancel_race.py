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
