"""Client: the synchronous face of AsyncClient (its event loop runs in a daemon thread).

    with Client("ws://127.0.0.1:8000/v1/ws") as client:
        with client.create("Once upon a time", max_output_tokens=32) as stream:
            for event in stream:
                print(getattr(event, "delta", ""), end="", flush=True)
        print(stream.done.metrics.ttft_ms)
"""
from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine, Sequence
from typing import Any, TypeVar

from specserve.client.async_client import DEFAULT_URL, AsyncClient, AsyncResponseStream, StreamEvent
from specserve.server.protocol import DoneResponse, SessionCreated

T = TypeVar("T")


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
        """Ask the server to stop; iteration then ends with a `cancelled` ResponseDone."""
        self._client._run(self._stream.cancel())

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
        try:
            self._run(self._async.connect())
        except BaseException:
            self._stop_loop()
            raise

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    @property
    def session(self) -> SessionCreated | None:
        return self._async.session

    def create(self, prompt: str | Sequence[int] | None = None, **kwargs: Any) -> ResponseStream:
        """Start a response (arguments as AsyncClient.create)."""
        return ResponseStream(self, self._run(self._async.create(prompt, **kwargs)))

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

    def _stop_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)
        self._loop.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
