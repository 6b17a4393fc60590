"""LLMEngine: each step schedules, launches (model runner), collects and resolves (scheduler); the
engine API is add_request / step / abort. `step_updates()` is the step as the engine core reports it
(new token ids per request: messages.RequestUpdate); `step()` also turns them into RequestOutputs
(text, stop strings) through an OutputProcessor. Built by engine/build.py; engine/core.py runs it
for servers (in a thread or its own process)."""
from __future__ import annotations

import dataclasses
import logging
import time
import uuid
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass, field

from specserve.config import EngineConfig
from specserve.engine.build import async_drafting_applies, build_engine
from specserve.engine.executor import ExecutorDeadError
from specserve.engine.generation_config import sampling_defaults
from specserve.engine.intake import Intake, Prompt
from specserve.engine.isolation import StepIsolation
from specserve.engine.messages import ModelInfo, RequestUpdate, SampleUpdate, sample_id
from specserve.engine.output_processor import OutputProcessor
from specserve.engine.outputs import RequestMetrics, RequestOutput
from specserve.engine.request import Request, RequestStatus
from specserve.sample.structured import GrammarCompiler, GrammarMasks, RequestGrammar
from specserve.sampling_params import SamplingParams
from specserve.spec_decode.metrics import SpecDecodingStats

logger = logging.getLogger(__name__)

PromptType = str | list[int] | dict | Prompt
__all__ = ["LLMEngine", "ModelInfo", "PromptType"]
COMPILE_WAIT_S = 0.02  # with only requests whose grammar compiles, a step waits this long for one


