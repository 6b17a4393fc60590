"""The load generator of bench/serving.py: one request over WebSocket or OpenAI SSE, closed-loop users
or Poisson arrivals, spread over client processes that start together.

A prompt is a `str` (sent as one user chat message) or a `list[int]` (token ids, sent raw). Every
time stamp is `time.perf_counter()`, which on Linux is CLOCK_MONOTONIC: one clock for every process
of the machine, so the results of several client processes share one time line.
"""
from __future__ import annotations

import asyncio
import json
import multiprocessing as mp
import queue
import random
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field, replace

import httpx

from specserve.client import AsyncClient, OutputTextDelta, ResponseDone, SpecserveError

Prompt = str | list[int]
READ_TIMEOUT_S = 600.0
BARRIER_TIMEOUT_S = 300.0  # spawn + imports + opening every user's connection


@dataclass(slots=True)
class Result:
    """One request. `token_times` holds the arrival of each token-bearing event."""

    send: float
    wave: int | None = None  # index of the request among its user's requests (None: open loop)
    end: float = 0.0  # the done event (or the failure)
    ok: bool = False
    status: str = ""
    error: str = ""
    input_tokens: int = 0
    output_tokens: int = 0
    streamed_tokens: int = 0  # tokens counted from the events themselves
    cached_tokens: int = 0
    token_times: list[float] = field(default_factory=list)

    def token_event(self, num_tokens: int) -> None:
        self.token_times.append(time.perf_counter())
        self.streamed_tokens += num_tokens

    def finish(self, status: str, max_tokens: int) -> None:
        self.end, self.status = time.perf_counter(), status
        self.output_tokens = self.output_tokens or self.streamed_tokens
        self.ok = not self.error and self.output_tokens == max_tokens and bool(self.token_times)
        if not self.ok and not self.error:
            self.error = f"status {status}, {self.output_tokens} tokens"

    @property
    def ttft(self) -> float | None:
        return self.token_times[0] - self.send if self.token_times else None

    @property
    def tpot(self) -> float | None:
        if not self.ok or self.output_tokens < 2:
            return None
        return (self.token_times[-1] - self.token_times[0]) / (self.output_tokens - 1)

    def row(self) -> dict:
        """The per-request record of the JSON report (no token times)."""
        return {"ok": self.ok, "status": self.status, "error": self.error, "wave": self.wave,
                "input_tokens": self.input_tokens, "output_tokens": self.output_tokens,
                "cached_tokens": self.cached_tokens, "ttft": self.ttft, "tpot": self.tpot,
                "e2e": self.end - self.send, "num_token_events": len(self.token_times)}


@dataclass(slots=True)
class LoadJob:
    """The load of one client process: closed-loop users, or Poisson arrivals when `rate` is set."""

    protocol: str  # "ws" (url = ws://host:port/v1/ws) or "sse" (url = http://host:port)
    url: str
    model: str | None  # the served model name (the `model` field of SSE requests)
    api_key: str | None
    prompts: list[Prompt]
    max_tokens: int
    users: int = 1
    requests_per_user: int | None = None  # None: the users share `prompts` as one queue
    rate: float | None = None
    seed: int = 0


@dataclass(slots=True)
class WorkerResult:
    results: list[Result]
    start: float
    wall_s: float
    cpu_s: float
    users: int


async def ws_request(client: AsyncClient, prompt: Prompt, max_tokens: int) -> Result:
    r = Result(send=time.perf_counter())
    what = {"messages": [{"role": "user", "content": prompt}]} if isinstance(prompt, str) else {"prompt": prompt}
    status = "no response.done"
    try:
        stream = await client.create(**what, max_output_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        async for event in stream:
            if isinstance(event, OutputTextDelta) and event.token_ids:
                r.token_event(len(event.token_ids))
            elif isinstance(event, ResponseDone):
                status, usage = event.response.status, event.response.usage
                r.input_tokens, r.output_tokens = usage.input_tokens, usage.output_tokens
                r.cached_tokens = usage.cached_tokens
        if status not in ("completed", "incomplete"):
            r.error = f"status {status}"
    except SpecserveError as e:
        status, r.error = "failed", f"{e.code}: {e.message}"
    r.finish(status, max_tokens)
    return r


def _sse_tokens(choice: dict) -> int:
    """Tokens a stream chunk's choice carries: its `token_ids`, or 1 if it has text (servers that
    do not return token ids)."""
    if "token_ids" in choice:
        return len(choice["token_ids"] or ())
    text = choice["delta"].get("content") if "delta" in choice else choice.get("text")
    return 1 if text else 0


async def sse_request(client: httpx.AsyncClient, model: str | None, prompt: Prompt, max_tokens: int) -> Result:
    r = Result(send=time.perf_counter())
    chat = isinstance(prompt, str)
    body = {"model": model, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}, "return_token_ids": True}
    body |= {"messages": [{"role": "user", "content": prompt}]} if chat else {"prompt": prompt}
    status, done = "", False
    try:
        async with client.stream("POST", "/v1/chat/completions" if chat else "/v1/completions", json=body) as resp:
            if resp.status_code != 200:
                raise ValueError(f"HTTP {resp.status_code}: {(await resp.aread())[:300].decode(errors='replace')}")
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    done = True
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    raise ValueError(str(chunk["error"].get("message", chunk["error"]))[:300])
                for choice in chunk.get("choices") or ():
                    if num := _sse_tokens(choice):
                        r.token_event(num)
                    status = choice.get("finish_reason") or status
                if usage := chunk.get("usage"):
                    r.input_tokens, r.output_tokens = usage["prompt_tokens"], usage["completion_tokens"]
                    r.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
        if not done:
            r.error = "the stream ended without data: [DONE]"
    except (httpx.HTTPError, ValueError) as e:  # ValueError: a refusal, an error chunk, a bad chunk
        status, r.error = "failed", f"{type(e).__name__}: {e}"
    r.finish(status, max_tokens)
    return r


