"""Soak, fault and fuzz load against a real server (shared by tests/server/test_soak.py, test_fuzz.py
and bench/soak.py; docs/soak.md says what each phase does).

Every load generator records how each response ended, as the client saw it (`Outcome`); the checks
turn those records and the server's state (KV blocks, running requests, /metrics, RSS) into a list
of problems, each naming its reproducer. An empty list is a pass. The server runs in this process
(tests/server/harness.py's ServerThread) so the checks can read the engine and inject faults.
"""
from __future__ import annotations

import asyncio
import gc
import json
import random
import string
import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass, field

import httpx
import websockets
from websockets.exceptions import ConnectionClosed

from tests.server.harness import ServerThread

EVENT_TIMEOUT_S = 60.0  # the longest wait for one server event / SSE line under load
SETTLE_S = 15.0  # after the last response ended: KV blocks and running requests back to 0 by then
PROMPT_CHARS = string.ascii_letters + string.digits + " "
FAULT_SEED = 4242  # the request whose engine steps raise in the fault phase
# the servers of the phases (engine args besides the model; server settings)
STREAMS_SERVER = (dict(num_kv_blocks=256, max_model_len=256), dict(max_frame_size=16384))
KV_SERVER = (dict(num_kv_blocks=16, max_model_len=128), {})  # 256 tokens of KV for ~900 wanted
FAULT_SERVER = (dict(num_kv_blocks=256, max_model_len=256), {})
# a short context bounds every fuzz request (max_tokens null = up to it); 64 KiB frames hold the
# 5000-digit literals and keep oversize frames cheap
FUZZ_SERVER = (dict(num_kv_blocks=128, max_model_len=64), dict(max_frame_size=65536))


@dataclass(slots=True)
class Outcome:
    """How one response ended, as the client saw it.

    `plan`: full (read to the end), cancel (WS `response.cancel` mid-stream), disconnect (the client
    went away mid-stream), slow (the socket stopped reading for a while), poison (the fault phase's
    chosen request). `status`: the WS `response.done` status, "done" (SSE [DONE] or a 200 JSON body),
    "disconnected" (we left), or what went wrong ("http 500", "error chunk", "lost", "timeout")."""

    kind: str  # ws | sse | http
    plan: str
    spec: dict
    status: str = ""
    streamed: dict[int, int] = field(default_factory=dict)  # output index -> token ids streamed
    usage_output_tokens: int | None = None
    error: str = ""

    @property
    def n(self) -> int:
        return self.spec.get("n", 1)

    @property
    def max_tokens(self) -> int:
        return self.spec.get("max_output_tokens") or self.spec.get("max_tokens")


@dataclass
class PhaseResult:
    name: str
    seconds: float = 0.0
    counts: dict = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)
    extra: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        return asdict(self)


# -- checks ----------------------------------------------------------------------------------------

ENDED_OK = {"ws": {"full": {"incomplete"}, "slow": {"incomplete"}, "cancel": {"cancelled", "incomplete"},
                   "disconnect": {"disconnected", "incomplete", "cancelled"}},
            "sse": {"full": {"done"}, "disconnect": {"disconnected", "done"}},
            "http": {"full": {"done"}}}


def check_outcome(o: Outcome) -> str | None:
    """What is wrong with one ended response (None: nothing). Complete answers must carry exactly
    max tokens per sample (ignore_eos), streamed and in usage."""
    ok = ENDED_OK[o.kind].get(o.plan, set())
    if o.status not in ok:
        return f"{o.kind} {o.plan} ended {o.status!r} (want {sorted(ok)}): {o.error[:200]} spec={o.spec}"
    total = sum(o.streamed.values())
    complete = o.status in ("incomplete", "done") and o.plan != "disconnect"
    if complete:
        want = {i: o.max_tokens for i in range(o.n)}
        if o.kind != "http" and o.streamed != want:
            return f"{o.kind} {o.plan}: streamed tokens per sample {o.streamed}, want {want} spec={o.spec}"
        if o.usage_output_tokens != o.max_tokens * o.n:
            return f"{o.kind} {o.plan}: usage output tokens {o.usage_output_tokens}, want " \
                   f"{o.max_tokens * o.n} spec={o.spec}"
    elif o.status == "cancelled" and o.usage_output_tokens is not None \
            and not total <= o.usage_output_tokens <= o.max_tokens * o.n:
        return f"ws cancel: usage output tokens {o.usage_output_tokens}, streamed {total} spec={o.spec}"
    return None


