"""AsyncEngine: per-request asyncio streams over an engine core (engine/core.py).

The core runs in its own process (`AsyncEngine(config)`, the server's way: engine/core_process.py)
or in a thread of this one (`AsyncEngine(llm_engine)`, for an engine the caller built). Either way
the asyncio loop never waits on compute: `generate()` validates the prompt here (the intake), sends
the request to the core, and yields cumulative RequestOutputs as the core's per-step messages come
in. Text is made here (output_processor.py), and only when a stream reads: a reader that falls behind
gets one output holding everything since its last read. Leaving a stream early (cancel, disconnect,
break) aborts its request; the core frees its KV blocks before its next step.
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING

from specserve.config import EngineConfig
from specserve.engine.core import EngineCore
from specserve.engine.engine import LLMEngine, PromptType
from specserve.engine.intake import Intake
from specserve.engine.messages import Abort, AddRequest, CoreInput, ModelInfo, Shutdown, StepOutput, StopSample
from specserve.engine.output_processor import OutputProcessor
from specserve.engine.outputs import RequestOutput
from specserve.sampling_params import SamplingParams

if TYPE_CHECKING:
    from specserve.engine.core_process import CoreHandle

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine core is gone (its process died, or it was shut down): error code `engine_dead`."""


class RequestFailedError(RuntimeError):
    """Engine steps failed with this request in them (the others went on)."""


class _Mailbox:
    """A stream's news flag: set when the core reported tokens (any number of steps' worth) for the
    request, or to an exception, which is final."""

    __slots__ = ("error", "event")

    def __init__(self) -> None:
        self.error: BaseException | None = None
        self.event = asyncio.Event()

    def fail(self, error: BaseException) -> None:
        if self.error is None:
            self.error = error
        self.event.set()

    async def wait(self) -> None:
        await self.event.wait()
        self.event.clear()
        if self.error is not None:
            raise self.error


class CoreThread:
    """Transport: the engine core in a daemon thread of this process."""

    client = 0

    def __init__(self, engine: LLMEngine, on_output: Callable[[StepOutput], None],
                 on_dead: Callable[[str], None]) -> None:
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._core = EngineCore(engine)
        self._on_output, self._on_dead = on_output, on_dead
        self._thread = threading.Thread(target=self._run, name="specserve-engine", daemon=True)
        self._thread.start()

    def send(self, msg: CoreInput) -> None:
        self._inbox.put(msg)

    def shutdown(self, timeout: float = 30.0) -> None:
        self._inbox.put(Shutdown())
        self._thread.join(timeout)

    def _receive(self, block: bool) -> list[CoreInput]:
        msgs = [self._inbox.get()] if block else []
        while True:
            try:
                msgs.append(self._inbox.get_nowait())
            except queue.Empty:
                return msgs

    def _run(self) -> None:
        try:
            self._core.run(self._receive, lambda client, out: self._on_output(out))
        except BaseException as e:  # noqa: BLE001 - reported to every stream, then the thread ends
            logger.exception("the engine thread died")
            self._on_dead(f"the engine thread died: {type(e).__name__}: {e}")
            return
        self._on_dead("the engine was shut down")


