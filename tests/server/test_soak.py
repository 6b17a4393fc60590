"""Soak and fault phases at CI size against a real server (the tiny model): many WS and SSE streams
with cancels, disconnects, bad frames and slow readers; KV exhaustion; an injected engine fault.
Full size: `python bench/soak.py --full` (docs/soak.md)."""
from __future__ import annotations

import asyncio

import pytest

from tests.server.harness import ServerThread, engine_factory
from tests.server.soak import (
    FAULT_SERVER,
    KV_SERVER,
    STREAMS_SERVER,
    StreamLoad,
    phase_fault,
    phase_kv_exhaustion,
    phase_streams,
)


@pytest.fixture(scope="module")
def make_server(tiny_chat_dir):
    servers = []

    def make(config: tuple[dict, dict]) -> ServerThread:
        engine_args, settings = config
        factory = engine_factory(tiny_chat_dir, in_process=True, dtype="float32", device="cpu", **engine_args)
        servers.append(ServerThread(factory, "tiny", **settings))
        return servers[-1]

    yield make
    for s in servers:
        s.stop()


def _assert_clean(result) -> None:
    assert not result.problems, f"{result.name}: {result.counts}\n" + "\n".join(result.problems)


def test_streams_cancels_bad_frames_slow_readers(make_server):
    server = make_server(STREAMS_SERVER)
    result = asyncio.run(phase_streams(server, StreamLoad(num_ws=60, num_sse=60, seed=0)))
    _assert_clean(result)
    counts = result.counts
    assert sum(v for k, v in counts.items() if k.startswith("ws:cancel:cancelled")) >= 1, counts
    assert sum(v for k, v in counts.items() if ":disconnect:disconnected" in k) >= 1, counts
    assert counts.get("ws:slow:incomplete") == 2, counts


def test_kv_exhaustion_preempts_and_every_request_ends(make_server):
    server = make_server(KV_SERVER)
    result = asyncio.run(phase_kv_exhaustion(server))
    _assert_clean(result)
    assert result.extra["num_preemptions"] > 0


def test_engine_fault_fails_only_its_request(make_server):
    server = make_server(FAULT_SERVER)
    _assert_clean(asyncio.run(phase_fault(server)))