def check_outcomes(outcomes: list[Outcome], limit: int = 20) -> list[str]:
    problems = [p for p in map(check_outcome, outcomes) if p]
    return problems[:limit] + ([f"... and {len(problems) - limit} more"] if len(problems) > limit else [])


def count_outcomes(outcomes: list[Outcome]) -> dict:
    return dict(Counter(f"{o.kind}:{o.plan}:{o.status}" for o in outcomes))


def scrape_metrics(server: ServerThread) -> dict[str, float]:
    """`specserve:*` samples of /metrics, labels dropped (one model per server)."""
    out = {}
    for line in server.get("/metrics").text.splitlines():
        if line.startswith("specserve:") and " " in line:
            name, value = line.rsplit(" ", 1)
            out[name.split("{", 1)[0]] = float(value)
    return out


def check_server(server: ServerThread, settle_s: float = SETTLE_S) -> tuple[list[str], dict]:
    """After every response ended: no KV block held, nothing running or waiting (engine stats and the
    /metrics gauges agree), within `settle_s`."""
    stats = server.wait_blocks(0, settle_s)
    problems = [f"engine {key} = {stats[key]} after all responses ended (settled {settle_s}s)"
                for key in ("num_used_blocks", "num_requests_running", "num_requests_waiting") if stats[key]]
    metrics = scrape_metrics(server)
    for name in ("specserve:num_requests_running", "specserve:num_requests_waiting",
                 "specserve:kv_cache_usage_perc"):
        if metrics.get(name, 0.0) != 0.0:
            problems.append(f"/metrics {name} = {metrics[name]} after all responses ended")
    return problems, stats


def rss_bytes() -> int:
    try:
        import psutil
        return psutil.Process().memory_info().rss
    except ImportError:
        for line in open("/proc/self/status"):
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def rss_after_gc() -> int:
    gc.collect()
    return rss_bytes()


# -- WebSocket client ------------------------------------------------------------------------------

