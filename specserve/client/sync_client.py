"""Client: the synchronous face of AsyncClient (its event loop runs in a daemon thread).

    with Client("ws://127.0.0.1:8000/v1/ws") as client:
        with client.create("Once upon a time", max_output_tokens=32) as stream:
            for event in stream:
                print(getattr(event, "delta", ""), end="", flush=True)
        print(stream.done.metrics.ttft_ms)

Every call waits in short slices, so Ctrl-C (KeyboardInterrupt) reaches it at once on any OS; the
interrupted call's coroutine is cancelled with it, so no orphaned read goes on taking events. A
dead connection fails every waiting call at once (`SpecserveError("connection_closed")`).
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Callable, Coroutine, Sequence
from typing import Any, TypeVar

from specserve.client.async_client import DEFAULT_URL, AsyncClient, AsyncResponseStream, StreamEvent
from specserve.client.errors import SpecserveError
from specserve.server.protocol import DoneResponse, SessionCreated

T = TypeVar("T")
POLL_S = 0.1  # how often a waiting call wakes up (to take a KeyboardInterrupt, to see a dead loop thread)


class ResponseStream:
    """An iterator of OutputTextDelta events ending with ResponseDone; a context manager that
    cancels the response if left before it is done."""

    def __init__(self, client: Client, stream: AsyncResponseStream) -> None:
        self._client = client
        self._stream = stream

    @property
    def id(self) -> str:
        return self._stream.id

    @property
    def done(self) -> DoneResponse | None:
        return self._stream.done

    @property
    def finished(self) -> bool:
        return self._stream.finished

    @property
    def text(self) -> str:
        return self._stream.text

    def texts(self) -> list[str]:
        return self._stream.texts()

    def __iter__(self) -> ResponseStream:
        return self

    def __next__(self) -> StreamEvent:
        try:
            return self._client._run(self._stream.__anext__())
        except StopAsyncIteration:
            raise StopIteration from None

    def cancel(self) -> None:
        """Ask the server to stop; iteration then ends with the server's `cancelled` ResponseDone.
        To stop without waiting for it (Ctrl-C in a terminal), use `close()`."""
        self._client._run(self._stream.cancel())

    def close(self) -> None:
        """End the stream here and now (iteration stops, later events are dropped) and ask the server,
        without waiting, to stop the response if it still runs."""
        self._client._run(_call(self._stream.close))

    def final(self) -> DoneResponse:
        return self._client._run(self._stream.final())

    def __enter__(self) -> ResponseStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self._client._run(self._stream.__aexit__(*exc))


class Client:
    """Connects on construction; same arguments as AsyncClient."""

    def __init__(self, url: str = DEFAULT_URL, *, api_key: str | None = None, connect_timeout: float = 10.0,
                 read_timeout: float | None = 300.0, max_frame_size: int | None = 16 << 20,
                 auth_in_message: bool = False) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="specserve-client", daemon=True)
        self._thread.start()
        self._async = AsyncClient(url, api_key=api_key, connect_timeout=connect_timeout,
                                  read_timeout=read_timeout, max_frame_size=max_frame_size,
                                  auth_in_message=auth_in_message)
        self._closed = threading.Event()
        try:
            self._run(self._async.connect())
        except BaseException:
            self._stop_loop()
            raise
        watch = asyncio.run_coroutine_threadsafe(self._async.wait_closed(), self._loop)
        watch.add_done_callback(lambda _: self._closed.set())

    def _run(self, coro: Coroutine[Any, Any, T], discard: Callable[[T], object] | None = None) -> T:
        """Run `coro` on the loop thread and wait for it. If the wait is interrupted, the coroutine is
        cancelled; a result it produced all the same goes to `discard` (on the loop thread)."""
        if self._loop.is_closed():
            coro.close()
            raise SpecserveError("connection_closed", "the client is closed")
        future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            while True:
                try:
                    return future.result(timeout=POLL_S)
                except concurrent.futures.TimeoutError:
                    if future.done():  # the coroutine's own TimeoutError (the same class since 3.11)
                        raise
                    if not self._thread.is_alive():
                        raise SpecserveError("connection_closed", "the client's event loop stopped") from None
        except BaseException:
            if not future.cancel() and discard is not None:
                try:
                    result = future.result(timeout=1.0)
                except BaseException:  # it failed, or never finished: nothing to discard
                    pass
                else:
                    self._loop.call_soon_threadsafe(discard, result)
            raise

    @property
    def session(self) -> SessionCreated | None:
        return self._async.session

    @property
    def closed_error(self) -> SpecserveError | None:
        """Why the connection ended (a `connection_closed` error); None while it is open."""
        return self._async.closed_error

    def wait_closed(self, timeout: float | None = None) -> SpecserveError | None:
        """Block until the connection ends (either side, or it broke) or `timeout` passes; returns
        `closed_error` (None if still open). For a thread that watches an idle connection."""
        self._closed.wait(timeout)
        return self.closed_error

    def create(self, prompt: str | Sequence[int] | None = None, **kwargs: Any) -> ResponseStream:
        """Start a response (arguments as AsyncClient.create)."""
        return ResponseStream(self, self._run(self._async.create(prompt, **kwargs),
                                              discard=AsyncResponseStream.close))

    def generate(self, prompt: str | Sequence[int] | None = None, **kwargs: Any) -> DoneResponse:
        """Run one response to the end; returns its ResponseDone payload."""
        return self._run(self._async.generate(prompt, **kwargs))

    def close(self) -> None:
        if self._loop.is_closed():
            return
        try:
            self._run(self._async.close())
        finally:
            self._stop_loop()
            self._closed.set()

    def _stop_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)
        self._loop.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


async def _call(fn: Callable[[], T]) -> T:
    """Run a plain function on the loop thread (through Client._run)."""
    return fn()
