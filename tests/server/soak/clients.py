"""The soak's clients: a WebSocket connection that runs many responses at once (`WsConn`, with its bad
frames), the SSE and plain-HTTP requests of both OpenAI endpoints, and the random request specs. Each
records how its response ended as an `Outcome`."""
from __future__ import annotations

import asyncio
import json
import random
from collections import Counter

import httpx
import websockets
from websockets.exceptions import ConnectionClosed

from tests.server.soak.common import EVENT_TIMEOUT_S, FAULT_SEED, PROMPT_CHARS, Outcome

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