BAD_FRAMES = {  # frame builder -> the error code the server must answer with
    "invalid_json": lambda i, limit: '{"type": "response.create", "event_id": ',
    "unknown_event_type": lambda i, limit: json.dumps({"type": "response.bogus", "event_id": f"bad-{i}"}),
    "invalid_event": lambda i, limit: json.dumps({"type": "response.create", "event_id": f"bad-{i}",
                                                  "response": {"prompt": "x", "temperature": "0.5"}}),
    "frame_too_large": lambda i, limit: json.dumps({"type": "response.create", "event_id": f"bad-{i}",
                                                    "response": {"prompt": "x" * (limit + limit // 2)}}),
}


class WsConn:
    """One client socket. A reader task routes events to one queue per response; `reading` cleared
    makes it stop reading the socket (websockets then stops reading TCP: backpressure on the server)."""

    def __init__(self, ws, hello: dict) -> None:
        self.ws, self.hello = ws, hello
        self.created: dict[str, asyncio.Future] = {}  # event_id -> response id
        self.queues: dict[str, asyncio.Queue] = {}
        self.errors: list[dict] = []  # error events that answer no response.create of ours
        self.bad_sent: Counter = Counter()
        self.reading = asyncio.Event()
        self.reading.set()
        self.gone = False  # we closed it on purpose
        self.close_reason = ""
        self.num_tokens = 0
        self._next = 0
        self._reader = asyncio.create_task(self._read())

    @classmethod
    async def open(cls, url: str) -> WsConn:
        ws = await websockets.connect(url, max_size=None, max_queue=4, open_timeout=30)
        hello = json.loads(await asyncio.wait_for(ws.recv(), EVENT_TIMEOUT_S))
        assert hello["type"] == "session.created", hello
        return cls(ws, hello)

    async def _read(self) -> None:
        try:
            while True:
                await self.reading.wait()
                msg = json.loads(await self.ws.recv())
                kind = msg["type"]
                if kind == "response.created":
                    self.queues.setdefault(msg["response"]["id"], asyncio.Queue())
                    fut = self.created.pop(msg.get("event_id"), None)
                    if fut is not None:
                        fut.set_result(msg["response"]["id"])
                elif kind == "response.output_text.delta":
                    self.num_tokens += len(msg["token_ids"])
                    self.queues.setdefault(msg["response_id"], asyncio.Queue()).put_nowait(msg)
                elif kind == "response.done":
                    self.queues.setdefault(msg["response"]["id"], asyncio.Queue()).put_nowait(msg)
                elif kind == "error" and msg["error"].get("event_id") in self.created:
                    self.created.pop(msg["error"]["event_id"]).set_exception(RuntimeError(msg["error"]))
                else:
                    self.errors.append(msg)
        except ConnectionClosed as e:
            self.close_reason = f"closed rcvd={e.rcvd} sent={e.sent}"
        except Exception as e:  # noqa: BLE001 - a malformed frame: report it on every waiting response
            self.close_reason = f"reader failed: {type(e).__name__}: {e}"
        finally:
            for fut in self.created.values():
                if not fut.done():
                    fut.set_exception(RuntimeError(f"socket ended: {self.close_reason}"))
            for q in self.queues.values():
                q.put_nowait(None)

    async def create(self, spec: dict) -> str:
        self._next += 1
        event_id = f"e{self._next}"
        self.created[event_id] = asyncio.get_running_loop().create_future()
        await self.ws.send(json.dumps({"type": "response.create", "event_id": event_id, "response": spec}))
        return await asyncio.wait_for(self.created[event_id], EVENT_TIMEOUT_S)

    async def send_bad(self, rng: random.Random) -> None:
        code = rng.choice(sorted(BAD_FRAMES))
        self._next += 1
        await self.ws.send(BAD_FRAMES[code](self._next, self.hello["max_frame_size"]))
        self.bad_sent[code] += 1

    async def stream(self, spec: dict, plan: str, rng: random.Random, pause_s: float = 0.0) -> Outcome:
        """Run one response to its end following `plan`."""
        out = Outcome("ws", plan, spec)
        try:
            rid = await self.create(spec)
        except Exception as e:  # noqa: BLE001
            out.status, out.error = ("disconnected" if self.gone else "refused"), str(e)
            return out
        cancel_at = rng.randint(1, max(1, out.max_tokens * out.n - 1)) if plan == "cancel" else None
        queue = self.queues[rid]
        while True:
            try:
                msg = await asyncio.wait_for(queue.get(), EVENT_TIMEOUT_S + pause_s)
            except asyncio.TimeoutError:
                out.status = "timeout"
                return out
            if msg is None:
                out.status, out.error = ("disconnected" if self.gone else "lost"), self.close_reason
                return out
            if msg["type"] == "response.done":
                r = msg["response"]
                out.status, out.usage_output_tokens = r["status"], r["usage"]["output_tokens"]
                out.error = json.dumps(r.get("error")) if r.get("error") else ""
                return out
            i = msg["output_index"]
            out.streamed[i] = out.streamed.get(i, 0) + len(msg["token_ids"])
            if pause_s and self.reading.is_set() and sum(out.streamed.values()) == 1:
                self.reading.clear()  # a slow reader: stop reading the socket for a while
                asyncio.get_running_loop().call_later(pause_s, self.reading.set)
            if cancel_at is not None and sum(out.streamed.values()) >= cancel_at:
                cancel_at = None
                await self.ws.send(json.dumps({"type": "response.cancel", "response_id": rid}))

    def bad_frame_problems(self) -> list[str]:
        got = Counter(e["error"]["code"] for e in self.errors if e["type"] == "error")
        expected = Counter(self.bad_sent)
        # a cancel that raced the response's own end is answered unknown_response_id: not a bad frame
        got.pop("unknown_response_id", None)
        if got != expected:
            return [f"bad frames sent {dict(expected)} but error events {dict(got)}"]
        return []

    async def close(self, abort: bool = False) -> None:
        self.gone = True
        self.reading.set()  # a stalled reader wakes to find the socket closed
        if abort:
            self.ws.transport.abort()
        else:
            await self.ws.close()
        await asyncio.gather(self._reader, return_exceptions=True)


# -- SSE / HTTP client -----------------------------------------------------------------------------

def http_body(spec: dict, chat: bool, stream: bool) -> dict:
    """The OpenAI body for a WS-style spec; logprobs on so every streamed token is counted."""
    body = {"max_tokens": spec["max_output_tokens"], "ignore_eos": True, "temperature": spec["temperature"],
            "n": spec.get("n", 1), "stream": stream}
    if "seed" in spec:
        body["seed"] = spec["seed"]
    if stream:
        body["stream_options"] = {"include_usage": True}
    if chat:
        prompt = spec.get("prompt")
        text = prompt if isinstance(prompt, str) else "".join(PROMPT_CHARS[t % len(PROMPT_CHARS)]
                                                              for t in prompt or [])
        body["messages"] = spec.get("messages") or [{"role": "user", "content": text}]
        body |= {"logprobs": True, "top_logprobs": 0}
    else:
        body["prompt"] = spec.get("prompt") or spec["messages"][-1]["content"]
        body["logprobs"] = 0
    return body


async def sse_stream(client: httpx.AsyncClient, base: str, spec: dict, plan: str, rng: random.Random,
                     chat: bool) -> Outcome:
    out = Outcome("sse", plan, spec)
    cut = rng.randint(1, max(1, out.max_tokens * out.n - 1)) if plan == "disconnect" else None
    path = "/v1/chat/completions" if chat else "/v1/completions"
    try:
        async with client.stream("POST", base + path, json=http_body(spec, chat, True)) as r:
            if r.status_code != 200:
                out.status, out.error = f"http {r.status_code}", (await r.aread()).decode()[:300]
                return out
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    out.status = out.status or "done"
                    return out
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    out.status, out.error = "error chunk", json.dumps(chunk["error"])
                    continue
                for c in chunk["choices"]:
                    lp = c.get("logprobs") or {}
                    num = len(lp.get("content") or []) if chat else len(lp.get("tokens") or [])
                    out.streamed[c["index"]] = out.streamed.get(c["index"], 0) + num
                if chunk.get("usage"):
                    out.usage_output_tokens = chunk["usage"]["completion_tokens"]
                if cut is not None and sum(out.streamed.values()) >= cut:
                    out.status = "disconnected"  # leaving the block closes the connection mid-stream
                    return out
            out.status = out.status or "lost"  # the body ended without [DONE]
    except httpx.TimeoutException:
        out.status = "timeout"
    except httpx.TransportError as e:
        out.status, out.error = "lost", f"{type(e).__name__}: {e}"
    return out


async def http_request(client: httpx.AsyncClient, base: str, spec: dict, plan: str, chat: bool) -> Outcome:
    out = Outcome("http", plan, spec)
    r = await client.post(base + ("/v1/chat/completions" if chat else "/v1/completions"),
                          json=http_body(spec, chat, False))
    if r.status_code != 200:
        out.status, out.error = f"http {r.status_code}", r.text[:300]
        return out
    out.status, out.usage_output_tokens = "done", r.json()["usage"]["completion_tokens"]
    return out


def make_spec(rng: random.Random, min_tokens: int, max_tokens: int, max_n: int = 2, prompt_len: int = 24) -> dict:
    """A response.create body: text, token-id or chat prompt; exactly `max_output_tokens` wanted."""
    text = "".join(rng.choice(PROMPT_CHARS) for _ in range(rng.randint(1, prompt_len)))
    kind = rng.random()
    spec = {"prompt": text} if kind < 0.4 else \
        {"prompt": [rng.randrange(3, 300) for _ in range(rng.randint(1, prompt_len))]} if kind < 0.7 else \
        {"messages": [{"role": "user", "content": text}]}
    spec |= {"max_output_tokens": rng.randint(min_tokens, max_tokens), "ignore_eos": True,
             "temperature": rng.choice([0.0, 0.8])}
    if spec["temperature"]:
        spec["seed"] = rng.randrange(2 ** 31) or FAULT_SEED + 1
        spec["seed"] += spec["seed"] == FAULT_SEED
    if max_n > 1 and rng.random() < 0.2:
        spec["n"] = rng.randint(2, max_n)
    return spec


# -- phase 1: many streams, cancels, disconnects, bad frames, slow readers -------------------------

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


# -- phase 4: fuzz --------------------------------------------------------------------------------
# Inputs are raw JSON text, so they can hold what json.dumps cannot write: `Raw` pieces (NaN,
# Infinity, 5000-digit integers, lone-surrogate escapes, deep nesting) are pasted in verbatim.

@dataclass(frozen=True, slots=True)
class Raw:
    text: str


def dumps(obj) -> str:
    """JSON text of `obj`, with `Raw` pieces pasted verbatim (strings ASCII-escaped: "\\ud800")."""
    if isinstance(obj, Raw):
        return obj.text
    if isinstance(obj, dict):
        return "{" + ", ".join(f"{json.dumps(str(k))}: {dumps(v)}" for k, v in obj.items()) + "}"
    if isinstance(obj, (list, tuple)):
        return "[" + ", ".join(dumps(v) for v in obj) + "]"
    return json.dumps(obj)


BIG_DIGITS = "1" + "0" * 4999  # 10**4999: Python's json refuses integers over 4300 digits
WEIRD_VALUES = [
    None, True, False, 0, -1, 1.5, -0.0, "", " ", "\x00", "\ud800", "a\udfffb", "é" * 8, "\n\n", "x" * 3000,
    [], {}, [1, "a"], {"x": 1}, [[[]]], 10 ** 30, -10 ** 30, 2 ** 63, 2 ** 64, -2 ** 63 - 1, 2 ** 1000,
    Raw("NaN"), Raw("Infinity"), Raw("-Infinity"), Raw("1e999"), Raw(BIG_DIGITS), Raw("-" + BIG_DIGITS),
    Raw('"\\ud800"'), Raw('"x\\udc00"'), Raw('"\\u0000"'), Raw("[" * 60 + "]" * 60), Raw("[" * 5000 + "]" * 5000),
    Raw('{"a": ' * 300 + "1" + "}" * 300), "bogus", "response.create", -16, 17, 10 ** 6,
]
WS_FIELDS = ["prompt", "messages", "max_output_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop",
             "ignore_eos", "n", "cache_salt", "metadata", "role", "content", "type", "text", "event_id", "bogus"]
HTTP_FIELDS = ["model", "prompt", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p",
               "n", "seed", "stop", "stream", "stream_options", "logprobs", "top_logprobs", "ignore_eos",
               "min_tokens", "stop_token_ids", "repetition_penalty", "cache_salt", "role", "content", "echo",
               "best_of", "logit_bias", "tools", "response_format", "bogus"]
CONTENT_TYPES = ["application/json", "application/json", "application/json; charset=utf-8", "text/plain", "",
                 "application/x-www-form-urlencoded", "multipart/form-data"]


def _strategies():
    """Hypothesis strategies (imported lazily: only the fuzz needs hypothesis)."""
    from hypothesis import strategies as st

    text = st.text(alphabet=PROMPT_CHARS, min_size=1, max_size=30)
    ids = st.lists(st.integers(3, 300), min_size=1, max_size=16)
    messages = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant"]),
                                               "content": text}), min_size=1, max_size=3)
    weird = st.one_of(st.sampled_from(WEIRD_VALUES), st.integers(), st.floats(), st.text(max_size=12),
                      st.lists(st.integers(-5, 400), max_size=4))
    sampling = {"temperature": st.floats(0, 2), "top_p": st.floats(0.05, 1), "seed": st.integers(0, 2 ** 32),
                "stop": st.one_of(text, st.lists(text, max_size=3)), "ignore_eos": st.booleans(),
                "n": st.integers(1, 3), "cache_salt": st.text(max_size=8)}
    ws_params = st.one_of(*(st.fixed_dictionaries(head | {"max_output_tokens": st.integers(1, 6)},
                                                  optional=sampling | {
        "top_k": st.integers(-1, 40), "min_p": st.floats(0, 1),
        "metadata": st.dictionaries(st.text(max_size=6), st.text(max_size=6), max_size=3)})
        for head in ({"prompt": st.one_of(text, ids)}, {"messages": messages})))
    ws_valid = st.one_of(
        st.fixed_dictionaries({"type": st.just("response.create"), "response": ws_params},
                              optional={"event_id": st.text(max_size=12)}),
        st.fixed_dictionaries({"type": st.just("response.cancel"), "response_id": st.text(max_size=24)}))
    http_common = {"max_tokens": st.integers(1, 6), "stream": st.booleans()}
    completions_valid = st.fixed_dictionaries(
        {"prompt": st.one_of(text, ids, st.lists(text, min_size=1, max_size=3))} | http_common,
        optional=sampling | {"logprobs": st.integers(0, 3), "model": st.just("tiny")})
    chat_valid = st.fixed_dictionaries({"messages": messages} | http_common,
                                       optional=sampling | {"logprobs": st.booleans(), "model": st.just("tiny")})

    @st.composite
    def mutated(draw, base, names):
        obj = draw(base)
        for _ in range(draw(st.integers(1, 3))):
            paths = list(_paths(obj))
            path = draw(st.sampled_from(paths))
            op = draw(st.sampled_from(["replace", "replace", "add", "delete"]))
            target = _get(obj, path)
            if op == "add" and isinstance(target, dict):
                obj = _put(obj, path + (draw(st.sampled_from(names)),), draw(weird))
            elif op == "delete" and path:
                obj = _put(obj, path, _DELETE)
            else:
                obj = _put(obj, path, draw(weird))
        return obj

    def frames(base, names):
        text_of = st.one_of(base, mutated(base, names)).map(dumps)
        return st.one_of(text_of, text_of.flatmap(  # text-level damage: cut short, garbage appended
            lambda t: st.one_of(st.integers(0, len(t)).map(lambda i: t[:i]),
                                st.text(max_size=8).map(lambda g: t + g))), st.text(max_size=40))

    def bodies(base):
        return st.tuples(st.sampled_from(CONTENT_TYPES), frames(base, HTTP_FIELDS).map(
            lambda t: t.encode("utf-8", "surrogatepass")))

    return {"ws": frames(ws_valid, WS_FIELDS), "completions": bodies(completions_valid),
            "chat": bodies(chat_valid)}


_DELETE = object()


def _paths(obj, prefix: tuple = ()):
    yield prefix
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, list) else ()
    for k, v in items:
        yield from _paths(v, prefix + (k,))


