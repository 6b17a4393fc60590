"""Step isolation: when an engine step raises, find the request that makes steps fail and end only it.

A failed step leaves the state of its requests unknown (KV partly written, full blocks registered in
the prefix cache before their KV existed, a sampled token still in flight). So after a failure every
running request goes back to waiting with no KV (it is recomputed, with its known tokens), a token in
flight is dropped, and the prefix cache forgets every block no request holds. The requests of the
failed step (and of the step that was in flight) are suspects, searched by bisection: the scheduler
runs only the first set of `Scheduler.isolate`, in synchronous steps of its own.

- A set whose unfinished requests have each sampled once without a failure is cleared.
- A set that fails is split in halves; a single request that fails is ended. A request that was in
  MAX_FAILED_STEPS failed ordinary (not isolated) steps is ended whatever the search says: a fault
  that needs company passes every search, and this bounds the retries (requests that happened to run
  beside it in all of those steps end too).
- Ended requests and their errors come out of `take_failures()`; the engine logs each failure.

Requests that were not suspects only wait a few steps and are recomputed. With seeded sampling a
request that was in the failed step may continue with other draws than an undisturbed run (its
in-flight token is drawn again); greedy output is unchanged.
"""
from __future__ import annotations

import logging
from collections import Counter
from typing import TYPE_CHECKING

from specserve.engine.request import RequestStatus

if TYPE_CHECKING:
    from specserve.engine.engine import LLMEngine
    from specserve.engine.outputs import SchedulerOutput

logger = logging.getLogger(__name__)

MAX_FAILED_STEPS = 3


class StepIsolation:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.num_failed_steps = 0
        self.num_failed_requests = 0
        self._failures: dict[str, str] = {}  # user request id -> why, not yet taken
        self._failed_steps: Counter[str] = Counter()  # per request id
        self._unsampled: set[str] = set()  # members of the current set that have not sampled yet

    def take_failures(self) -> dict[str, str]:
        out, self._failures = self._failures, {}
        return out

    def step_failed(self, exc: Exception, stepping: tuple[SchedulerOutput, SchedulerOutput | None] | None
                    ) -> None:
        """`stepping`: the failed step's schedule and the one in flight then (None: schedule() failed)."""
        engine, sched = self.engine, self.engine.scheduler
        self.num_failed_steps += 1
        live = set(sched.requests)
        if stepping is None:  # schedule() itself failed: every request is a suspect
            suspects = set(live)
        else:
            suspects = {s.request.request_id for out in stepping if out is not None for s in out.scheduled} & live
        logger.error("engine step failed with %d request(s) (%s: %s); isolating the cause",
                     len(suspects), type(exc).__name__, exc, exc_info=exc)
        engine._inflight = None
        sched.reset([r.request_id for r in sched.running] + sorted(suspects))
        engine.kv_manager.reset_prefix_cache()
        isolating = bool(sched.isolate)
        untested = (sched.isolate.pop(0) - suspects) & live if isolating else set()
        message = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        if not isolating:
            for req_id in suspects:
                self._failed_steps[req_id] += 1
        culprits = {r for r in suspects if self._failed_steps[r] >= MAX_FAILED_STEPS}
        if len(suspects) == 1:
            culprits = suspects
        for req_id in culprits:
            self._fail(req_id, message)
        rest = self._in_arrival_order((suspects - culprits) & set(sched.requests))
        half = (len(rest) + 1) // 2
        sets = [set(part) for part in (rest[:half], rest[half:], untested) if part]
        sched.isolate[:0] = sets
        self._start_set()

    def step_passed(self, out: SchedulerOutput) -> None:
        """A step of the current set ran (called only while isolating)."""
        sched = self.engine.scheduler
        self._unsampled -= {s.request.request_id for s in out.scheduled if s.sample}
        self._unsampled &= set(sched.requests)  # finished or aborted meanwhile
        if not self._unsampled:
            sched.isolate.pop(0)
            self._start_set()

    def _start_set(self) -> None:
        sched = self.engine.scheduler
        live = set(sched.requests)
        while sched.isolate and not sched.isolate[0] & live:
            sched.isolate.pop(0)
        if sched.isolate:
            sched.isolate[0] &= live
            self._unsampled = set(sched.isolate[0])
        else:
            self._unsampled = set()

    def _fail(self, req_id: str, message: str) -> None:
        engine = self.engine
        group = engine._child_to_group.get(req_id)
        group_id = group.request_id if group is not None else req_id
        ids = {c.request_id for c in group.children} if group is not None else {req_id}
        logger.error("request %s failed: steps with it raise (%s)", group_id, message)
        self._failures[group_id] = message
        self.num_failed_requests += 1
        for s in engine.scheduler.isolate:
            s -= ids
        if group is not None:
            engine.abort(group_id)
        else:
            engine.scheduler.finish_request(req_id, RequestStatus.FINISHED_ABORTED)

    def _in_arrival_order(self, req_ids: set[str]) -> list[str]:
        requests = self.engine.scheduler.requests
        return sorted(req_ids, key=lambda r: (requests[r].arrival_time, r))

