"""AsyncClient: the specserve WebSocket protocol from Python (asyncio), many responses per socket.

    async with AsyncClient("ws://127.0.0.1:8000/v1/ws") as client:
        async with await client.create(messages=[{"role": "user", "content": "Hi"}]) as stream:
            async for event in stream:          # OutputTextDelta ..., then ResponseDone
                print(getattr(event, "delta", ""), end="")
        print(stream.done.usage)

One reader task routes server events to their response streams; a server `error` event for a
request raises `SpecserveError` from `create()` or from the stream's iteration. When the connection
ends, every pending wait (`create()`, a stream's next event) fails at once with `connection_closed`.
Every wait may be cancelled without losing events: a stream keeps what it has not handed out.
"""
from __future__ import annotations

import asyncio
import itertools
import json
import logging
from collections import deque
from collections.abc import Sequence
from typing import Any

from pydantic import ValidationError
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidStatus

from specserve.client.errors import SpecserveError
from specserve.server.protocol import (
    DoneResponse,
    ErrorEvent,
    OutputTextDelta,
    ResponseCreated,
    ResponseDone,
    SessionCreated,
    parse_server_event,
)

logger = logging.getLogger(__name__)

DEFAULT_URL = "ws://127.0.0.1:8000/v1/ws"
StreamEvent = OutputTextDelta | ResponseDone


class AsyncResponseStream:
    """One response: an async iterator of OutputTextDelta events ending with ResponseDone, and an
    async context manager that cancels the response if left before it is done."""

    def __init__(self, client: AsyncClient, response_id: str, read_timeout: float | None) -> None:
        self.id = response_id
        self.done: DoneResponse | None = None
        self._client = client
        # a deque and an Event rather than an asyncio.Queue under wait_for: a cancelled __anext__
        # (Ctrl-C in the sync client) then never takes an event it does not return
        self._items: deque[StreamEvent | SpecserveError] = deque()
        self._ready = asyncio.Event()
        self._read_timeout = read_timeout
        self._texts: dict[int, list[str]] = {}
        self._finished = False

    def _push(self, item: StreamEvent | SpecserveError) -> None:
        self._items.append(item)
        self._ready.set()

    def __aiter__(self) -> AsyncResponseStream:
        return self

    async def __anext__(self) -> StreamEvent:
        if self._finished:
            raise StopAsyncIteration
        if not self._items:
            self._ready.clear()
            try:
                await asyncio.wait_for(self._ready.wait(), self._read_timeout)
            except asyncio.TimeoutError:
                if not self._items:
                    raise SpecserveError("timeout", f"no event for response {self.id} within "
                                         f"{self._read_timeout}s", response_id=self.id) from None
        item = self._items.popleft()
        if isinstance(item, SpecserveError):
            self._finished = True
            self._client._forget(self.id)
            raise item
        if isinstance(item, ResponseDone):
            self._finished = True
            self.done = item.response
            self._client._forget(self.id)
        else:
            self._texts.setdefault(item.output_index, []).append(item.delta)
        return item

    @property
    def finished(self) -> bool:
        return self._finished

    @property
    def text(self) -> str:
        """Text received so far (of the first sample)."""
        return "".join(self._texts.get(0, []))

    def texts(self) -> list[str]:
        """Text received so far, per sample (n > 1)."""
        return ["".join(self._texts[i]) for i in sorted(self._texts)]

    async def cancel(self) -> None:
        """Ask the server to stop; the stream then ends with the server's `cancelled` ResponseDone
        (its usage counts what was generated). To stop without waiting for it, use `close()`."""
        if not self._finished:
            await self._client._send({"type": "response.cancel", "response_id": self.id})

    def close(self) -> None:
        """End the stream here and now: iteration stops, later events are dropped, `done` stays as it
        is, and a `response.cancel` goes to the server in the background if the response still runs."""
        if not self._finished:
            self._finished = True
            self._client._forget(self.id)
            self._client._cancel_soon(self.id)

    async def final(self) -> DoneResponse:
        """Read to the end; raises SpecserveError if the response failed."""
        async for _ in self:
            pass
        assert self.done is not None
        if self.done.status == "failed":
            err = self.done.error
            raise SpecserveError(err.code if err else "failed", err.message if err else "the response failed",
                                 response_id=self.id)
        return self.done

    async def __aenter__(self) -> AsyncResponseStream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        if not self._finished:  # left early: stop the server's work, drop what still comes
            self._finished = True
            self._client._forget(self.id)
            await self._client._cancel_quietly(self.id)


