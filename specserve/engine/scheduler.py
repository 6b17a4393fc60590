"""Continuous batching under one token budget, with chunked prefill and preemption by recompute.

Every step, running requests are served first (in admission order), then waiting ones are admitted
while the budget, `max_num_seqs` and free KV blocks allow. A request is just "N more tokens to
compute": prefill chunks, prefix-cache hits, decodes and draft verification all fit that one rule.
When a running request cannot get a block, the most recently admitted request is preempted: its
blocks are freed (they stay in the prefix cache) and it is recomputed later, with the same output.
A request with `SamplingParams.n > 1` is prefilled once; at its first sample it forks into its
children, which share its prompt blocks by reference (copy-on-write, see KVCacheManager.fork).

Fairness between owners (a server sets `Request.owner` to the client request or socket; offline
requests share one owner): waiting requests are admitted owner with the fewest running requests first,
arrival order among equals; and when every sequence slot is taken and a request of an owner with none
running waits, the newest running request of the owner holding the most is preempted to make room.
So one huge request delays a newcomer's admission by at most a step, never until it ends.

Isolation: while `isolate` holds sets of request ids (the engine's search for a request that makes
steps fail), only requests of the first set are scheduled.
"""
from __future__ import annotations

import time
from collections import Counter, deque
from collections.abc import Callable, Iterable

