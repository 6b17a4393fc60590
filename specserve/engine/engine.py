"""LLMEngine: each step schedules, launches (model runner), collects and resolves (scheduler), then
detokenizes; the engine API is add_request / step / abort. Built by engine/build.py; the AsyncEngine
wrapping it for servers lives in async_engine.py."""
from __future__ import annotations

import dataclasses
import logging
import uuid
from dataclasses import dataclass, field

from specserve.config import EngineConfig
from specserve.engine.build import build_engine
from specserve.engine.detokenizer import IncrementalDetokenizer
from specserve.engine.intake import Intake, Prompt
from specserve.engine.isolation import StepIsolation
from specserve.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from specserve.engine.request import Request, RequestStatus
from specserve.sampling_params import SamplingParams
from specserve.spec_decode.metrics import SpecDecodingStats

logger = logging.getLogger(__name__)

PromptType = str | list[int] | dict | Prompt


@dataclass(frozen=True, slots=True)
class ModelInfo:
    """What a front end needs to know about the served model (instead of reaching into the engine)."""

    model: str  # the path or name it was loaded from
    max_model_len: int
    vocab_size: int
    speculative: dict | None  # {method, num_speculative_tokens, draft_model}, None without speculation


@dataclass
class _Group:
    """A user request: one child Request per parallel sample (SamplingParams.n)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    children: list[Request]
    detoks: list[IncrementalDetokenizer | None] = field(default_factory=list)
    seen: list[int] = field(default_factory=list)  # output tokens already detokenized, per child


class LLMEngine:
    """The engine API: add_request / step / abort (and fork_request, take_failures, stats). Its parts
    come from the builder (engine/build.py); this class keeps the requests and runs the steps."""

    def __init__(self, config: EngineConfig) -> None:
        parts = build_engine(config)
        self.config = parts.config  # resolved (the caller's is left as it was)
        self.device = parts.device
        self.loaded = parts.loaded
        self.tokenizer = parts.loaded.tokenizer
        self.model_name = parts.model_name
        self.weight_memory, self.weight_bytes = parts.weight_memory, parts.weight_bytes
        self.draft_weight_bytes, self.kv_cache_bytes = parts.draft_weight_bytes, parts.kv_cache_bytes
        self.max_model_len = parts.config.scheduler.max_model_len
        self.kv_manager, self.scheduler, self.runner = parts.kv_manager, parts.scheduler, parts.runner
        spec = parts.config.spec
        self.spec_stats = SpecDecodingStats(spec.num_speculative_tokens if spec else 0)
        self.eos_token_ids = frozenset(parts.loaded.eos_token_ids)
        self.intake = Intake(self.tokenizer, parts.loaded.arch.vocab_size, self.max_model_len)
        self.groups: dict[str, _Group] = {}
        self._child_to_group: dict[str, _Group] = {}
        async_scheduling = parts.config.scheduler.async_scheduling
        self.async_scheduling = async_scheduling if async_scheduling is not None else self.device.type == "cuda"
        self._inflight = None  # a launched step whose sampled tokens are still on the device
        self._touched: dict[str, _Group] = {}  # groups with news since the last step() returned
        self.num_deferred_steps = 0  # steps left in flight by async scheduling
        self.isolation = StepIsolation(self)
        self._stepping: tuple | None = None  # (SchedulerOutput, in-flight SchedulerOutput | None) of step()

    def model_info(self) -> ModelInfo:
        spec = self.config.spec
        speculative = None if spec is None else {"method": spec.method, "draft_model": spec.model,
                                                 "num_speculative_tokens": spec.num_speculative_tokens}
        return ModelInfo(self.model_name, self.max_model_len, self.loaded.arch.vocab_size, speculative)

    @property
    def proposer(self):
        """The draft source (specserve.spec_decode.Proposer) the runner uses, or None."""
        return self.runner.proposer

    # -- requests --------------------------------------------------------------------------------
    def make_requests(self, request_id: str | None, prompt: PromptType,
                      params: SamplingParams | None = None, owner: str | None = None) -> _Group:
        """Tokenize and validate through `intake` (thread-safe, touches no engine state; a `Prompt`
        from intake is taken as it is). `owner`: see Scheduler."""
        params = params or SamplingParams()
        request_id = request_id or uuid.uuid4().hex
        validated = self.intake.prompt(prompt)
        text, ids = validated.text, validated.token_ids
        children = []
        for i in range(params.n):
            child_params = params if params.n == 1 else dataclasses.replace(
                params, n=1, seed=None if params.seed is None else params.seed + i)
            child_id = request_id if params.n == 1 else f"{request_id}#{i}"
            children.append(Request(child_id, list(ids), child_params, self.eos_token_ids, prompt=text,
                                    owner=owner))
        # n > 1: only the first child is scheduled; the prompt is prefilled once and the others fork
        # from it at its first sample (same prompt logits, each child's own generator: seed + i)
        children[0].forks = children[1:]
        detoks = [IncrementalDetokenizer(self.tokenizer, ids, c.sampling_params.stop_strings,
                                         c.sampling_params.include_stop_str_in_output,
                                         c.sampling_params.skip_special_tokens)
                  if self.tokenizer is not None else None for c in children]
        return _Group(request_id, text, list(ids), children, detoks, [0] * len(children))

    def _check_new_ids(self, group: _Group) -> None:
        ids = [group.request_id] + [c.request_id for c in group.children]
        if group.request_id in self.groups or any(i in self._child_to_group for i in ids):
            raise ValueError(f"request id {group.request_id!r} is already in use")

    def add_group(self, group: _Group) -> None:
        self._check_new_ids(group)
        self.groups[group.request_id] = group
        for child in group.children:
            self._child_to_group[child.request_id] = group
        self.scheduler.add_request(group.children[0])  # the others fork from it (make_requests)

    def fork_request(self, source_id: str, request_id: str | None = None,
                     params: SamplingParams | None = None, num_tokens: int | None = None) -> str:
        """Start a new request that continues the first `num_tokens` tokens (default: all of them) of
        the running request `source_id` (a request id, or a child id "id#i" of an n > 1 request),
        sharing their KV blocks by reference instead of prefilling them; the new request recomputes
        only the last of those tokens (for its logits). Its outputs stream under the returned id like
        any request's. Use it between `step()` calls, on the engine's thread (e.g. "regenerate from
        turn t": fork the conversation at the end of turn t with new sampling parameters).
        """
        self._drain()  # the source's last token must be known (its outputs come with the next step)
        source = self.scheduler.requests.get(source_id)
        if source is None:
            raise ValueError(f"no unfinished request {source_id!r} to fork from")
        params = params or SamplingParams()
        salt = source.sampling_params.cache_salt
        if params.cache_salt not in (None, salt):
            raise ValueError("a fork shares its source's KV, so it keeps the source's cache_salt")
        params = dataclasses.replace(params, cache_salt=salt)
        num_tokens = source.num_computed_tokens if num_tokens is None else num_tokens
        if not 0 < num_tokens <= source.num_computed_tokens:
            raise ValueError(f"can fork 1..{source.num_computed_tokens} computed tokens of {source_id!r}, "
                             f"not {num_tokens}")
        ids = source.all_token_ids[:num_tokens]
        text = self.tokenizer.decode(ids) if self.tokenizer is not None else None
        group = self.make_requests(request_id, {"prompt_token_ids": ids}, params)
        group.prompt = text
        self._check_new_ids(group)
        for child in group.children:
            child.forks = []
            child.prompt = text
            self.scheduler.fork_request(source, child, num_tokens, num_tokens - 1)
            self._child_to_group[child.request_id] = group
        self.groups[group.request_id] = group
        return group.request_id

    def add_request(self, request_id: str | None, prompt: PromptType,
                    params: SamplingParams | None = None) -> str:
        group = self.make_requests(request_id, prompt, params)
        self.add_group(group)
        return group.request_id

    def abort(self, request_id: str) -> None:
        group = self.groups.pop(request_id, None)
        if group is None:
            return
        for child in group.children:
            self._child_to_group.pop(child.request_id, None)
            self.scheduler.finish_request(child.request_id, RequestStatus.FINISHED_ABORTED)

    def has_unfinished(self) -> bool:
        return bool(self.groups)

    # -- the step --------------------------------------------------------------------------------
    def step(self, finished_only: bool = False) -> list[RequestOutput]:
        """One engine step. Outputs are cumulative, one per request that advanced (only those that
        finished with `finished_only`, which saves building outputs nobody reads).

        With async scheduling a plain decode step is left in flight: the next call schedules and
        launches its successor (whose inputs take the in-flight tokens on the device) before waiting
        for it, so the host's scheduling and bookkeeping overlap the device's work. Its outputs then
        come one call later, and a request that stops may have computed one extra token, discarded.

        A step that raises fails no request by itself: see `isolation.py`. Requests found to make
        steps fail end, and `take_failures()` says which and why."""
        self._stepping = None
        try:
            outputs = self._step(finished_only)
        except Exception as e:  # noqa: BLE001 - one request's fault must not end the others
            self.isolation.step_failed(e, self._stepping)
            return []
        if self.scheduler.isolate:
            self.isolation.step_passed(self._stepping[0])
        return outputs

    def take_failures(self) -> dict[str, str]:
        """Requests (by id) that the engine ended because steps failed with them, and why; each once."""
        return self.isolation.take_failures()

    def _step(self, finished_only: bool) -> list[RequestOutput]:
        sched = self.scheduler.schedule()
        # what the isolation needs if this step fails: this step and the one still in flight
        self._stepping = (sched, self._inflight.sched if self._inflight is not None else None)
        defer = self.async_scheduling and not self.scheduler.isolate and self._can_defer(sched)
        if not defer:
            self._drain()  # a step finished here sees every earlier token on the host (proposers need them)
        launched = self.runner.launch(sched, prev=self._inflight, defer=defer)
        self._drain()
        self.scheduler.advance(sched)
        if launched.pending is not None:
            self._inflight = launched
            self.num_deferred_steps += 1
        else:
            self._finish(launched)
        touched, self._touched = self._touched, {}
        return [self._output(g) for g in touched.values()
                if not finished_only or all(c.is_finished for c in g.children)]

    def _can_defer(self, sched) -> bool:
        """May this step's sampled tokens stay on the device while the next step is scheduled (and
        sampled)? Only if nothing needs them on the host first: no drafts to verify, a proposer (if
        any) that would propose nothing after this step whatever it samples (`idle`: adaptive k
        finds no draft worth it at this batch size), and no request that forks, wants logprobs, or
        whose next sample reads the token history (penalties; the eos ban until min_tokens)."""
        proposer = self.proposer
        if proposer is not None and (any(s.spec_token_ids for s in sched.scheduled)
                                     or not proposer.idle(sched)):
            return False
        for s in sched.scheduled:
            if s.sample:
                r, p = s.request, s.request.sampling_params
                if (r.forks or p.logprobs is not None or p.has_penalties
                        or p.stop_tokens_banned(r.num_output_tokens + r.num_pending)):
                    return False
        return True

    def _drain(self) -> None:
        """Collect the step in flight, if any (its outputs join the next `step()`'s)."""
        if self._inflight is not None:
            launched, self._inflight = self._inflight, None
            self._finish(launched)

    def _finish(self, launched) -> None:
        result = self.runner.collect(launched)
        self.spec_stats.observe(launched.sched, result)
        for request in self.scheduler.resolve(launched.sched, result):
            group = self._child_to_group.get(request.request_id)
            if group is None:
                continue
            self._detokenize(group, request)
            self._touched[group.request_id] = group

    def _detokenize(self, group: _Group, request: Request) -> None:
        i = group.children.index(request)
        detok = group.detoks[i]
        new = request.output_token_ids[group.seen[i]:]
        group.seen[i] = len(request.output_token_ids)
        if detok is None:
            return
        stop = detok.add_tokens(new)
        if stop is not None and not request.is_finished:
            self.scheduler.finish_request(request.request_id, RequestStatus.FINISHED_STOPPED, stop)
        elif stop is not None:
            request.status, request.stop_reason = RequestStatus.FINISHED_STOPPED, stop
        if request.is_finished:
            detok.flush()

    def _output(self, group: _Group) -> RequestOutput:
        outs = []
        for i, (child, detok) in enumerate(zip(group.children, group.detoks)):
            if detok is not None:
                detok.take_delta()
            outs.append(CompletionOutput(
                index=i, text=detok.text[:detok.emitted] if detok is not None else "",
                token_ids=list(child.output_token_ids),
                finish_reason=child.status.value if child.is_finished else None,
                stop_reason=child.stop_reason,
                logprobs=list(child.logprobs) if child.logprobs is not None else None))
        finished = all(c.is_finished for c in group.children)
        if finished:
            del self.groups[group.request_id]
            for child in group.children:
                self._child_to_group.pop(child.request_id, None)
        first = group.children[0]
        return RequestOutput(request_id=group.request_id, prompt=group.prompt,
                             prompt_token_ids=group.prompt_token_ids, outputs=outs, finished=finished,
                             num_cached_tokens=max(first.num_cached_tokens, 0),
                             metrics=self._metrics(group))

    @staticmethod
    def _metrics(group: _Group) -> RequestMetrics:
        first = group.children[0]
        firsts = [c.first_token_time for c in group.children if c.first_token_time is not None]
        first_token = min(firsts) if firsts else None
        ends = [c.finished_time for c in group.children]
        return RequestMetrics(
            arrival_time=first.arrival_time, first_scheduled_time=first.first_scheduled_time,
            first_token_time=first_token,
            finished_time=max(ends) if all(e is not None for e in ends) else None,
            time_to_first_token=None if first_token is None else first_token - first.arrival_time,
            num_preemptions=sum(c.num_preemptions for c in group.children),
            num_drafts=sum(c.spec.num_drafts for c in group.children),
            num_draft_tokens=sum(c.spec.num_draft_tokens for c in group.children),
            num_accepted_tokens=sum(c.spec.num_accepted_tokens for c in group.children))

    # -- observability ---------------------------------------------------------------------------
    def stats(self) -> dict:
        pool = self.kv_manager.pool
        ps = self.kv_manager.prefix_stats
        return {
            "num_requests_running": self.scheduler.num_running,
            "num_requests_waiting": self.scheduler.num_waiting,
            "num_blocks": pool.num_blocks,
            "num_used_blocks": pool.num_used_blocks,
            "kv_cache_usage_perc": pool.usage(),
            "num_cached_blocks": pool.num_cached_blocks,
            "prefix_cache_queries": ps.queries,  # prompt tokens looked up at admission
            "prefix_cache_hits": ps.hits,  # of those, tokens reused from the cache
            "prefix_cache_hit_rate": ps.hit_rate,
            "num_evictions": pool.stats.num_evictions,
            "num_cow_copies": pool.stats.num_cow_copies,
            "num_preemptions": self.scheduler.num_preemptions,
            "num_deferred_steps": self.num_deferred_steps,
            "num_failed_steps": self.isolation.num_failed_steps,
            "num_failed_requests": self.isolation.num_failed_requests,
            **self.spec_stats.as_dict(),
        }