class AsyncClient:
    """A connection to `WS /v1/ws`. `api_key` goes in the Authorization header (or, with
    `auth_in_message=True`, in a first `session.auth` message, as browsers must do)."""

    def __init__(self, url: str = DEFAULT_URL, *, api_key: str | None = None, connect_timeout: float = 10.0,
                 read_timeout: float | None = 300.0, max_frame_size: int | None = 16 << 20,
                 auth_in_message: bool = False) -> None:
        self.url = url
        self.api_key = api_key
        self.connect_timeout = connect_timeout
        self.read_timeout = read_timeout
        self.max_frame_size = max_frame_size
        self.auth_in_message = auth_in_message
        self.session: SessionCreated | None = None
        self.errors: list[SpecserveError] = []  # error events tied to no request (e.g. a bad frame)
        self._ws: ClientConnection | None = None
        self._reader: asyncio.Task | None = None
        self._pending: dict[str, asyncio.Future] = {}
        self._streams: dict[str, AsyncResponseStream] = {}
        self._ids = itertools.count(1)
        self._closed_error: SpecserveError | None = None
        self._closing = False  # close() was called: the end of the connection is ours
        self._background: set[asyncio.Task] = set()

    # -- connection ------------------------------------------------------------------------------
    async def connect(self) -> AsyncClient:
        use_header = self.api_key and not self.auth_in_message
        headers = {"Authorization": f"Bearer {self.api_key}"} if use_header else None
        try:
            self._ws = await connect(self.url, additional_headers=headers, open_timeout=self.connect_timeout,
                                     max_size=self.max_frame_size)
        except InvalidStatus as e:
            raise _handshake_error(e) from None
        except (OSError, asyncio.TimeoutError, InvalidHandshake) as e:
            raise SpecserveError("connection_failed", f"cannot connect to {self.url}: {e}") from None
        try:
            if self.api_key and self.auth_in_message:
                await self._send({"type": "session.auth", "api_key": self.api_key})
            first = parse_server_event(await asyncio.wait_for(self._ws.recv(), self.connect_timeout))
        except asyncio.TimeoutError:
            await self._ws.close()
            hint = "" if self.api_key else " (does the server need an API key?)"
            message = f"the server sent no session.created within {self.connect_timeout}s{hint}"
            raise SpecserveError("timeout", message) from None
        except ConnectionClosed as e:
            raise SpecserveError("connection_closed", f"the server closed the connection: {e}") from None
        if isinstance(first, ErrorEvent):
            await self._ws.close()
            raise SpecserveError.from_info(first.error)
        if not isinstance(first, SessionCreated):
            await self._ws.close()
            raise SpecserveError("protocol_error", f"expected session.created, got {first.type}")
        self.session = first
        self._reader = asyncio.create_task(self._read(), name="specserve-client-reader")
        return self

    async def close(self) -> None:
        self._closing = True
        if self._ws is not None:
            await self._ws.close()
        if self._reader is not None:
            await asyncio.gather(self._reader, return_exceptions=True)

    @property
    def closed_error(self) -> SpecserveError | None:
        """Why the connection ended (a `connection_closed` error); None while it is open."""
        return self._closed_error

    async def wait_closed(self) -> SpecserveError | None:
        """Wait until the connection ends, whichever side ended it; returns `closed_error`."""
        if self._reader is not None:
            await asyncio.wait([self._reader])
        return self._closed_error

    async def __aenter__(self) -> AsyncClient:
        return await self.connect()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # -- requests --------------------------------------------------------------------------------
    async def create(self, prompt: str | Sequence[int] | None = None, *,
                     messages: Sequence[dict] | None = None,
                     max_output_tokens: int | None = None, temperature: float | None = None,
                     top_p: float | None = None, top_k: int | None = None, min_p: float | None = None,
                     seed: int | None = None, stop: str | Sequence[str] | None = None,
                     ignore_eos: bool | None = None, n: int | None = None, cache_salt: str | None = None,
                     structured_outputs: dict[str, Any] | None = None,
                     metadata: dict[str, str] | None = None) -> AsyncResponseStream:
        """Start a response; returns its stream once the server has accepted it (raises
        SpecserveError with the server's code if it refused). `structured_outputs`: one of
        {"json": schema, "regex": ..., "choice": [...], "grammar": EBNF, "json_object": True}."""
        fields = dict(prompt=list(prompt) if prompt is not None and not isinstance(prompt, str) else prompt,
                      messages=list(messages) if messages is not None else None,
                      max_output_tokens=max_output_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                      min_p=min_p, seed=seed, stop=list(stop) if isinstance(stop, (list, tuple)) else stop,
                      ignore_eos=ignore_eos, n=n, cache_salt=cache_salt, structured_outputs=structured_outputs,
                      metadata=metadata)
        event_id = f"evt_{next(self._ids)}"
        future = asyncio.get_running_loop().create_future()
        self._pending[event_id] = future
        try:
            await self._send({"type": "response.create", "event_id": event_id,
                              "response": {k: v for k, v in fields.items() if v is not None}})
            return await asyncio.wait_for(future, self.read_timeout)
        except asyncio.TimeoutError:
            raise SpecserveError("timeout", f"the server did not accept the request within "
                                 f"{self.read_timeout}s", event_id=event_id) from None
        except asyncio.CancelledError:
            if future.done() and not future.cancelled() and future.exception() is None:
                future.result().close()  # accepted, but nobody will read it: stop it on the server
            raise
        finally:
            self._pending.pop(event_id, None)

    async def generate(self, prompt: str | Sequence[int] | None = None, **kwargs: Any) -> DoneResponse:
        """Run one response to the end and return its ResponseDone payload (output text, usage...)."""
        stream = await self.create(prompt, **kwargs)
        async with stream:
            return await stream.final()

    # -- plumbing --------------------------------------------------------------------------------
    async def _send(self, payload: dict) -> None:
        if self._closed_error is not None:
            raise self._closed_error
        if self._ws is None:
            raise SpecserveError("connection_closed", "not connected: call connect() first")
        try:
            await self._ws.send(json.dumps(payload))
        except ConnectionClosed as e:
            raise SpecserveError("connection_closed", f"the connection is closed: {e}") from None

    async def _cancel_quietly(self, response_id: str) -> None:
        try:
            await self._send({"type": "response.cancel", "response_id": response_id})
        except SpecserveError:
            pass  # the socket is gone: the server cancels everything of it anyway

    def _cancel_soon(self, response_id: str) -> None:
        task = asyncio.ensure_future(self._cancel_quietly(response_id))
        self._background.add(task)  # the loop holds tasks weakly
        task.add_done_callback(self._background.discard)

    def _forget(self, response_id: str) -> None:
        self._streams.pop(response_id, None)

    async def _read(self) -> None:
        detail = ""
        try:
            async for raw in self._ws:
                try:
                    event = parse_server_event(raw)
                except ValidationError as e:
                    logger.warning("ignoring a malformed server event: %s", e)
                    continue
                self._dispatch(event)
        except ConnectionClosed as e:  # e.g. the server process died: "no close frame received or sent"
            detail = f" ({e})"
        finally:
            if self._closing:
                reason = "the client closed the connection"
            else:
                code, why = self._ws.close_code, self._ws.close_reason
                if not detail and code is not None:
                    detail = f" (code {code}: {why})" if why else f" (code {code})"
                reason = f"the server closed the connection{detail}"
            self._fail_all(SpecserveError("connection_closed", reason))

    def _dispatch(self, event) -> None:
        if isinstance(event, ResponseCreated):
            stream = AsyncResponseStream(self, event.response.id, self.read_timeout)
            future = self._pending.get(event.event_id or "")
            if future is None or future.done():  # nobody waits: cancel what we would never read
                self._cancel_soon(event.response.id)
                return
            self._streams[stream.id] = stream
            future.set_result(stream)
        elif isinstance(event, (OutputTextDelta, ResponseDone)):
            rid = event.response_id if isinstance(event, OutputTextDelta) else event.response.id
            stream = self._streams.get(rid)
            if stream is not None:
                stream._push(event)
        elif isinstance(event, ErrorEvent):
            err = SpecserveError.from_info(event.error)
            stream = self._streams.get(err.response_id or "")
            future = self._pending.get(err.event_id or "")
            if stream is not None:
                stream._push(err)
            elif future is not None and not future.done():
                future.set_exception(err)
            else:
                logger.warning("server error: %s", err)
                self.errors.append(err)

    def _fail_all(self, err: SpecserveError) -> None:
        self._closed_error = err
        for future in self._pending.values():
            if not future.done():
                future.set_exception(err)
        for stream in list(self._streams.values()):
            stream._push(err)
        self._streams.clear()


def _handshake_error(e: InvalidStatus) -> SpecserveError:
    status = e.response.status_code
    try:
        err = json.loads(e.response.body or b"{}").get("error") or {}
    except (ValueError, AttributeError):
        err = {}
    code = err.get("code") or f"http_{status}"
    return SpecserveError(code, err.get("message") or f"the server refused the connection (HTTP {status})",
                          type=err.get("type"))