@dataclass
class _Group:
    """A user request: one child Request per parallel sample (SamplingParams.n)."""

    request_id: str
    prompt: Prompt
    params: SamplingParams
    children: list[Request]
    sent: list[int] = field(default_factory=list)  # output tokens already reported, per child
    ended: list[bool] = field(default_factory=list)  # the child's end was reported

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
        self.intake = Intake(self.tokenizer, parts.loaded.arch.vocab_size, self.max_model_len,
                             parts.config.model.max_logprobs)
        self.sampling_defaults = sampling_defaults(parts.config.model.generation_config, parts.loaded.path)
        # structured outputs: grammars compile in a worker thread; their requests wait here meanwhile
        self.grammars = None if self.tokenizer is None else GrammarCompiler(
            self.tokenizer, parts.loaded.arch.vocab_size, self.eos_token_ids)
        self._compiling: dict[str, tuple[_Group, Future]] = {}
        self._rejected: dict[str, str] = {}  # request id -> why: its grammar did not compile
        self.groups: dict[str, _Group] = {}
        self._child_to_group: dict[str, _Group] = {}
        self.async_scheduling = bool(parts.config.scheduler.async_scheduling)  # resolved by the builder
        # a drafting step's successor launched before its tokens are known (`_step_ahead`), where the
        # builder resolved it possible
        self.async_drafting = parts.config.scheduler.async_drafting
        applies = async_drafting_applies(parts.config.scheduler, parts.runner.proposer)
        if config.scheduler.async_drafting and not applies:
            logger.warning("async drafting does not apply here: it needs async scheduling, one GPU and an EAGLE "
                           "head drafting on the device (CUDA)")
        self.num_ahead_steps = 0  # steps launched ahead of their predecessor's tokens (async drafting)
        self._inflight = None  # a launched step whose tokens are still on the device (LaunchedStep)
        self._touched: dict[str, _Group] = {}  # groups with news since the last step() returned
        self.outputs = OutputProcessor(self.tokenizer)  # text for the requests of add_request
        self.num_deferred_steps = 0  # steps left in flight by async scheduling
        self.isolation = StepIsolation(self)
        self._stepping: tuple | None = None  # (SchedulerOutput, in-flight SchedulerOutput | None) of step()
        warmup = parts.config.warmup
        self.warmup_seconds = self.warm_up() if (warmup if warmup is not None else self.device.type == "cuda") else 0.0

    def warm_up(self) -> float:
        """Run the shapes the first real batches use, then forget them; returns the seconds it took.

        On a GPU, Triton compiles each kernel variant on its first call (the attention kernels pick
        tile shapes and KV splits from the batch: requests, query and context lengths) and the first
        large forwards set up cuBLAS and the allocator: seconds that would otherwise land in the
        first users' requests. The waves: one lone prompt (batch-1 prefill and decode); max_num_seqs
        prompts of 128 tokens at once (a burst of users); max_num_seqs prompts of mixed lengths with
        mixed output lengths (full prefill chunks, chunks beside every number of decodes, decode
        batches shrinking to one) beside one prompt longer than a chunk; a random-sampling request;
        then, on a GPU, one structured-output mask (its Triton kernel).
        Afterwards the prefix cache and the counters are reset, so neither shows the warm-up."""
        t0 = time.perf_counter()
        sc = self.config.scheduler
        budget, longest = sc.max_num_batched_tokens, max(1, self.max_model_len - 16)
        room = self.kv_manager.pool.num_blocks * self.config.cache.block_size // 2
        vocab = self.loaded.arch.vocab_size
        prompt = lambda k, n: [(k * 7919 + i * 104729 + 1) % vocab for i in range(n)]  # noqa: E731 - distinct
        greedy = lambda m: SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True)  # noqa: E731

        def fitted(wave: list) -> list:  # a small KV pool: fewer prompts (the last one, the longest, stays)
            while len(wave) > 1 and sum(n + p.max_tokens for n, p in wave) > room:
                wave.pop(0)
            return wave

        batch = [(max(1, min(16 << (k % 4), longest)), greedy(2 + k % 7)) for k in range(max(1, sc.max_num_seqs - 1))]
        batch.append((min(budget + budget // 2, longest), greedy(4)))
        burst = [(min(128, longest), greedy(4))] * sc.max_num_seqs  # a full batch of users arriving together
        waves = [[(min(128, longest), greedy(8))], fitted(burst), fitted(batch),
                 [(16, SamplingParams(temperature=0.8, top_p=0.9, top_k=20, max_tokens=4, seed=0, ignore_eos=True))]]
        logger.info("warming up: %d prompts (%d tokens) through prefill, chunked prefill and decode ...",
                    sum(map(len, waves)), sum(n for w in waves for n, _ in w))
        k = 0
        for wave in waves:
            for n, params in wave:
                self.add_request(f"warmup-{k}", prompt(k, n), params)
                k += 1
            self._finish_warmup_wave()
        if self.grammars is not None and self.device.type == "cuda":
            GrammarMasks.warm_up(self.device, vocab)  # structured outputs' mask kernel compiles now
        self.take_failures()
        self.kv_manager.reset_prefix_cache()
        self.kv_manager.prefix_stats = type(self.kv_manager.prefix_stats)()
        self.spec_stats = SpecDecodingStats(len(self.spec_stats.accepted_per_pos))
        self.num_deferred_steps = self.num_ahead_steps = self.scheduler.num_preemptions = 0
        policy = getattr(self.proposer, "policy", None)
        if policy is not None:  # adaptive k: the warm-up's step times (compiles) are no guide
            policy.forget_measurements()
        seconds = time.perf_counter() - t0
        logger.info("warm-up done in %.1fs", seconds)
        return seconds

    def _finish_warmup_wave(self) -> None:
        try:
            while self.has_unfinished():
                self.step(finished_only=True)
        finally:
            for req_id in list(self.groups):
                self.abort(req_id)

    def shutdown(self) -> None:
        """Stop what the engine started besides itself (tensor-parallel workers); idempotent."""
        self.runner.target.shutdown()

    def model_info(self) -> ModelInfo:
        spec = self.config.spec
        speculative = None if spec is None else {"method": spec.method, "draft_model": spec.model,
                                                 "num_speculative_tokens": spec.num_speculative_tokens}
        return ModelInfo(self.model_name, self.max_model_len, self.loaded.arch.vocab_size, speculative,
                         self.intake.max_logprobs, dict(self.sampling_defaults))

    @property
    def proposer(self):
        """The draft source (specserve.spec_decode.Proposer) the runner uses, or None."""
        return self.runner.proposer

    # -- requests --------------------------------------------------------------------------------
    def make_requests(self, request_id: str | None, prompt: PromptType, params: SamplingParams | None = None,
                      owner: str | None = None, arrival_time: float | None = None,
                      checked: bool = False) -> _Group:
        """Tokenize and validate through `intake` (thread-safe, touches no engine state; a `Prompt`
        from intake is taken as it is; `checked`: a front end's intake already checked `params`).
        `owner`: see Scheduler."""
        params = params or SamplingParams()
        request_id = request_id or uuid.uuid4().hex
        validated = self.intake.prompt(prompt)
        if not checked:
            self.intake.check_params(params)
        times = {} if arrival_time is None else {"arrival_time": arrival_time}
        children = []
        for i in range(params.n):
            child_params = params if params.n == 1 else dataclasses.replace(
                params, n=1, seed=None if params.seed is None else params.seed + i)
            children.append(Request(sample_id(request_id, i, params.n), list(validated.token_ids), child_params,
                                    self.eos_token_ids, prompt=validated.text, owner=owner, **times))
        # n > 1: only the first child is scheduled; the prompt is prefilled once and the others fork
        # from it at its first sample (same prompt logits, each child's own generator: seed + i)
        children[0].forks = children[1:]
        return _Group(request_id, validated, params, children, [0] * params.n, [False] * params.n)

    def _check_new_ids(self, group: _Group) -> None:
        ids = [group.request_id] + [c.request_id for c in group.children]
        if group.request_id in self.groups or any(i in self._child_to_group for i in ids):
            raise ValueError(f"request id {group.request_id!r} is already in use")

    def add_group(self, group: _Group) -> None:
        """Start the group. One with structured outputs is scheduled once its grammar has compiled
        (in a worker thread; the step loop goes on meanwhile); if it does not compile, the request
        is refused: `take_rejections()`."""
        self._check_new_ids(group)
        constraint = group.params.structured_outputs
        if constraint is not None and self.grammars is None:
            raise ValueError("structured outputs need the model's tokenizer; this model has none")
        self.groups[group.request_id] = group
        for child in group.children:
            self._child_to_group[child.request_id] = group
        if constraint is not None:
            self._compiling[group.request_id] = (group, self.grammars.submit(constraint))
        else:
            self.scheduler.add_request(group.children[0])  # the others fork from it (make_requests)

    def _admit_compiled(self) -> None:
        """Requests whose grammar has compiled join the scheduler; one whose grammar failed is refused.
        With nothing else to run, wait a moment for a compilation rather than spin."""
        if not self.scheduler.has_unfinished() and self._inflight is None:
            wait([f for _, f in self._compiling.values()], timeout=COMPILE_WAIT_S, return_when=FIRST_COMPLETED)
        for req_id, (group, future) in list(self._compiling.items()):
            if not future.done():
                continue
            del self._compiling[req_id]
            try:
                compiled = future.result()
            except Exception as e:  # noqa: BLE001 - this request's constraint; the others go on
                self._rejected[req_id] = str(e)
                self.outputs.remove(req_id)
                self._retire(group)
                continue
            for child in group.children:
                child.grammar = RequestGrammar(compiled)
            self.scheduler.add_request(group.children[0])

    def take_rejections(self) -> dict[str, str]:
        """Requests (by id) refused after they were added (their grammar did not compile), and why; each once."""
        rejected, self._rejected = self._rejected, {}
        return rejected

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
        group.prompt = Prompt(text, group.prompt.token_ids)
        self._check_new_ids(group)
        compiled = None
        if params.structured_outputs is not None:  # compiled here: this call is between steps anyway
            if self.grammars is None:
                raise ValueError("structured outputs need the model's tokenizer; this model has none")
            compiled = self.grammars.compile(params.structured_outputs)
        for child in group.children:
            child.forks = []
            child.prompt = text
            child.grammar = RequestGrammar(compiled) if compiled is not None else None
            self.scheduler.fork_request(source, child, num_tokens, num_tokens - 1)
            self._child_to_group[child.request_id] = group
        self.groups[group.request_id] = group
        self.outputs.add(group.request_id, group.prompt, group.params)
        return group.request_id

    def add_request(self, request_id: str | None, prompt: PromptType,
                    params: SamplingParams | None = None) -> str:
        """Add a request whose outputs `step()` returns (text included)."""
        group = self.make_requests(request_id, prompt, params)
        self.add_group(group)
        self.outputs.add(group.request_id, group.prompt, group.params)
        return group.request_id

    def abort(self, request_id: str) -> None:
        self.outputs.remove(request_id)
        self._compiling.pop(request_id, None)
        group = self.groups.get(request_id)
        if group is None:
            return
        for child in group.children:
            self.scheduler.finish_request(child.request_id, RequestStatus.FINISHED_ABORTED)
        self._retire(group)

    def finish_sample(self, sample_id: str, stop: str) -> None:
        """End one sample because its text matched the stop string `stop` (found by an
        OutputProcessor); its end is not reported again."""
        group = self._child_to_group.get(sample_id)
        if group is None:
            return
        i = next(i for i, c in enumerate(group.children) if c.request_id == sample_id)
        child = group.children[i]
        if not child.is_finished:
            self.scheduler.finish_request(sample_id, RequestStatus.FINISHED_STOPPED, stop)
        group.ended[i] = True
        if all(group.ended):
            self._retire(group)

    def _retire(self, group: _Group) -> None:
        self.groups.pop(group.request_id, None)
        self._touched.pop(group.request_id, None)
        for child in group.children:
            self._child_to_group.pop(child.request_id, None)
        if not self.groups and self.runner.proposer is not None:
            self.runner.proposer.waiting()  # the engine waits for requests: no step is timed across the wait

    def has_unfinished(self) -> bool:
        return bool(self.groups)

    # -- the step --------------------------------------------------------------------------------
    def step(self, finished_only: bool = False) -> list[RequestOutput]:
        """One engine step: `step_updates()`, made into cumulative RequestOutputs (text, stop strings),
        one per request added with `add_request` that advanced (only those that finished with
        `finished_only`, which saves building outputs nobody reads)."""
        outputs = []
        for update in self.step_updates():
            if update.request_id not in self.outputs:
                continue
            finished, stops = self.outputs.process(update)
            for sid, stop in stops:
                self.finish_sample(sid, stop)
            if finished or not finished_only:
                outputs.append(self.outputs.output(update.request_id))
        return outputs

    def step_updates(self) -> list[RequestUpdate]:
        """One engine step: the new token ids of every request that advanced.

        With async scheduling a plain decode step is left in flight: the next call schedules and
        launches its successor (whose inputs take the in-flight tokens on the device) before waiting
        for it, so the host's scheduling and bookkeeping overlap the device's work. Its tokens then
        come one call later, and a request that stops may have computed one extra token, discarded.
        A step that verifies drafts and drafts the next ones on the device is also left in flight, and
        collected when the next call begins, before it schedules: the host hands the tokens of the
        step before it to the caller (text, streams) while the device verifies and drafts.

        A step that raises fails no request by itself: see `isolation.py`. Requests found to make
        steps fail end, and `take_failures()` says which and why."""
        self._stepping = None
        try:
            self._step()
        except ExecutorDeadError:  # the engine's own fault (a tensor-parallel worker died): no culprit to find
            raise
        except Exception as e:  # noqa: BLE001 - one request's fault must not end the others
            self.isolation.step_failed(e, self._stepping)
            return []
        if self.scheduler.isolate:
            self.isolation.step_passed(self._stepping[0])
        touched, self._touched = self._touched, {}
        return [self._update(g) for g in touched.values()]

    def take_failures(self) -> dict[str, str]:
        """Requests (by id) that the engine ended because steps failed with them, and why; each once."""
        failures = self.isolation.take_failures()
        for req_id in failures:
            self.outputs.remove(req_id)
        return failures

    def _step(self) -> None:
        if self._compiling:
            self._admit_compiled()
        if self._inflight is not None and self._inflight.verifying is not None:
            if self.async_drafting and self._step_ahead(self._inflight):
                return
            # a verification in flight: its tokens decide what the next step computes
            self._stepping = (self._inflight.sched, None)
            self._drain()
        sched = self.scheduler.schedule()
        # what the isolation needs if this step fails: this step and the one still in flight
        self._stepping = (sched, self._inflight.sched if self._inflight is not None else None)
        defer = self.async_scheduling and not self.scheduler.isolate and self._can_defer(sched)
        if not defer:
            self._drain()  # a step finished here sees every earlier token on the host (proposers need them)
        launched = self.runner.launch(sched, prev=self._inflight, defer=defer)
        self._drain()
        if launched.verifying is None:  # a verification advances when collected (`_finish`)
            self.scheduler.advance(sched)
        if launched.pending is not None:
            self._inflight = launched
            self.num_deferred_steps += 1
        elif launched.verifying is not None and self.async_scheduling and not self.scheduler.isolate:
            # collected when the next step begins: the tokens of the steps before it reach the user
            # (and the user's next requests the engine) while the device verifies and drafts
            self._inflight = launched
        else:
            self._finish(launched)

    def _step_ahead(self, prev) -> bool:
        """Async drafting: launch the step after `prev` (a verification in flight whose requests drafted
        their next tokens on the device, or some of them) before prev's tokens are known, then collect prev.
        The device starts the next verification right behind prev's drafts, so the host's books for
        prev's tokens, their way to the caller and the next step's scheduling all overlap the device's
        work. The step is scheduled as if prev accepted every draft (`Scheduler.schedule_ahead`); the
        runner moves it back on the device, and its books once prev is collected. Waiting requests that
        the device can verify (plain greedy) are admitted in it. False (nothing launched) outside a
        drafting batch's steady state: a waiting request that is not plain greedy or needs a running
        one preempted, none drafting or one held back from starting in prev (`DeviceDrafts.held_back`),
        prev may end every request by length, a position that may lie past max_model_len."""
        ks = self.runner.drafts_ahead(prev)
        sched = (self.scheduler.schedule_ahead(prev.sched, ks, self.runner.verifies_on_device)
                 if ks is not None else None)
        if sched is None:
            return False
        self._stepping = (sched, prev.sched)
        launched = self.runner.launch(sched, ahead_of=prev)
        self._inflight = None
        self._finish(prev)
        self.runner.settle_ahead(launched, prev)
        self._inflight = launched
        self.num_ahead_steps += 1
        return True

    def _can_defer(self, sched) -> bool:
        """May this step's sampled tokens stay on the device while the next step is scheduled (and
        sampled)? Only if nothing needs them on the host first: no drafts to verify, a proposer (if
        any) that would propose nothing after this step whatever it samples (`idle`: adaptive k
        finds no draft worth it at this batch size), and no request that forks, wants logprobs, or
        whose next sample reads the token history (penalties; the eos ban until min_tokens; a grammar,
        whose matcher must see the token before it masks the next)."""
        proposer = self.proposer
        if proposer is not None and (any(s.spec_token_ids for s in sched.scheduled)
                                     or not proposer.idle(sched)):
            return False
        for s in sched.scheduled:
            if s.sample:
                r, p = s.request, s.request.sampling_params
                if (r.forks or p.logprobs is not None or p.has_penalties or r.grammar is not None
                        or p.stop_tokens_banned(r.num_output_tokens + r.num_pending)):
                    return False
        return True

    def _drain(self) -> None:
        """Collect the step in flight, if any (its outputs join the next `step()`'s)."""
        if self._inflight is not None:
            launched, self._inflight = self._inflight, None
            self._finish(launched)

    def _finish(self, launched) -> None:
        verifying = launched.verifying is not None
        result = self.runner.collect(launched)
        if verifying:  # its host books (the drafts each request keeps) see the request before the step
            self.scheduler.advance(launched.sched)
        self.spec_stats.observe(launched.sched, result)
        for request in self.scheduler.resolve(launched.sched, result):
            group = self._child_to_group.get(request.request_id)
            if group is not None:
                self._touched[group.request_id] = group

    def _update(self, group: _Group) -> RequestUpdate:
        """The group's tokens (and ends) not reported yet; a group whose every sample ended retires."""
        samples = []
        for i, child in enumerate(group.children):
            if group.ended[i]:
                continue
            sent, total = group.sent[i], child.num_output_tokens
            finish = child.status.value if child.is_finished else None
            if sent == total and finish is None:
                continue
            ids = child.output_token_ids[sent:]
            lps = child.logprobs[sent:] if child.logprobs is not None else None
            group.sent[i], group.ended[i] = total, finish is not None
            samples.append(SampleUpdate(i, ids, lps, finish, child.stop_reason))
        if all(group.ended):
            self._retire(group)
        first = group.children[0]
        return RequestUpdate(group.request_id, samples, max(first.num_cached_tokens, 0), self._metrics(group))

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
            "num_requests_waiting": self.scheduler.num_waiting + len(self._compiling),  # + grammar compiling
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
            "num_ahead_steps": self.num_ahead_steps,
            "num_failed_steps": self.isolation.num_failed_steps,
            "num_failed_requests": self.isolation.num_failed_requests,
            **self.spec_stats.as_dict(),
        }