from specserve.cache.kv_cache_manager import KVCacheManager
from specserve.config import SchedulerConfig
from specserve.engine.outputs import DRAFT_PLACEHOLDER, ModelRunnerOutput, ScheduledRequest, SchedulerOutput
from specserve.engine.request import Request, RequestStatus


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager, num_lookahead_tokens: int = 0) -> None:
        assert config.max_num_batched_tokens is not None, "the builder resolves the token budget (with_device_defaults)"
        self.config = config
        self.kv = kv
        self.waiting: deque[Request] = deque()
        self._waiting_owners: Counter = Counter()  # owner -> its requests in `waiting` (kept by _enqueue/_dequeue)
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self._finished_ids: set[str] = set()
        self.num_preemptions = 0
        # KV slots past the scheduled tokens a speculative proposer writes (a draft model's own drafts)
        self.num_lookahead_tokens = num_lookahead_tokens
        self.isolate: list[set[str]] = []
        self._reset_ids: set[str] = set()  # sent back to waiting by `reset`: reported as preempted

    # -- requests --------------------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        self.requests[request.request_id] = request
        self._enqueue(request)

    def finish_request(self, req_id: str, status: RequestStatus, stop_reason: int | str | None = None) -> None:
        """Finish (stop, length, abort) a request; its blocks return to the pool now."""
        request = self.requests.pop(req_id, None)
        if request is None:
            return
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        elif request in self.waiting:
            self._dequeue(request)
        request.status = status
        request.stop_reason = stop_reason
        request.finished_time = time.monotonic()
        request.spec_token_ids = []
        request.forks = []
        self.kv.forget(req_id)
        self._finished_ids.add(req_id)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    # -- scheduling ------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        max_len = self.config.max_model_len
        allowed = self.isolate[0] if self.isolate else None
        out.preempted_req_ids |= self._reset_ids
        self._reset_ids = set()
        if allowed is None:
            self._make_room_for_newcomer(out)
        kv_preempted = False

        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            if allowed is not None and request.request_id not in allowed:
                i += 1
                continue
            if request.num_pending and self._ends_by_length(request):
                i += 1  # its in-flight token is its last: nothing more to compute
                continue
            num_new = min(request.num_tokens_with_spec - request.num_computed_tokens, budget,
                          max_len - request.num_computed_tokens)
            if num_new <= 0:
                i += 1
                continue
            while not self.kv.allocate_slots(request.request_id, request.num_computed_tokens,
                                             self._with_lookahead(request.num_computed_tokens, num_new)):
                victim = self.running.pop()
                self._preempt(victim)
                out.preempted_req_ids.add(victim.request_id)
                kv_preempted = True
                if victim is request:
                    break
            if request.status != RequestStatus.RUNNING:
                break
            out.scheduled.append(self._scheduled(request, num_new))
            budget -= num_new
            i += 1

        if not kv_preempted:
            budget = self._admit(out, budget, allowed)
        out.num_batched_tokens = self.config.max_num_batched_tokens - budget
        out.block_copies = self.kv.take_copies()
        out.finished_req_ids, self._finished_ids = self._finished_ids, set()
        return out

    def schedule_ahead(self, prev: SchedulerOutput, ks: list[int],
                       admissible: Callable[[Request], bool]) -> SchedulerOutput | None:
        """The step after `prev`, scheduled while prev's verification is still on the device (async
        drafting): each of prev's requests computes 1 + k tokens (`ks`, in prev's order: the drafts
        prev's step made for it on the device, maybe none; those that ended since prev was scheduled
        are left out), placed where the request stands if every draft of prev is accepted. The runner
        moves each request back on the device by the drafts prev rejected (`ModelRunner.launch`), and
        its books once prev's tokens are known (`settle_ahead`).
        Near max_tokens a request still verifies all its drafts: tokens past its end are dropped, as
        past a stop token (and its work here is, where prev ends it); its drafts are cut where their
        positions would pass max_model_len. Waiting requests are admitted behind prev's (their prompts
        are known), as `schedule` admits them, while `admissible` accepts them (the runner verifies
        the step on the device: plain greedy requests only). Only for a drafting batch's steady state:
        None when the next waiting request is not admissible, all sequence slots are taken while an
        owner with nothing running waits (`schedule` may preempt for it), isolation runs, prev left a
        running request out, prev may end every request by its length (the step would compute nothing
        kept: one request's last step), a request's next position may lie past max_model_len, or the
        budget or KV blocks fall short of prev's requests (blocks allocated by then stay with their
        requests: later steps use them)."""
        # prev's requests that go on (some may have ended in the step before it, collected since)
        kept = [(s, k) for s, k in zip(prev.scheduled, ks, strict=True) if not s.request.is_finished]
        if self.isolate or self._reset_ids or len(kept) != len(self.running) or self._may_preempt():
            return None
        if self.waiting and len(self.running) < self.config.max_num_seqs:
            first = self._next_waiting(Counter(r.owner for r in self.running), None)
            if first is not None and not admissible(first):
                return None  # `schedule` admits it next step (never left behind admitted ones)
        max_len = self.config.max_model_len
        cut, may_all_end = [], True
        for s, k in kept:
            request = s.request
            start = s.start + s.num_tokens  # every draft of prev accepted
            if request.status != RequestStatus.RUNNING or start >= max_len:
                return None
            cut.append(min(k, max_len - start - 1))
            may_all_end = may_all_end and request.room(max_len) <= len(s.spec_token_ids) + 1
        if may_all_end:
            return None
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens - sum(1 + k for k in cut)
        if budget < 0:
            return None
        for (s, _), k in zip(kept, cut):
            request = s.request
            start = s.start + s.num_tokens  # every draft accepted
            lowest = start - len(s.spec_token_ids)  # none accepted: copy-on-write from there
            end = start + self._with_lookahead(start, 1 + k)
            if not self.kv.allocate_slots(request.request_id, lowest, end - lowest):
                return None
            # the full blocks of known tokens (registered as a step fills them: `_scheduled`)
            self.kv.cache_blocks(request.request_id, request.all_token_ids, request.num_tokens,
                                 request.sampling_params.cache_salt)
            out.scheduled.append(ScheduledRequest(request=request, start=start, num_tokens=1 + k,
                                                  spec_token_ids=[DRAFT_PLACEHOLDER] * k,
                                                  block_ids=self.kv.block_ids(request.request_id), sample=True))
        budget = self._admit(out, budget, None, admissible)
        out.num_batched_tokens = self.config.max_num_batched_tokens - budget
        out.block_copies = self.kv.take_copies()
        out.finished_req_ids, self._finished_ids = self._finished_ids, set()
        return out

    def _admit(self, out: SchedulerOutput, budget: int, allowed: set[str] | None,
               admissible: Callable[[Request], bool] | None = None) -> int:
        """Admit waiting requests into `out` while the budget, sequence slots and KV blocks last (of
        the owner with the fewest running requests first: `_next_waiting`); stops at the first one
        that `admissible` refuses. Returns the budget left."""
        now = time.monotonic()
        running_of = Counter(r.owner for r in self.running) if self.waiting else Counter()
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self._next_waiting(running_of, allowed)
            if request is None or (admissible is not None and not admissible(request)):
                break
            if self.running and len(self.running) + 1 + len(request.forks) > self.config.max_num_seqs:
                break  # keep room for the children it forks into (SamplingParams.n)
            assert request.num_computed_tokens == 0, "waiting requests hold no KV"
            assert request.num_pending == 0, "a preempted request's last token is known before it returns"
            hits, num_hit = self.kv.get_computed_blocks(
                request.request_id, request.all_token_ids, request.sampling_params.cache_salt)
            num_new = min(request.num_tokens - num_hit, budget)  # cached tokens cost no budget
            if not self.kv.allocate_slots(request.request_id, num_hit,
                                          self._with_lookahead(num_hit, num_new), hits):
                break
            self.kv.record_prefix_lookup(request.num_tokens, num_hit)
            self._dequeue(request)
            running_of[request.owner] += 1
            request.num_computed_tokens = num_hit
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_hit
                request.first_scheduled_time = now
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            out.scheduled.append(self._scheduled(request, num_new))
            budget -= num_new
        return budget

    def _may_preempt(self) -> bool:
        """Could `schedule` now preempt a running request to make room for a waiting one (every
        sequence slot taken while an owner with nothing running waits: `_make_room_for_newcomer`)?"""
        if not self.waiting or len(self.running) < self.config.max_num_seqs:
            return False
        running = {r.owner for r in self.running}
        return any(owner not in running for owner in self._waiting_owners)

    def _next_waiting(self, running_of: Counter, allowed: set[str] | None) -> Request | None:
        """The waiting request to admit next: of the owner with the fewest running requests, the
        earliest (so one owner's backlog never stands in front of another's first request)."""
        best, best_count, seen = None, None, set()
        for request in self.waiting:
            if request.num_pending or (allowed is not None and request.request_id not in allowed):
                continue  # preempted with a token in flight: admitted once it is known
            if request.owner in seen:
                continue  # an owner's later requests never beat its first one
            seen.add(request.owner)
            count = running_of[request.owner]
            if best is None or count < best_count:
                best, best_count = request, count
                if count == 0:
                    break
            if len(seen) == len(self._waiting_owners):
                break  # every owner's first request seen: one owner (offline) stops at the queue's head
        return best

    def _make_room_for_newcomer(self, out: SchedulerOutput) -> None:
        """All sequence slots taken and an owner with nothing running waits: preempt the newest
        request of the owner running the most (if that owner runs more than one)."""
        if len(self.running) < self.config.max_num_seqs or not self.waiting:
            return
        running_of = Counter(r.owner for r in self.running)
        newcomers = {owner for owner in self._waiting_owners if running_of[owner] == 0}
        if not newcomers or not any(r.owner in newcomers and not r.num_pending for r in self.waiting):
            return
        heavy, count = running_of.most_common(1)[0]
        if count < 2:
            return
        victim = next(r for r in reversed(self.running) if r.owner == heavy)
        self.running.remove(victim)
        self._preempt(victim)
        out.preempted_req_ids.add(victim.request_id)

    def reset(self, req_ids: Iterable[str]) -> None:
        """Send these requests back to waiting with no KV (recomputed later), dropping a token still in
        flight: the engine's recovery after a failed step. Keeps arrival order."""
        ids = set(req_ids)
        for request in reversed([r for r in self.running if r.request_id in ids]):
            self.running.remove(request)
            self._preempt(request)
        for request in self.waiting:
            if request.request_id in ids:
                request.num_pending = 0
                request.spec_token_ids = []
                self._reset_ids.add(request.request_id)

    def _with_lookahead(self, num_computed: int, num_new: int) -> int:
        """Slots to allocate for `num_new` tokens: plus the proposer's lookahead, within max_model_len."""
        room = self.config.max_model_len - num_computed
        return max(num_new, min(num_new + self.num_lookahead_tokens, room))

    def _ends_by_length(self, request: Request) -> bool:
        """Will the request's in-flight tokens reach max_tokens / max_model_len?"""
        return request.room(self.config.max_model_len) <= 0

    def _scheduled(self, request: Request, num_new: int) -> ScheduledRequest:
        end = request.num_computed_tokens + num_new
        num_spec = max(0, end - request.num_tokens - request.num_pending)
        if num_spec < len(request.spec_token_ids):
            request.spec_token_ids = request.spec_token_ids[:num_spec]  # budget cut the drafts short
        # Register the full blocks this step fills (known tokens only, never drafts) now, so requests
        # admitted later in this same step already hit them (kv_cache_manager.py: the contract).
        self.kv.cache_blocks(request.request_id, request.all_token_ids, min(end, request.num_tokens),
                             request.sampling_params.cache_salt)
        return ScheduledRequest(request=request, start=request.num_computed_tokens, num_tokens=num_new,
                                spec_token_ids=list(request.spec_token_ids),
                                block_ids=self.kv.block_ids(request.request_id),
                                sample=end >= request.num_tokens + request.num_pending)

    def _preempt(self, request: Request) -> None:
        self.kv.free(request.request_id)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.spec_token_ids = []
        request.num_preemptions += 1
        self.num_preemptions += 1
        self._enqueue(request, front=True)

    def _enqueue(self, request: Request, front: bool = False) -> None:
        (self.waiting.appendleft if front else self.waiting.append)(request)
        self._waiting_owners[request.owner] += 1

    def _dequeue(self, request: Request) -> None:
        self.waiting.remove(request)
        self._waiting_owners[request.owner] -= 1
        if not self._waiting_owners[request.owner]:
            del self._waiting_owners[request.owner]

    # -- results ---------------------------------------------------------------------------------
    def advance(self, sched: SchedulerOutput) -> None:
        """The step is launched: its tokens count as computed, and each request that samples has one
        token in flight (async scheduling may schedule the next step before `resolve`)."""
        for s in sched.scheduled:
            request = s.request
            if request.status == RequestStatus.RUNNING:
                request.num_computed_tokens = s.start + s.num_tokens
                request.num_pending += s.sample

    def resolve(self, sched: SchedulerOutput, result: ModelRunnerOutput) -> list[Request]:
        """The step's results are back: append sampled tokens (rolling back rejected drafts), apply
        stop rules; returns requests with news. A request preempted since `advance` still gets its
        token (it was sampled from valid KV); a finished or aborted one gets nothing."""
        changed = []
        now = time.monotonic()
        for s in sched.scheduled:
            request = s.request
            if not s.sample or request.status not in (RequestStatus.RUNNING, RequestStatus.PREEMPTED):
                continue  # no token, or finished / aborted meanwhile
            request.num_pending -= 1
            new_ids = result.sampled_token_ids.get(request.request_id)
            if not new_ids:
                continue
            forked = self._fork_children(request, result) if request.forks else []
            if s.spec_token_ids:
                accepted = result.num_accepted.get(request.request_id, len(new_ids) - 1)
                request.num_computed_tokens -= len(s.spec_token_ids) - accepted  # roll back rejected
                request.spec.num_drafts += 1
                request.spec.num_draft_tokens += len(s.spec_token_ids)
                request.spec.num_accepted_tokens += accepted
            request.spec_token_ids = []
            for r in (request, *forked):
                self._append_tokens(r, result, now)
                changed.append(r)
        return changed

    def _append_tokens(self, request: Request, result: ModelRunnerOutput, now: float) -> None:
        if request.first_token_time is None:
            request.first_token_time = now
        logprobs = result.logprobs.get(request.request_id)
        for j, token_id in enumerate(result.sampled_token_ids[request.request_id]):
            request.append_output_token(token_id)
            if request.logprobs is not None and logprobs:
                request.logprobs.append(logprobs[j])
            if self._check_stop(request, token_id):
                return
        drafts = result.draft_token_ids.get(request.request_id)
        if drafts:
            request.spec_token_ids = drafts[:self._max_drafts(request)]

    # -- forks -----------------------------------------------------------------------------------
    def fork_request(self, source: Request, child: Request, num_tokens: int, num_computed: int) -> None:
        """Start `child` (whose tokens are the first `num_tokens` of `source`) as a running request
        that shares source's KV blocks by reference; `num_computed` of its tokens count as computed
        (num_tokens - 1 when child must recompute the last token for its own logits)."""
        if child.request_id in self.requests:
            raise ValueError(f"request id {child.request_id!r} is already in use")
        if source.status != RequestStatus.RUNNING or num_tokens > source.num_computed_tokens:
            raise ValueError(f"request {source.request_id!r} has no KV for its first {num_tokens} tokens")
        assert child.all_token_ids == source.all_token_ids[:num_tokens] and num_computed <= num_tokens
        self.kv.fork(source.request_id, child.request_id, num_tokens)
        if self.isolate and source.request_id in self.isolate[0]:
            self.isolate[0].add(child.request_id)
        child.owner = source.owner
        self.requests[child.request_id] = child
        child.num_computed_tokens = num_computed
        child.num_cached_tokens = num_computed
        child.first_scheduled_time = time.monotonic()
        child.status = RequestStatus.RUNNING
        self.running.append(child)

    def _fork_children(self, parent: Request, result: ModelRunnerOutput) -> list[Request]:
        """SamplingParams.n > 1: the runner sampled every child's first token from the parent's
        prompt logits; the children now share the parent's prompt blocks (its partial last block too).
        Called before the parent's own token is appended (and before it may finish)."""
        assert parent.num_computed_tokens == parent.num_tokens, "forks happen at the first sample"
        children, parent.forks = parent.forks, []
        for child in children:
            assert child.request_id in result.sampled_token_ids, "the runner samples for each fork"
            self.fork_request(parent, child, parent.num_computed_tokens, parent.num_computed_tokens)
            child.num_cached_tokens = parent.num_cached_tokens
        return children

    def _check_stop(self, request: Request, token_id: int) -> bool:
        """Finish the request if its newest token (`token_id`, appended) ends it."""
        stop = request.stop_for(token_id, request.num_output_tokens)
        if stop is None and request.grammar is not None and request.grammar.accept(token_id):
            stop = RequestStatus.FINISHED_STOPPED, None  # its grammar has ended (structured outputs)
        if stop is None and request.length_reached(self.config.max_model_len):
            stop = RequestStatus.FINISHED_LENGTH, None
        if stop is not None:
            self.finish_request(request.request_id, *stop)
        return stop is not None

    def _max_drafts(self, request: Request) -> int:
        """Never draft past max_tokens or max_model_len."""
        return max(0, request.room(self.config.max_model_len) - 1)