def _get(obj, path: tuple):
    for k in path:
        obj = obj[k]
    return obj


def _put(obj, path: tuple, value):
    """A copy of `obj` with the value at `path` replaced (or deleted: `_DELETE`)."""
    if not path:
        return value
    copy = dict(obj) if isinstance(obj, dict) else list(obj)
    head = path[0]
    if len(path) == 1 and value is _DELETE:
        del copy[head]
    else:
        copy[head] = _put(copy[head] if head in (copy if isinstance(copy, dict) else range(len(copy))) else {},
                          path[1:], value)
    return copy


def _frame(response: dict, event_id: str | Raw = "p") -> str:
    return dumps({"type": "response.create", "event_id": event_id, "response": response})


def _body(obj: dict, content_type: str = "application/json") -> tuple[str, bytes]:
    return content_type, dumps(obj).encode()


_HI = {"prompt": "hi", "max_output_tokens": 4}
_CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
_COMPLETION = {"prompt": "hi", "max_tokens": 4}
# name -> (target, input, must be refused): the known poison inputs, also explicit examples of the fuzz
POISON = {
    "ws-seed-2**64": ("ws", _frame(_HI | {"seed": 2 ** 64}), True),
    "ws-seed-2**63": ("ws", _frame(_HI | {"seed": 2 ** 63}), False),
    "ws-surrogate-prompt": ("ws", _frame(_HI | {"prompt": Raw('"a\\ud800b"')}), True),
    "ws-surrogate-messages": ("ws", _frame({"messages": [{"role": "user", "content": Raw('"\\ud800"')}],
                                           "max_output_tokens": 4}), True),
    "ws-surrogate-metadata": ("ws", _frame(_HI | {"metadata": {"k": Raw('"\\ud800"')}}), True),
    "ws-surrogate-event-id": ("ws", _frame(_HI, Raw('"\\ud800"')), True),
    "ws-5000-digit-int": ("ws", _frame(_HI | {"max_output_tokens": Raw(BIG_DIGITS)}), True),
    "ws-role-bogus": ("ws", _frame({"messages": [{"role": "bogus", "content": "hi"}], "max_output_tokens": 4}),
                      True),
    "ws-temperature-infinity": ("ws", _frame(_HI | {"temperature": Raw("Infinity")}), True),
    "completions-seed-2**64": ("completions", _body(_COMPLETION | {"seed": 2 ** 64}), True),
    "completions-seed-2**63": ("completions", _body(_COMPLETION | {"seed": 2 ** 63}), False),
    "completions-surrogate-prompt": ("completions", _body(_COMPLETION | {"prompt": Raw('"\\ud800"')}), True),
    "completions-5000-digit-int": ("completions", _body(_COMPLETION | {"max_tokens": Raw(BIG_DIGITS)}), True),
    "completions-text-plain": ("completions", _body(_COMPLETION, "text/plain"), True),
    "completions-temperature-infinity": ("completions", _body(_COMPLETION | {"temperature": Raw("Infinity")}),
                                         True),
    "completions-1000-prompts-n16": ("completions", _body({"prompt": ["hi"] * 1000, "n": 16, "max_tokens": 16}),
                                     True),
    "chat-seed-2**64": ("chat", _body(_CHAT | {"seed": 2 ** 64}), True),
    "chat-seed-2**63": ("chat", _body(_CHAT | {"seed": 2 ** 63}), False),
    "chat-surrogate-content": ("chat", _body({"messages": [{"role": "user", "content": Raw('"\\ud800"')}],
                                              "max_tokens": 4}), True),
    "chat-5000-digit-int": ("chat", _body(_CHAT | {"max_tokens": Raw(BIG_DIGITS)}), True),
    "chat-text-plain": ("chat", _body(_CHAT, "text/plain"), True),
    "chat-role-bogus": ("chat", _body({"messages": [{"role": "bogus", "content": "hi"}], "max_tokens": 4}), True),
    "chat-temperature-infinity": ("chat", _body(_CHAT | {"temperature": Raw("Infinity")}), True),
}
PATHS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}