class AsyncEngine:
    def __init__(self, engine: LLMEngine | EngineConfig | CoreHandle, *,
                 on_dead: Callable[[str], None] | None = None, log_level: str = "WARNING") -> None:
        """`engine`: an LLMEngine to run in a thread; an EngineConfig to build and run in an engine
        core process (started here; this returns once it is ready, or raises why it failed); or the
        handle of a core process started elsewhere (core_process.CoreHandle), to attach to.
        `on_dead(reason)` is called (from another thread) if the core dies while in use."""
        self._streams: dict[str, _Mailbox] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stats: dict = {}
        self._dead: str | None = None
        self._on_dead_cb = on_dead
        if isinstance(engine, LLMEngine):
            self.tokenizer = engine.tokenizer
            self.model_info: ModelInfo = engine.model_info()
            self.engine: LLMEngine | None = engine
            self._stats = engine.stats()
            self.warmup_seconds = engine.warmup_seconds
            self.outputs = OutputProcessor(self.tokenizer)
            self._core = CoreThread(engine, self._on_output, self._on_dead)
        else:
            from specserve.engine.core_process import CoreClient, CoreHandle, CoreProcess

            self.engine = None
            if isinstance(engine, CoreHandle):  # a core another process started (--api-server-count)
                self._core = CoreClient(engine, self._on_output, self._on_dead)
            else:
                owner = CoreProcess(engine, log_level=log_level)
                self._core = CoreClient(owner.handle(), self._on_output, self._on_dead, owner=owner)
            self.tokenizer, self.model_info = self._core.tokenizer, self._core.model_info
            self._stats = self._core.stats
            self.warmup_seconds = self._core.warmup_seconds
            self.outputs = OutputProcessor(self.tokenizer)
        info = self.model_info
        self.intake = Intake(self.tokenizer, info.vocab_size, info.max_model_len, info.max_logprobs)

    @property
    def dead(self) -> str | None:
        """Why the engine core is gone, or None while it runs."""
        return self._dead

    @property
    def pid(self) -> int | None:
        """The engine core process's pid (None for an engine in a thread)."""
        return getattr(self._core, "pid", None)

    # -- caller side (asyncio) -------------------------------------------------------------------
    async def generate(self, prompt: PromptType, params: SamplingParams | None = None,
                       request_id: str | None = None, owner: str | None = None) -> AsyncIterator[RequestOutput]:
        """Stream cumulative RequestOutputs until finished. Raises ValueError on bad input at once,
        RequestFailedError if engine steps failed with this request, EngineDeadError if the core is
        gone. `owner` (a client request or socket) is the unit the scheduler shares sequence slots
        fairly between."""
        if self._dead is not None:
            raise EngineDeadError(self._dead)
        params = params or SamplingParams()
        validated = self.intake.prompt(prompt)
        self.intake.check_params(params)
        req_id = request_id or uuid.uuid4().hex
        self._bind_loop()
        if req_id in self._streams:
            raise ValueError(f"request id {req_id!r} is already in use")
        mailbox = _Mailbox()
        self.outputs.add(req_id, validated, params)
        self._streams[req_id] = mailbox
        finished = False
        try:
            self._core.send(AddRequest(req_id, validated.token_ids, params, owner, time.monotonic(),
                                       self._core.client))
            while True:
                await mailbox.wait()
                if req_id not in self.outputs:
                    continue
                out = self.outputs.output(req_id)
                finished = out.finished
                yield out
                if finished:
                    return
        except (RequestFailedError, EngineDeadError, ValueError):
            finished = True  # the core has forgotten it
            raise
        finally:
            self._streams.pop(req_id, None)
            self.outputs.remove(req_id)
            if not finished:
                self.abort(req_id)

    def abort(self, request_id: str) -> None:
        if self._dead is None:
            self._core.send(Abort([request_id]))

    def stats(self) -> dict:
        """A snapshot the core took after its latest step."""
        return dict(self._stats)

    def shutdown(self) -> None:
        """Stop the core (requests still running are aborted) and end every stream with EngineDeadError."""
        self._core.shutdown()
        self._on_dead("the engine was shut down")

    def _bind_loop(self) -> None:
        loop = asyncio.get_running_loop()
        if self._loop is not loop:
            if self._streams:
                raise RuntimeError("this AsyncEngine is streaming on another event loop")
            self._loop = loop

    # -- the core's messages (another thread) ----------------------------------------------------
    def _on_output(self, out: StepOutput) -> None:
        if out.stats is not None:
            self._stats = out.stats
        if (out.updates or out.failed or out.rejected) and self._loop is not None:
            try:
                self._loop.call_soon_threadsafe(self._dispatch, out)
            except RuntimeError:  # the loop is closed: nobody is streaming
                pass

    def _dispatch(self, out: StepOutput) -> None:
        """On the loop: take the step's tokens in, wake the streams that got news."""
        stops = []
        for u in out.updates:
            mailbox = self._streams.get(u.request_id)
            if mailbox is None:
                continue
            _, ended = self.outputs.process(u)
            stops += ended
            mailbox.event.set()
        for sid, stop in stops:
            self._core.send(StopSample(sid, stop))
        for req_id, why in out.failed.items():
            if req_id in self._streams:
                self._streams[req_id].fail(RequestFailedError(f"the engine failed this request: {why}"))
        for req_id, why in out.rejected.items():
            if req_id in self._streams:
                self._streams[req_id].fail(ValueError(why))

    def _on_dead(self, reason: str) -> None:
        first = self._dead is None
        self._dead = self._dead or reason
        loop = self._loop
        if loop is not None:
            try:
                loop.call_soon_threadsafe(self._fail_all)
            except RuntimeError:
                pass
        if first and self._on_dead_cb is not None and reason != "the engine was shut down":
            self._on_dead_cb(reason)

    def _fail_all(self) -> None:
        for mailbox in list(self._streams.values()):
            mailbox.fail(EngineDeadError(self._dead))
