"""Phases 2 and 3: KV exhaustion (the scheduler must preempt) and an injected engine fault (only the
faulted request may fail)."""
from __future__ import annotations

import asyncio
import random
import time

import httpx

from tests.server.harness import ServerThread
from tests.server.soak.clients import WsConn, http_request, make_spec, sse_stream
from tests.server.soak.common import (
    EVENT_TIMEOUT_S,
    FAULT_SEED,
    Outcome,
    PhaseResult,
    check_outcomes,
    check_server,
    count_outcomes,
)

# the phases' servers (engine args besides the model; server settings)
KV_SERVER = (dict(num_kv_blocks=16, max_model_len=128), {})  # 256 tokens of KV for ~900 wanted
FAULT_SERVER = (dict(num_kv_blocks=256, max_model_len=256), {})


# -- phase 2: KV exhaustion -----------------------------------------------------------------------

async def phase_kv_exhaustion(server: ServerThread, num_requests: int = 12, max_tokens: int = 48,
                              prompt_len: int = 40, max_n: int = 3, seed: int = 1) -> PhaseResult:
    """Many long requests (n > 1 too) on a small KV cache: the scheduler must preempt, and every
    request must still end with exactly its tokens."""
    rng = random.Random(seed)
    result = PhaseResult("kv_exhaustion")
    t0 = time.perf_counter()
    before = server.stats()["num_preemptions"]
    specs = []
    for i in range(num_requests):
        spec = {"prompt": [rng.randrange(3, 300) for _ in range(prompt_len)], "max_output_tokens": max_tokens,
                "ignore_eos": True, "temperature": 0.8, "seed": 1000 + i}
        if i % 2 == 0:
            spec["n"] = max_n
        specs.append(spec)
    conn = await WsConn.open(server.ws)
    async with httpx.AsyncClient(timeout=EVENT_TIMEOUT_S) as client:
        runs = [conn.stream(s, "full", rng) if i % 3 else sse_stream(client, server.http, s, "full", rng, i % 2 == 0)
                for i, s in enumerate(specs)]
        outcomes = list(await asyncio.gather(*runs))
    await conn.close()
    result.problems = check_outcomes(outcomes)
    server_problems, stats = check_server(server)
    result.problems += server_problems
    preemptions = stats["num_preemptions"] - before
    if preemptions == 0:
        result.problems.append(f"no preemption: {num_requests} requests did not exhaust {stats['num_blocks']} "
                               "KV blocks (raise the load or lower num_kv_blocks)")
    result.counts = count_outcomes(outcomes)
    result.seconds = time.perf_counter() - t0
    result.extra = {"num_preemptions": preemptions, "num_kv_blocks": stats["num_blocks"]}
    return result


# -- phase 3: an injected engine fault ------------------------------------------------------------

class FaultInjector:
    """Every engine step whose batch holds a request with sampling seed `seed` raises (the model
    runner's `launch` is wrapped on the in-process engine), so a step retried without that request
    succeeds. Restored on exit."""

    def __init__(self, server: ServerThread, seed: int = FAULT_SEED) -> None:
        self.runner = server.state.engine.engine.runner
        self.seed = seed
        self.num_raised = 0
        self._launch = self.runner.launch

    def _faulty_launch(self, sched, *args, **kwargs):
        if any(s.request.sampling_params.seed == self.seed for s in sched.scheduled):
            self.num_raised += 1
            raise RuntimeError(f"injected fault (a request with seed {self.seed} is in this step)")
        return self._launch(sched, *args, **kwargs)

    def __enter__(self) -> FaultInjector:
        self.runner.launch = self._faulty_launch
        return self

    def __exit__(self, *exc) -> None:
        del self.runner.launch  # back to the class's method


async def phase_fault(server: ServerThread, num_others: int = 6, max_tokens: int = 40, seed: int = 2
                      ) -> PhaseResult:
    """For each front end (WS, SSE, plain HTTP): while `num_others` requests stream, one request whose
    steps raise joins; it must end failed (WS status failed / SSE error chunk / HTTP 500), every other
    request must complete with exactly its tokens, and no KV block may leak."""
    rng = random.Random(seed)
    result = PhaseResult("engine_fault")
    t0 = time.perf_counter()
    outcomes: list[Outcome] = []
    poisoned: dict[str, Outcome] = {}
    with FaultInjector(server) as fault:
        for kind in ("ws", "sse", "http"):
            conn = await WsConn.open(server.ws)
            async with httpx.AsyncClient(timeout=EVENT_TIMEOUT_S) as client:
                others = [make_spec(rng, max_tokens, max_tokens, max_n=2) for _ in range(num_others)]
                runs = [asyncio.create_task(conn.stream(s, "full", rng) if i % 2 else
                                            sse_stream(client, server.http, s, "full", rng, i % 4 == 0))
                        for i, s in enumerate(others)]
                deadline = time.monotonic() + EVENT_TIMEOUT_S
                while conn.num_tokens < num_others and time.monotonic() < deadline:
                    await asyncio.sleep(0.005)  # the others are decoding when the poison arrives
                spec = {"prompt": "poison", "max_output_tokens": 8, "ignore_eos": True, "temperature": 0.8,
                        "seed": FAULT_SEED}
                bad = (conn.stream(spec, "poison", rng) if kind == "ws" else
                       sse_stream(client, server.http, spec, "poison", rng, False) if kind == "sse" else
                       http_request(client, server.http, spec, "poison", False))
                poisoned[kind] = await bad
                round_outcomes = await asyncio.gather(*runs)
                outcomes += round_outcomes
                result.problems += [f"round {kind} (the faulted request on {kind}): {p}"
                                    for p in check_outcomes(round_outcomes)]
            await conn.close()
    want = {"ws": "failed", "sse": "error chunk", "http": "http 500"}
    for kind, o in poisoned.items():
        if o.status != want[kind]:
            result.problems.append(f"the faulted {kind} request ended {o.status!r}, want {want[kind]!r}: "
                                   f"{o.error[:200]}")
    if fault.num_raised == 0:
        result.problems.append("the fault never fired (the poisoned request was never scheduled)")
    server_problems, _ = check_server(server)
    result.problems += server_problems
    result.counts = count_outcomes(outcomes + list(poisoned.values()))
    result.seconds = time.perf_counter() - t0
    result.extra = {"num_faults_raised": fault.num_raised}
    return result