class Fuzzer:
    """The fuzz oracle. HTTP: never a 5xx (nor a 200 stream with an error chunk or without [DONE]),
    always an answer within `timeout`. WS: every frame is answered by exactly one well-formed `error` or
    `response.created` (created responses are cancelled at once and must end with a response.done that
    is not `failed`), and the socket is never dropped. Meanwhile a canary thread runs valid requests
    (WS and SSE) that must complete with exactly their tokens. Problems name their input (repr)."""

    def __init__(self, server: ServerThread, timeout: float = 30.0) -> None:
        self.server, self.timeout = server, timeout
        self.http = httpx.Client(timeout=timeout)
        self.problems: list[str] = []
        self.num_inputs: Counter = Counter()
        self.num_canaries = 0
        self.current = ""  # the input under test (named by canary failures)
        self._ws = None
        self._sync = 0
        self._stop = threading.Event()
        self._canary: threading.Thread | None = None
        self.start_canary()

    def start_canary(self) -> None:
        self._stop = threading.Event()
        self._canary = threading.Thread(target=self._canary_loop, args=(self._stop,), name="fuzz-canary",
                                        daemon=True)
        self._canary.start()

    def stop_canary(self) -> None:
        self._stop.set()
        self._canary.join(self.timeout)

    def fail(self, what: str, case) -> None:
        self.problems.append(f"{what}; input: {_short(case)}")

    # -- WebSocket ---------------------------------------------------------------------------------
    def _socket(self):
        if self._ws is None:
            self._ws = _sync_connect(self.server.ws, self.timeout)
            json.loads(self._ws.recv(timeout=self.timeout))  # session.created
        return self._ws

    def check_ws(self, frame: str, must_refuse: bool = False) -> None:
        from specserve.server.protocol import parse_server_event
        self.num_inputs["ws"] += 1
        self.current = frame
        self._sync += 1
        sync_id = f"sync-{self._sync}"
        ws = self._socket()
        answers, open_ids, synced = [], set(), False
        deadline = time.monotonic() + self.timeout
        try:
            ws.send(frame)
            ws.send(json.dumps({"type": "soak.sync", "event_id": sync_id}))  # answered after `frame`
            while not synced or open_ids:
                raw = ws.recv(timeout=max(0.01, deadline - time.monotonic()))
                msg = json.loads(raw)
                parse_server_event(msg)
                kind, err = msg["type"], msg.get("error") or {}
                if kind == "error" and err.get("event_id") == sync_id:
                    synced = True
                elif kind == "error" and str(err.get("event_id")).startswith("cancel-"):
                    pass  # the response ended before its cancel arrived
                elif kind in ("error", "response.created"):
                    answers.append(msg)
                    if kind == "response.created":
                        open_ids.add(msg["response"]["id"])
                        ws.send(json.dumps({"type": "response.cancel", "response_id": msg["response"]["id"],
                                            "event_id": f"cancel-{self._sync}"}))
                elif kind == "response.done":
                    open_ids.discard(msg["response"]["id"])
                    if msg["response"]["status"] == "failed":
                        self.fail(f"ws response failed: {msg['response']['error']}", frame)
        except TimeoutError:
            self.fail(f"ws: no answer within {self.timeout}s", frame)
            self._drop_socket()
            return
        except ConnectionClosed as e:
            self.fail(f"ws socket dropped ({'no close frame' if e.rcvd is None else e.rcvd})", frame)
            self._ws = None
            return
        except Exception as e:  # noqa: BLE001 - a malformed event
            self.fail(f"ws malformed event: {type(e).__name__}: {str(e)[:200]}", frame)
            self._drop_socket()
            return
        if len(answers) != 1:
            self.fail(f"ws frame answered by {len(answers)} events: {[a['type'] for a in answers]}", frame)
        elif must_refuse and answers[0]["type"] != "error":
            self.fail("ws: accepted (response.created), want an error event", frame)

    def _drop_socket(self) -> None:
        if self._ws is not None:
            self._ws.close()
            self._ws = None

    # -- HTTP --------------------------------------------------------------------------------------
    def check_http(self, target: str, case: tuple[str, bytes], must_refuse: bool = False) -> None:
        self.num_inputs[target] += 1
        self.current = case
        content_type, body = case
        headers = {"content-type": content_type} if content_type else {}
        t0 = time.monotonic()
        try:
            with self.http.stream("POST", self.server.http + PATHS[target], content=body, headers=headers) as r:
                if r.status_code >= 500:
                    self.fail(f"HTTP {r.status_code}: {r.read()[:300]!r}", case)
                elif r.status_code == 200 and r.headers.get("content-type", "").startswith("text/event-stream"):
                    lines = [line for line in r.iter_lines() if line.startswith("data: ")]
                    errors = [line for line in lines if line.startswith('data: {"error"')]
                    if errors or not lines or lines[-1] != "data: [DONE]":
                        self.fail(f"SSE ended badly: {(errors or lines[-1:] or ['nothing'])[0][:300]}", case)
                else:
                    data = json.loads(r.read())
                    key = "choices" if r.status_code == 200 else "error"
                    if key not in data:
                        self.fail(f"HTTP {r.status_code} body without {key!r}: {str(data)[:200]}", case)
                if must_refuse and not 400 <= r.status_code < 500:
                    self.fail(f"HTTP {r.status_code}, want a 4xx refusal", case)
        except httpx.TimeoutException:
            self.fail(f"HTTP: no answer within {self.timeout}s", case)
            return
        except (httpx.TransportError, ValueError) as e:
            self.fail(f"HTTP: {type(e).__name__}: {str(e)[:200]}", case)
        if time.monotonic() - t0 > self.timeout:
            self.fail(f"HTTP answered after {time.monotonic() - t0:.1f}s (limit {self.timeout}s)", case)

    def check(self, target: str, case, must_refuse: bool = False) -> None:
        if target == "ws":
            self.check_ws(case, must_refuse)
        else:
            self.check_http(target, case, must_refuse)

    # -- the canary and the end --------------------------------------------------------------------
    def _canary_loop(self, stop: threading.Event) -> None:
        spec = {"prompt": [5, 6, 7, 8], "max_output_tokens": 8, "ignore_eos": True, "temperature": 0.0}
        ws = None
        while not stop.wait(0.05):
            try:
                if ws is None:
                    ws = _sync_connect(self.server.ws, self.timeout)
                    ws.recv(timeout=self.timeout)
                ws.send(json.dumps({"type": "response.create", "response": spec}))
                streamed, done = 0, None
                while done is None:
                    msg = json.loads(ws.recv(timeout=self.timeout))
                    streamed += len(msg.get("token_ids", []))
                    done = msg["response"] if msg["type"] == "response.done" else None
                if done["status"] != "incomplete" or streamed != 8 or done["usage"]["output_tokens"] != 8:
                    self.fail(f"canary (ws) ended {done['status']} with {streamed} tokens "
                              f"({done.get('error')})", self.current)
                body = http_body(spec, False, True)
                with self.http.stream("POST", self.server.http + PATHS["completions"], json=body) as r:
                    lines = [line for line in r.iter_lines() if line.startswith("data: ")]
                usage = json.loads(lines[-2][6:])["usage"] if len(lines) >= 2 and lines[-2].startswith(
                    'data: {"id"') else None
                if r.status_code != 200 or lines[-1:] != ["data: [DONE]"] or not usage or \
                        usage["completion_tokens"] != 8:
                    self.fail(f"canary (sse) HTTP {r.status_code}: {(lines or [''])[-2:]}", self.current)
                self.num_canaries += 1
            except Exception as e:  # noqa: BLE001
                self.fail(f"canary: {type(e).__name__}: {str(e)[:200]}", self.current)
                ws = None
        if ws is not None:
            ws.close()

    def take_problems(self) -> list[str]:
        """The problems so far (cleared), and the server's state once the inputs and canaries ended."""
        self._drop_socket()
        self.stop_canary()
        problems, self.problems = self.problems, []
        problems += check_server(self.server)[0]
        self.start_canary()
        return problems

    def close(self) -> None:
        self.stop_canary()
        self._drop_socket()
        self.http.close()


def _sync_connect(url: str, timeout: float):
    """A blocking client socket kept open across calls (entered by hand: its `with` would close it)."""
    from websockets.sync.client import connect
    return connect(url, max_size=None, open_timeout=timeout).__enter__()


def _short(case, limit: int = 300) -> str:
    text = repr(case)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} chars)"


def run_fuzz(fuzzer: Fuzzer, target: str, max_examples: int, derandomize: bool = True) -> None:
    """Hypothesis-generated inputs for `target` (ws | completions | chat), the POISON inputs first as
    explicit examples; every input goes through the fuzzer's oracle, whose problems are collected (not
    raised) so one run reports every failing input."""
    from hypothesis import HealthCheck, Phase, example, given, settings

    def one(case) -> None:
        fuzzer.check(target, case)

    test = given(case=_strategies()[target])(one)
    for t, case, _ in POISON.values():
        if t == target:
            test = example(case=case)(test)
    settings(max_examples=max_examples, derandomize=derandomize, deadline=None, database=None,
             phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck),
             print_blob=False)(test)()
