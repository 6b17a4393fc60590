"""AsyncEngine: the engine core loop in its own thread, per-request asyncio streams.

The asyncio loop never waits on compute: `generate()` validates the request on the caller's side,
hands it to the core thread through a locked inbox, and yields RequestOutputs as the core thread
pushes them with `call_soon_threadsafe`. Leaving the stream early (cancel, disconnect, break)
aborts the request; the core thread frees its KV blocks before its next step.
"""
from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import AsyncIterator

from specserve.config import EngineConfig
from specserve.engine.engine import LLMEngine, ModelInfo, PromptType
from specserve.engine.outputs import RequestOutput
from specserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    pass


class RequestFailedError(RuntimeError):
    """Engine steps failed with this request in them (the others went on)."""


class _Latest:
    """A stream's mailbox: RequestOutputs are cumulative, so a newer one replaces one not yet read
    (a consumer that falls behind holds one output, not one per step). An exception is final."""

    __slots__ = ("item", "event")

    def __init__(self) -> None:
        self.item = None
        self.event = asyncio.Event()

    def put(self, item) -> None:
        if not isinstance(self.item, BaseException):
            self.item = item
        self.event.set()

    async def get(self):
        await self.event.wait()
        item, self.item = self.item, None
        self.event.clear()
        return item


class AsyncEngine:
    def __init__(self, engine: LLMEngine | EngineConfig) -> None:
        self.engine = engine if isinstance(engine, LLMEngine) else LLMEngine(engine)
        self._cond = threading.Condition()
        self._new: list = []
        self._aborts: list[str] = []
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, _Latest]] = {}
        self._stopped = False
        self._stats = self.engine.stats()
        self.num_steps = 0
        self._thread = threading.Thread(target=self._loop, name="specserve-engine", daemon=True)
        self._thread.start()

    # -- caller side (asyncio) -------------------------------------------------------------------
    async def generate(self, prompt: PromptType, params: SamplingParams | None = None,
                       request_id: str | None = None, owner: str | None = None) -> AsyncIterator[RequestOutput]:
        """Stream cumulative RequestOutputs until finished. Raises ValueError on bad input at once,
        RequestFailedError if engine steps failed with this request. `owner` (a client request or
        socket) is the unit the scheduler shares sequence slots fairly between."""
        if self._stopped:
            raise EngineDeadError("the engine is stopped")
        group = self.engine.make_requests(request_id, prompt, params, owner=owner)
        req_id = group.request_id
        queue = _Latest()
        with self._cond:
            if req_id in self._streams:
                raise ValueError(f"request id {req_id!r} is already in use")
            self._streams[req_id] = (asyncio.get_running_loop(), queue)
            self._new.append(group)
            self._cond.notify()
        finished = False
        try:
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            if not finished:
                self.abort(req_id)
            with self._cond:
                self._streams.pop(req_id, None)

    def abort(self, request_id: str) -> None:
        with self._cond:
            self._aborts.append(request_id)
            self._cond.notify()

    def stats(self) -> dict:
        """A snapshot taken by the core thread after its latest step."""
        return dict(self._stats)

    def shutdown(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify()
        self._thread.join(timeout=30)

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def intake(self):
        """The engine's prompt intake (engine/intake.py): validate once, before a request is created."""
        return self.engine.intake

    @property
    def model_info(self) -> ModelInfo:
        return self.engine.model_info()

    # -- core thread -----------------------------------------------------------------------------
    def _loop(self) -> None:
        engine = self.engine
        while True:
            with self._cond:
                while not (self._stopped or self._new or self._aborts or engine.has_unfinished()):
                    self._cond.wait()
                if self._stopped:
                    break
                new, self._new = self._new, []
                aborts, self._aborts = self._aborts, []
            for req_id in aborts:
                engine.abort(req_id)
            for group in new:
                if group.request_id in aborts:
                    continue
                try:
                    engine.add_group(group)
                except ValueError as e:
                    self._deliver(group.request_id, e)
            if not engine.has_unfinished():
                self._stats = engine.stats()
                continue
            try:
                outputs = engine.step()  # a step that raises is isolated inside: see isolation.py
            except Exception as e:  # the isolation itself broke: fail everything, keep serving
                logger.exception("engine step failed")
                for req_id in list(engine.groups):
                    engine.abort(req_id)
                    self._deliver(req_id, EngineDeadError(f"engine step failed: {e}"))
                self._stats = engine.stats()
                continue
            self.num_steps += 1
            self._stats = engine.stats()
            for out in outputs:
                self._deliver(out.request_id, out)
            for req_id, why in engine.take_failures().items():
                self._deliver(req_id, RequestFailedError(f"the engine failed this request: {why}"))
        with self._cond:
            streams = list(self._streams)
        for req_id in streams:
            self._deliver(req_id, EngineDeadError("the engine was shut down"))

    def _deliver(self, req_id: str, item) -> None:
        with self._cond:
            target = self._streams.get(req_id)
        if target is None:
            return
        loop, queue = target
        try:
            loop.call_soon_threadsafe(queue.put, item)
        except RuntimeError:  # the caller's loop is closed
            pass
