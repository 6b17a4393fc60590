"""Phase 1: many WS and SSE streams at once, with cancels, disconnects, bad frames and slow readers."""
from __future__ import annotations

import asyncio
import json
import random
import time
from collections import Counter
from dataclasses import dataclass

import httpx

from tests.server.harness import ServerThread
from tests.server.soak.clients import WsConn, make_spec, sse_stream
from tests.server.soak.common import (
    EVENT_TIMEOUT_S,
    Outcome,
    PhaseResult,
    check_outcomes,
    check_server,
    count_outcomes,
)

# the phase's server (engine args besides the model; server settings)
STREAMS_SERVER = (dict(num_kv_blocks=256, max_model_len=256), dict(max_frame_size=16384))


@dataclass(slots=True)
class StreamLoad:
    num_ws: int = 60
    num_sse: int = 60
    cancel_frac: float = 0.3  # of WS streams cancelled / on sockets dropped; of SSE streams dropped
    min_tokens: int = 8
    max_tokens: int = 24
    streams_per_socket: int = 10
    per_socket_concurrency: int = 4
    sockets_at_once: int = 6
    sse_concurrency: int = 12
    bad_frame_prob: float = 0.1  # before each response.create on an ordinary socket
    slow_pause_s: float = 1.5
    seed: int = 0


async def _ws_socket(url: str, specs: list[dict], load: StreamLoad, rng: random.Random, drop: str | None,
                     outcomes: list[Outcome], problems: list[str], bad_sent: Counter) -> None:
    """One socket's share of the streams; `drop` ("close" / "abort") ends the socket mid-stream."""
    conn = await WsConn.open(url)
    concurrency = len(specs) if drop else load.per_socket_concurrency
    sem = asyncio.Semaphore(concurrency)
    want_cancel = load.cancel_frac / 2

    async def one(spec: dict) -> None:
        async with sem:
            if not drop and rng.random() < load.bad_frame_prob:
                await conn.send_bad(rng)
            plan = "disconnect" if drop else "cancel" if rng.random() < want_cancel else "full"
            outcomes.append(await conn.stream(spec, plan, rng))

    tasks = [asyncio.create_task(one(s)) for s in specs]
    if drop:
        target = max(1, sum(s["max_output_tokens"] * s.get("n", 1) for s in specs) // 3)
        while conn.num_tokens < target and not all(t.done() for t in tasks):
            await asyncio.sleep(0.005)
        await conn.close(abort=drop == "abort")
    await asyncio.gather(*tasks)
    if not drop:
        problems.extend(conn.bad_frame_problems())
        bad_sent.update(conn.bad_sent)
        await conn.close()


async def _slow_and_stalled(url: str, load: StreamLoad, rng: random.Random, outcomes: list[Outcome],
                            others_done: asyncio.Event) -> None:
    """A socket that stops reading for `slow_pause_s`, and one that never reads again (dropped once the
    other load has ended: the server must have served everyone else meanwhile)."""
    slow = await WsConn.open(url)
    stalled = await WsConn.open(url)
    stalled.reading.clear()
    specs = [make_spec(rng, load.max_tokens, load.max_tokens * 2, max_n=1) for _ in range(4)]
    for spec in specs[:2]:
        spec |= {"max_output_tokens": 200, "n": 4}
        await stalled.ws.send(json.dumps({"type": "response.create", "response": spec}))
    slow_runs = [slow.stream(s, "slow", rng, pause_s=load.slow_pause_s) for s in specs[2:]]
    outcomes.extend(await asyncio.gather(*slow_runs))
    await slow.close()
    await others_done.wait()
    await stalled.close(abort=True)


async def phase_streams(server: ServerThread, load: StreamLoad) -> PhaseResult:
    """N WS streams (many per socket, many sockets) and N SSE streams at once, with cancels,
    disconnects, bad frames and slow readers; then every response ended right and nothing leaked."""
    rng = random.Random(load.seed)
    result = PhaseResult("streams")
    t0 = time.perf_counter()
    outcomes: list[Outcome] = []
    problems: list[str] = []
    bad_sent: Counter = Counter()
    specs = [make_spec(rng, load.min_tokens, load.max_tokens) for _ in range(load.num_ws)]
    groups = [specs[i:i + load.streams_per_socket] for i in range(0, len(specs), load.streams_per_socket)]
    # half the disconnect share: whole sockets dropped mid-stream (the other half: response.cancel)
    drops = [rng.choice(("close", "abort")) if rng.random() < load.cancel_frac / 2 else None for _ in groups]
    others_done = asyncio.Event()
    side = asyncio.create_task(_slow_and_stalled(server.ws, load, rng, outcomes, others_done))

    async def ws_all() -> None:
        sem = asyncio.Semaphore(load.sockets_at_once)

        async def one(group, drop):
            async with sem:
                await _ws_socket(server.ws, group, load, random.Random(rng.random()), drop, outcomes, problems,
                                 bad_sent)
        await asyncio.gather(*(one(g, d) for g, d in zip(groups, drops)))

    async def sse_all() -> None:
        sem = asyncio.Semaphore(load.sse_concurrency)
        limits = httpx.Limits(max_connections=load.sse_concurrency)
        async with httpx.AsyncClient(timeout=EVENT_TIMEOUT_S, limits=limits) as client:
            async def one(spec):
                async with sem:
                    plan = "disconnect" if rng.random() < load.cancel_frac else "full"
                    outcomes.append(await sse_stream(client, server.http, spec, plan, rng, rng.random() < 0.5))
            await asyncio.gather(*(one(make_spec(rng, load.min_tokens, load.max_tokens))
                                   for _ in range(load.num_sse)))

    await asyncio.gather(ws_all(), sse_all())
    others_done.set()
    await side
    result.problems = problems + check_outcomes(outcomes)
    server_problems, stats = check_server(server)
    result.problems += server_problems
    result.counts = count_outcomes(outcomes)
    result.seconds = time.perf_counter() - t0
    result.extra = {"num_outcomes": len(outcomes), "num_preemptions": stats["num_preemptions"],
                    "num_dropped_sockets": sum(d is not None for d in drops), "bad_frames": dict(bad_sent)}
    return result