Send = Callable[[Prompt], Awaitable[Result]]


@asynccontextmanager
async def session(job: LoadJob) -> AsyncIterator[Send]:
    """One connection (a socket, or an HTTP/1.1 keep-alive client) and how to send a prompt on it."""
    if job.protocol == "ws":
        async with AsyncClient(job.url, api_key=job.api_key, read_timeout=READ_TIMEOUT_S) as client:
            yield lambda prompt: ws_request(client, prompt, job.max_tokens)
        return
    headers = {"Authorization": f"Bearer {job.api_key}"} if job.api_key else None
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)  # open loop: one client
    async with httpx.AsyncClient(base_url=job.url, headers=headers, limits=limits,
                                 timeout=httpx.Timeout(READ_TIMEOUT_S, connect=10.0)) as client:
        (await client.get("/v1/models")).raise_for_status()  # connect now, as a socket does, not in a TTFT
        yield lambda prompt: sse_request(client, job.model, prompt, job.max_tokens)


async def closed_loop(sends: list[Send], job: LoadJob) -> list[Result]:
    """Each user sends its next request when its last one is done."""
    per_user = job.requests_per_user
    if per_user:
        lanes = [deque(job.prompts[u * per_user:(u + 1) * per_user]) for u in range(job.users)]
    else:
        lanes = [deque(job.prompts)] * job.users  # one queue for all
    results: list[Result] = []

    async def user(send: Send, lane: deque) -> None:
        wave = 0
        while lane:
            r = await send(lane.popleft())
            r.wave = wave
            wave += 1
            results.append(r)

    await asyncio.gather(*(user(s, lane) for s, lane in zip(sends, lanes)))
    return results


async def open_loop(send: Send, job: LoadJob) -> list[Result]:
    rng = random.Random(job.seed)
    tasks = []
    for prompt in job.prompts:
        tasks.append(asyncio.create_task(send(prompt)))
        await asyncio.sleep(rng.expovariate(job.rate))
    return list(await asyncio.gather(*tasks))


async def run_job(job: LoadJob, barrier=None) -> WorkerResult:
    """Open the connections, wait for the other client processes (`barrier`), then send the load."""
    async with AsyncExitStack() as stack:
        num_sessions = 1 if job.rate else job.users
        sends = [await stack.enter_async_context(session(job)) for _ in range(num_sessions)]
        if barrier is not None:
            await asyncio.to_thread(barrier.wait, BARRIER_TIMEOUT_S)
        cpu0, start = time.process_time(), time.perf_counter()
        results = await (open_loop(sends[0], job) if job.rate else closed_loop(sends, job))
        wall_s, cpu_s = time.perf_counter() - start, time.process_time() - cpu0
    return WorkerResult(results, start, wall_s, cpu_s, 0 if job.rate else job.users)


def _load_worker(job: LoadJob, barrier) -> WorkerResult:
    try:
        return asyncio.run(run_job(job, barrier))
    except BaseException:
        barrier.abort()  # the other client processes stop waiting for this one
        raise


def _call(index: int, fn: Callable, args: tuple, out: mp.Queue) -> None:
    try:
        out.put((index, fn(*args)))
    except BaseException as e:  # reported to the parent, which raises it
        out.put((index, RuntimeError(f"{type(e).__name__}: {e}")))


def call_in_processes(calls: list[tuple[Callable, tuple]]) -> list:
    """`fn(*args)` of each call in a fresh process ("spawn"), all at once; their results in order.
    Raises RuntimeError if one of them failed or died."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_call, args=(k, fn, args, out)) for k, (fn, args) in enumerate(calls)]
    for p in procs:
        p.start()
    answers: dict[int, object] = {}
    try:
        while len(answers) < len(procs):  # read before join: a child blocks until its result is read
            try:
                answers.update([out.get(timeout=1.0)])
            except queue.Empty:
                dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
                if dead and out.empty():
                    raise RuntimeError(f"a child process died (exit code {dead[0]})") from None
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    for a in answers.values():
        if isinstance(a, BaseException):
            raise a
    return [answers[k] for k in range(len(calls))]


def run_jobs(jobs: list[LoadJob]) -> list[WorkerResult]:
    """Each job in its own client process; they start sending together."""
    barrier = mp.get_context("spawn").Barrier(len(jobs))
    return call_in_processes([(_load_worker, (job, barrier)) for job in jobs])


def split_load(job: LoadJob, num_procs: int) -> list[LoadJob]:
    """`job` spread over up to `num_procs` processes: users (and their prompts), or the arrival rate."""
    if job.rate:
        return [replace(job, prompts=job.prompts[k::num_procs], rate=job.rate / num_procs, seed=job.seed + k)
                for k in range(num_procs) if job.prompts[k::num_procs]]
    num_procs = min(num_procs, job.users)
    users = [job.users // num_procs + (k < job.users % num_procs) for k in range(num_procs)]
    if job.requests_per_user:
        counts = [u * job.requests_per_user for u in users]
    else:
        counts = [len(job.prompts) * u // job.users for u in users]
        counts[0] += len(job.prompts) - sum(counts)
    jobs, at = [], 0
    for u, n in zip(users, counts):
        jobs.append(replace(job, users=u, prompts=job.prompts[at:at + n]))
        at += n
    return jobs
