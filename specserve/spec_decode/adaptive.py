"""Adaptive speculation length: how many drafts each request gets next step (0 = do not speculate).

Speculation pays when the extra verification tokens are cheap (the target forward is bound by
reading weights, not by compute) and drafts are likely accepted. The same inputs (estimates, cost
table, the guard's trust) always give the same k; greedy output does not depend on k in fp32 (in
bf16 the verification shapes k implies can flip near-ties: docs/speculative.md, Exactness):

- a target forward over N tokens costs `costs(N)` steps (specserve/spec_decode/costs.py): analytically
  `1 + N / compute_bound_tokens` (reading the weights once, plus compute per token; the sum, not
  the max: conservative), or interpolated from a start-up profile (the CPU default);
- each autoregressive draft-model step costs `draft_cost` target steps (0 for n-gram lookup), or,
  when its device time is known (`draft_seconds`: an EAGLE chain's graph), that time over the plain
  step's measured one (a target whose host sets the pace takes longer per step than its device time);
  where the chain's graphs were timed at several batch sizes (`draft_scale`), both are scaled to the
  batch that drafts: a chain over 64 requests costs more than one over one; and that price times the
  share of it drafting steps were measured to add (`draft_share`: where the host sets the pace, the
  device runs the chain meanwhile and a draft step may add nothing);
- request r accepts a draft (given the previous one was accepted) with probability alpha_r,
  estimated from verifications (decayed counts plus a prior) under a key the proposer chooses:
  per request for a draft model or an EAGLE head, whose prior is then the acceptance of all
  requests' recent drafts (`shared_prior`: a request's own few verifications are too noisy to go
  by alone, and a new request starts where the others are); per match length for n-gram lookup (a
  1-gram match is accepted ~20% of the time on HumanEval with SmolLM2, a 5-gram one ~95%). Its j-th
  draft adds alpha_r ** j expected tokens.

`plan` gives requests, in order of decreasing alpha_r, the whole k that most improves expected
tokens per unit of cost, if the drafts' tokens per unit of their own cost beat the batch's by a
margin, so the bar rises with the batch. At high concurrency it nears 1 and k drops to 0:
speculation switches itself off instead of slowing the server down.

The model is checked against the clock (specserve/spec_decode/guard.py): a proposer that reports its
steps (`step_started` / `step_finished` / `step_skipped`) lets the guard compare drafting steps with
plain ones; the expected accepted tokens are scaled by the share it sees realized (`trust`, <= 1),
and what a drafting step costs beyond the model (`step_overhead`) is measured and priced in.
Drafting runs in spells: started at the margin if the drafts would soon repay the drafter's catch-up,
continued within `stay_margin`, and backed off per batch size after spells that lost
(docs/speculative.md, Adaptive k).
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

import torch

from specserve.spec_decode.costs import StepCosts, measured_costs, profile_forward
from specserve.spec_decode.guard import RealizedGain, batch_bucket

if TYPE_CHECKING:
    from specserve.engine.executor import ModelExecutor
    from specserve.engine.outputs import ModelRunnerOutput, ScheduledRequest, SchedulerOutput
    from specserve.engine.request import Request
    from specserve.spec_decode.proposer import ProposerBinding

T = TypeVar("T")
logger = logging.getLogger(__name__)  # DEBUG: one line per judged step and per plan (the policy's trace)


@dataclass(slots=True)
class _Estimate:
    accepted: float = 0.0  # decayed count of accepted drafts
    tried: float = 0.0  # decayed count of drafts that were reached (all before a rejection, and it)


class AdaptiveK:
    STEADY_AFTER = 2  # a deferred step is timed after this many deferred steps in a row (`step_skipped`)

    def __init__(self, max_k: int, *, adaptive: bool = True, compute_bound_tokens: int = 128,
                 draft_cost: float = 0.0, prior: float = 0.6, prior_weight: float = 1.0,
                 decay: float = 0.8, min_gain: float = 0.05) -> None:
        if compute_bound_tokens < 1:
            raise ValueError(f"compute_bound_tokens must be >= 1, got {compute_bound_tokens}")
        self.max_k = max_k
        self.adaptive = adaptive
        self.compute_bound_tokens = compute_bound_tokens
        self.costs = StepCosts(compute_bound_tokens)  # replaced by a measured table on the CPU
        self.profile_on_bind = False  # measure `costs` when the proposer binds (CPU default)
        self.measure_draft_cost = False  # ... and the draft model's step cost
        self.draft_cost = draft_cost
        self.draft_seconds: float | None = None  # a draft step's device seconds, where measured
        # (batch, a draft step's seconds at that batch over one request's), ascending: measured chains
        self.draft_scale: tuple[tuple[int, float], ...] = ()
        self.prior, self.prior_weight = prior, prior_weight
        # a prior per key (n-gram: by match length), and the best prior any key can have
        self.prior_of: Callable[[Hashable], float] = lambda key: prior
        self.best_prior = prior
        self.decay = decay
        # shared_prior: a key's prior is the acceptance of every key's recent drafts (decayed counts
        # over all verifications, pool_decay per verification, started at `prior`), not prior_of(key);
        # a plan that drafts nothing decays it by pool_rest_decay (towards `prior`), so a bad spell is
        # retried
        self.shared_prior = False
        self.pool_decay, self.pool_rest_decay = 0.99, 0.95
        self._pool = _Estimate()
        self.min_gain = min_gain
        # safety factor for cost-model error (a draft's tokens per unit of its cost must beat the
        # batch's by 15%): the model prices a step's tokens, a real batch also waits for its slowest
        self.margin = 0.15
        # closed loop: measured step times vs the gains the plan predicted (fed by a proposer that
        # reports its steps: `step_started` / `step_finished` / `step_skipped`; guard.py)
        self.guard = RealizedGain()
        self._timing = False  # a step started (`_start`) and is not finished or skipped yet
        # a synchronous step's time: the interval from its start to the next step's (its verification
        # and the engine's bookkeeping), judged when the next step starts, with the proposer's work
        # after it (the next step's drafts) moved to the next step, and the work that made its own
        # drafts added: seconds of the proposer's work after the step before, and after this one
        self._pending: tuple | None = None
        self._t_verified: float | None = None
        self._propose_seconds = 0.0
        self._carried_seconds = 0.0
        # of the proposer's work: the part that caught its drafter up over positions from before the
        # step it followed (`caught_up`: a spell's start), after this step and after the step before
        self._catch_ups, self._carried_catch_up = [], ()  # `caught_up`: seconds, or readings of them
        # the last plan: the accepted tokens the model expects of its drafts (before the guard's
        # scaling), and its step's modelled cost over the plain step's
        self._predicted_accepted, self._cost_ratio = 0.0, 1.0
        self._plan_overhead = 0.0  # the `step_overhead` it was priced with
        # async scheduling (set by the proposer's bind): a step without drafts may run deferred
        # (`step_skipped`), overlapped with the host's work on the next one, which makes it cheaper
        # than the same step run synchronously. Then the plain-step time the guard judges drafting
        # steps against comes from deferred steps (the interval to the next step's start), and the
        # probes for it run deferred too.
        self.async_steps = False
        # A deferred step's time is the interval from its start to the next step's, but only when
        # the next step is deferred too (before a synchronous step the engine first collects every
        # step in flight: the interval spans two steps' device time) and at least STEADY_AFTER
        # deferred steps came before it: a run of deferred steps starts with the device idle, and
        # its first intervals are shorter than its steady ones (on an H200, the default model at one
        # request: 0.80 ms against 1.0 ms, and drafting steps judged against that looked 20% dearer
        # than they were).
        self._skipped: tuple[int, float] | None = None  # (base tokens, start) of a timeable deferred step
        self._start = 0.0  # when this step started
        self._skip_run = 0  # deferred steps in a row just before this one
        self._skipping = False  # this step is left in flight
        self._probe_left = 0  # steps still to run without drafts (deferrable) to time a plain step
        # what a drafting step costs beyond the model (the proposer's host work, a synchronous step's
        # lost overlap, launches), in plain-step cost units, per batch-size bucket of the batch that
        # samples (`step_overhead`): measured from its drafting steps against the guard's plain-step
        # time, and paid by any plan that drafts at that batch size. 64 requests' host work is not one
        # request's: on 8B shapes a drafting step of 64 requests took 3-4 plain steps where the model
        # said 1.4, one request's about what it said; with one overhead for all batch sizes, a load
        # swinging between them priced each by the other's. A bucket's overhead decays by
        # `overhead_decay` a step since it was last measured (half-life ~140 steps), so a bad sample
        # (a compile, a burst of other work) does not stop drafting for good.
        self._overheads: dict[int, tuple[float, int]] = {}  # bucket -> (overhead, the guard's step then)
        self.overhead_decay = 0.995
        # How much of the modelled draft steps' cost a drafting step's time shows (`draft_share`, per
        # batch-size bucket, in [0, 1]): the slope of its time beyond the target's modelled verification
        # against its draft steps' modelled cost, fitted over recent drafting steps (sums decayed by
        # `fit_decay` a drafting step, at least `fit_min_steps` of them) whose number of draft steps K
        # varied (a standard deviation of at least `fit_min_spread` draft steps), and kept while K does
        # not vary; the overhead is learned beyond the share. The model prices a draft step at
        # its device time, but where the host sets a step's pace the device runs the chain while the host
        # works: on an H100, the default model at one request, drafting steps of K = 2, 3 and 4 took the
        # same 1.43-1.47 ms (a draft step priced at 0.067 plain steps), and adaptive k, planning K = 3
        # in 27-37% of its plans, accepted 2.05-2.17 tokens a step against 2.25 for k = 4 forced.
        self._draft_fit: dict[int, list[float]] = {}  # bucket -> decayed [n, x, x^2, y, x*y]
        self._draft_share: dict[int, float] = {}  # bucket -> its last fitted share
        self.fit_decay, self.fit_min_spread, self.fit_min_steps = 0.98, 0.3, 16.0
        self._plan_steps = -1  # draft steps of the last plan (its K; -1: none made yet)
        # after a plan without drafts, steps without drafts run deferred (`idle`) without planning
        # (a synchronous step costs more than one left in flight), until the next plan: after 8
        # steps, doubling with each plan in a row that drafts nothing, up to `replan_every`
        self.replan_every = 32
        self._skips_since_plan = 0
        self._empty_plans = 0
        # Spells: runs of plans that draft. Starting one costs a synchronous step (and, for a head, a
        # catch-up over every position since its last run), so a spell starts only if its drafts beat
        # the plain step by `margin`, and goes on while they come within `stay_margin` of it (at the
        # same batch-size bucket): estimates near the bar would otherwise flip drafting on and off,
        # paying each start. How recent
        # drafting steps fared against the plain step (realized speedup - 1, the steps that started
        # spells included) is kept per batch-size bucket; a spell that ends on a loss bars its bucket
        # from starting another for (8 << backoff) x max(1, lost) steps from its end, whatever runs
        # between (probes, other buckets' plans): `backoff` counts the spells in a row that ended on a
        # loss (16, 32, .. 8 << max_backoff), `lost` is how many plain steps' time the last spell cost
        # beyond the plain time of its tokens. So retries of drafts that lose cost about 1 / (8 <<
        # backoff) of the steps however dear a start is (a head's catch-up at 64 requests on 8B shapes:
        # ~5 plain steps; at one request about one). A spell that ends on a gain lifts the bar; one that
        # saved time over its whole length (`lost` < 0) ended on its gain over all its steps, whatever its
        # last steps did: on real weights at one request spells that saved 60-220 plain steps ended at
        # -0.00 to -0.07 (a stretch of text the head drafts badly) and backed off up to 512 steps each.
        # A spell that ends within `clear_gain` above break-even undoes one step of its bucket's backoff,
        # not all of it (on 8B shapes at 64 requests a spell that gained +0.01 reset a backoff of 6
        # spells that had lost, and the next started within 16 steps). A spell whose batch moves into a barred
        # bucket ends there, and a batch a quarter under a barred bucket counts as in it (`barred`): at
        # 64 requests spells started while a few requests finished (50-63) and went on at 64.
        self.stay_margin = -0.1
        self.max_backoff = 6
        self.clear_gain = 0.05
        # A spell's start also pays its drafter's catch-up (a head's or a draft model's entries over
        # every position since it last ran for the drafting requests: `plan`'s `catch_up`), each
        # position `catch_up_share` of a target token's compute (the drafter's parameters per position
        # over the target's per verified token; 0: not priced). A spell starts only if the gain the
        # model predicts repays that within as many steps as spells at its batch size have lasted (an
        # average, halfway to each spell's plans; `spell_horizon` before any, and drifting back to it
        # with a half-life of `horizon_half_life` steps, so a batch size where spells were short gets
        # tried again now and then): at 64 requests on 8B shapes spells lasted 1-2 steps, each start
        # caught up 8,000-16,000 positions (2-4 plain steps) for drafts the model prices at ~0.2 plain
        # steps' gain a step, and lost ~2 plain steps.
        self.catch_up_share = 0.0
        self.spell_horizon, self.horizon_half_life = 16.0, 4000
        # Dormant: no plan has drafted for `dormant_after` steps. A head that fuses target layers then
        # lets the target leave its feature out of its decode steps (EagleProposer.needs_aux):
        # where drafting does not pay (64 requests on 8B shapes) the feature cost every step ~0.6% of
        # the target's weight bytes for nothing (a step left in flight 0.4% longer: bench/dormant_steps.py).
        self.dormant_after = 64
        self._drafted_at = 0  # the guard's step of the last plan that drafted
        self._spell_steps: dict[int, tuple[float, int]] = {}  # batch bucket -> (plans its spells lasted, at step)
        self._spell = 0  # plans in a row that drafted
        self._spell_bucket = 0  # the batch-size bucket of its last plan
        self._spell_buckets: frozenset[int] = frozenset()  # the buckets its plans drafted at
        self._ended_buckets: frozenset[int] = frozenset()  # those of the last spell that ended
        self._spell_lost = 0.0  # plain steps' time the last spell's judged steps lost (net of gains)
        self._spell_time = 0.0  # ... and the plain steps' time they took
        self._realized: dict[int, float] = {}  # batch bucket -> recent realized speedup - 1 (EMA)
        self._backoff: dict[int, int] = {}  # batch bucket -> spells in a row that ended on a loss
        self._barred: dict[int, int] = {}  # batch bucket -> the step its last spell ended on a loss at
        self._est: dict[str, _Estimate] = {}

    def forget_measurements(self) -> None:
        """Drop what steps have taught (times, acceptance, spells; not the cost table): after the
        engine's warm-up, whose steps compile kernels and whose acceptance is no user's."""
        g = self.guard
        self.guard = RealizedGain(decay=g.decay, unit_decay=g.unit_decay, prior_steps=g.prior_steps,
                                  max_age=g.max_age, max_age_cap=g.max_age_cap, steady=g.steady)
        self._est.clear()
        self._pool = _Estimate()
        self._overheads.clear()
        self._draft_fit.clear()
        self._draft_share.clear()
        self._pending, self._t_verified, self._skipped = None, None, None
        self._propose_seconds = self._carried_seconds = 0.0
        self._catch_ups, self._carried_catch_up = [], ()  # `caught_up`: seconds, or readings of them
        self._timing = self._skipping = False
        self._skip_run = 0
        self._probe_left = self._skips_since_plan = self._empty_plans = self._spell = 0
        self._plan_steps = -1
        self._spell_lost = self._spell_time = 0.0
        self._spell_buckets = self._ended_buckets = frozenset()
        self._realized.clear()
        self._backoff.clear()
        self._barred.clear()
        self._spell_steps.clear()
        self._drafted_at = 0

    def dormant(self) -> bool:
        """Has no plan drafted for `dormant_after` steps (adaptive k only)?"""
        return self.adaptive and self.guard.num_steps - self._drafted_at >= self.dormant_after

    def wake(self) -> None:
        """The plan just made drafts, but its step lacks what the drafts would read (a dormant step's
        fused feature): it is dropped unjudged, no spell starts, and the policy is no longer dormant,
        so the next step computes the feature and plans again."""
        self._plan_steps = -1
        self._spell = max(0, self._spell - 1)
        self._predicted_accepted, self._cost_ratio = 0.0, 1.0
        self._drafted_at = self.guard.num_steps

    def acceptance(self, key: Hashable) -> float:
        """Estimated probability that a draft token under `key` is accepted (the previous one was)."""
        e = self._est.get(key)
        prior = self._pooled() if self.shared_prior else self.prior_of(key)
        if e is None:
            return prior
        return (e.accepted + prior * self.prior_weight) / (e.tried + self.prior_weight)

    def observe(self, key: Hashable, num_drafts: int, num_accepted: int) -> None:
        """A verification: `num_accepted` of `num_drafts` drafts accepted (a prefix)."""
        if num_drafts <= 0:
            return
        tried = min(num_accepted + 1, num_drafts)
        e = self._est.setdefault(key, _Estimate())
        e.accepted = self.decay * e.accepted + num_accepted
        e.tried = self.decay * e.tried + tried
        self._pool.accepted = self.pool_decay * self._pool.accepted + num_accepted
        self._pool.tried = self.pool_decay * self._pool.tried + tried

    def _pooled(self) -> float:
        """The acceptance of every key's recent drafts (`prior` while there are few)."""
        return (self._pool.accepted + self.prior) / (self._pool.tried + 1.0)

    def remove(self, key: Hashable) -> None:
        self._est.pop(key, None)

    def bind(self, binding: ProposerBinding) -> None:
        """The proposer is bound to the engine: follow its scheduling (`async_steps`), and measure this
        machine's step costs if asked (`profile_on_bind`)."""
        self.async_steps = binding.async_scheduling
        if self.profile_on_bind:
            self.calibrate(binding.target, binding.draft)

    def calibrate(self, target: ModelExecutor, draft: ModelExecutor | None = None) -> None:
        """Measure this machine's step costs with the target (and the draft model) before serving."""
        times = profile_forward(target)
        self.costs = measured_costs(times, self.compute_bound_tokens)
        if draft is not None and self.measure_draft_cost:
            self.draft_cost = profile_forward(draft, sizes=(1,))[1] / times[1]

    def step_started(self) -> None:
        """The target step begins (the runner's begin_step): the step before it, if synchronous,
        ended now; start this one's clock."""
        self._start = time.perf_counter()
        self._end_pending(self._start)
        self._carried_seconds, self._propose_seconds = self._propose_seconds, 0.0
        self._carried_catch_up, self._catch_ups = tuple(self._catch_ups), []
        self._probe_left = max(0, self._probe_left - 1)
        self._skip_run = self._skip_run + 1 if self._skipping else 0
        self._skipping = False
        self._timing = True

    def _end_pending(self, now: float) -> None:
        """The synchronous step waiting for its end (`step_finished`) ended at `now`: judge it."""
        if self._pending is not None:
            *step, start, carried, catch_ups = self._pending
            catch_up = sum(part() if callable(part) else part for part in catch_ups)
            self._judge(now - start - self._propose_seconds + carried, catch_up, *step)
            self._pending = None

    def waiting(self) -> None:
        """The engine ran out of requests and waits for new ones: the last step ended now, and no clock
        runs across the wait. A step is timed up to the next one's start; across a wait it took the idle
        seconds as its own: on a 2-core Xeon a drafting step before a 64-73 s pause between benchmark runs
        was judged 2,300-2,400 plain steps long, and the spell's loss barred drafting for the rest of the
        process (a chat server with one user pauses like that between every answer and the next question)."""
        self._end_pending(time.perf_counter())
        self._timing, self._skipped, self._t_verified = False, None, None
        self._propose_seconds, self._catch_ups = 0.0, []

    def step_skipped(self, num_base_tokens: int) -> None:
        """This step runs without `propose`, left in flight (async scheduling). The deferred step before
        it, if timeable, took until this one started: the time of a plain step under async scheduling."""
        if self._skipped is not None and self._skip_run:
            num_base, t0 = self._skipped
            self.guard.observe(num_base, self.costs(num_base), self._start - t0, 0, 0, 0, tick=False)
        steady = self._skip_run >= self.STEADY_AFTER
        self._skipped = (num_base_tokens, self._start) if steady and num_base_tokens > 0 else None
        self.guard.tick()
        self._skipping = True
        self._skips_since_plan += 1
        self._timing = False

    def plans_nothing(self, num_sampled: int = 0) -> bool:
        """Did the last plan give no drafts (and is it recent enough to go by without planning, for a
        batch of `num_sampled` sampling requests), or may such a batch not start a spell yet (`barred`)?"""
        if not self._spell and self.barred(num_sampled):
            return True
        wait = min(self.replan_every, 4 << min(self._empty_plans, 8))
        return self._plan_steps == 0 and self._skips_since_plan < wait

    def barred(self, num_sampled: int) -> bool:
        """May a batch of `num_sampled` sampling requests not draft yet (its bucket's last spell ended on
        a loss, too few steps ago; or that of a batch a quarter larger: a batch that dips a little
        under a barred bucket, as 64 requests do to 60 while some finish, is that batch)?"""
        return any(self._bucket_barred(bucket)
                   for bucket in {batch_bucket(num_sampled), batch_bucket(num_sampled + num_sampled // 4)})

    def _bucket_barred(self, bucket: int) -> bool:
        ended = self._barred.get(bucket)
        if ended is None:
            return False
        wait = 8 << self._backoff.get(bucket, 0)
        if bucket in self._ended_buckets:  # the last spell's: in proportion to what it lost
            wait *= max(1.0, self._spell_lost)
        return self.guard.num_steps - ended < wait

    def probing(self) -> bool:
        """Are plain steps being timed (under async scheduling: they should run deferred)?"""
        return self._probe_left > 0

    def step_finished(self, num_base_tokens: int, num_draft_tokens: int, num_sampled: int,
                      num_accepted: int | None) -> None:
        """The target step over `num_base_tokens` tokens plus `num_draft_tokens` drafts has been
        computed and verified (`num_sampled` requests sampled, `num_accepted` drafts accepted). It is
        timed up to the next step's start (the engine's bookkeeping included), less the proposer's
        work after it (`proposals_made`: it made the next step's drafts) plus the work that made its
        own drafts: a drafting step costs its drafting, a plain step only the proposer's bookkeeping.
        `num_accepted` None: the verification is still on the device (drafting on the device), which
        only per-request estimates allow: the guard then judges at the acceptance planned anyway."""
        self._t_verified = time.perf_counter()
        if not self._timing or num_base_tokens <= 0:
            return
        self._timing = False
        predicted = self._predicted_accepted if num_draft_tokens else 0.0
        # per-request estimates: the guard judges the step's cost at the acceptance planned (guard.py)
        assert self.shared_prior or num_accepted is not None, "n-gram estimates need the accepted count"
        accepted = predicted if self.shared_prior else num_accepted
        self._pending = (num_base_tokens, num_draft_tokens, num_sampled, accepted, predicted, self._cost_ratio,
                         self._plan_overhead, max(self._plan_steps, 0), num_accepted is None, self._start,
                         self._carried_seconds, self._carried_catch_up)

    def proposals_made(self) -> None:
        """The proposer's work after `step_finished` is done (its catch-up, lookups and the next
        step's drafts, or none): its time moves to the next step's."""
        if self._t_verified is not None:
            self._propose_seconds = time.perf_counter() - self._t_verified
            self._t_verified = None

    def caught_up(self, seconds: float | Callable[[], float]) -> None:
        """Of the proposer's work after this step, `seconds` caught its drafter up over positions from
        before the step (a spell's start: every position since the drafter last ran for its requests;
        a drafting step's own catch-up covers the step's new tokens alone). The step that verifies
        the drafts it made is judged without them (its overhead and the guard's trust are what a
        drafting step costs in a spell), its spell with them (what the start cost is the spell's loss):
        on an Intel Xeon with AMX, at 64 requests, a start's catch-up took ~3 plain steps, and judged
        as the drafting step's own cost it ended every spell there after one drafting step.
        A catch-up still queued on the device (drafting on the device) reports a reading instead, a
        function giving its seconds, called when that step is judged (its work is done by then)."""
        self._catch_ups.append(seconds)

    def timed_catch_up(self, device: torch.device, behind_rows: int, rows: int, forward: Callable[[], T]) -> T:
        """`forward()`, a drafter's forward over `rows` rows, `behind_rows` of them from before this step
        (a spell's start): that share of its time goes to `caught_up`, timed by `CatchUpClock`."""
        if not behind_rows:
            return forward()
        clock = CatchUpClock(device)
        out = forward()
        self.caught_up(clock.stop(behind_rows / rows))
        return out

    def _judge(self, seconds: float, catch_up: float, num_base_tokens: int, num_draft_tokens: int,
               num_sampled: int, num_accepted: float, predicted: float, cost_ratio: float, plan_overhead: float,
               num_draft_steps: int, on_device: bool) -> None:
        """A synchronous step took `seconds`, `catch_up` of them a spell start's catch-up (`caught_up`):
        to the guard (and a drafting step's to `step_overhead`). `self._plan_steps` is still the plan
        made during this step (its drafts for the next one)."""
        made_drafts = self._plan_steps > 0
        base_cost = self.costs(num_base_tokens)
        if num_draft_tokens == 0 and self.async_steps and not self.probing():
            # a plain step run synchronously costs more than one left in flight: not the reference
            # (unless a probe step could not be deferred: requests with penalties, grammars, ...);
            # one that started a spell is what starting it cost
            unit = self.guard.plain_unit(num_base_tokens)
            if made_drafts and unit is not None and seconds > 0:
                plain = unit * base_cost
                self._fared(num_sampled, plain / seconds, seconds / plain)
            logger.debug("step %d: base %d, synchronous, took %.3f ms%s", self.guard.num_steps, num_base_tokens,
                         seconds * 1e3, ", started a spell" if made_drafts else "")
            self.guard.tick()
            return
        if num_draft_tokens and on_device and not made_drafts:
            # drafting on the device, a step's time includes drafting for the next one: the last
            # step of a spell did not, so it is cheaper than the spell's steps were
            self.guard.tick()
            return
        judged = seconds - catch_up if 0 < catch_up < seconds else seconds
        if num_draft_tokens:
            self._learn_overhead(num_base_tokens, num_draft_tokens, num_draft_steps, num_sampled, judged)
            # the guard's trust is for what the cost model, with the overhead learned since the plan,
            # does not explain: the overhead alone prices a drafting step's extra time
            cost_ratio += (self.step_overhead(num_sampled) - plan_overhead) / base_cost
        speedup = self.guard.observe(num_base_tokens, base_cost, judged, num_sampled, num_accepted,
                                     num_draft_tokens, predicted, cost_ratio)
        unit = self.guard.plain_unit(num_base_tokens)
        if speedup is not None and unit is not None:  # the spell pays its start's catch-up
            self._fared(num_sampled, speedup * judged / seconds, seconds / (unit * base_cost))
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug("step %d: base %d drafts %d steps %d took %.3f ms = %s plain%s; overhead %.2f share %.2f"
                         " trust %.2f speedup %s", self.guard.num_steps, num_base_tokens, num_draft_tokens,
                         num_draft_steps, seconds * 1e3, f"{seconds / unit:.2f}" if unit else "?",
                         f" ({catch_up * 1e3:.3f} ms a start's catch-up)" if judged < seconds else "",
                         self.step_overhead(num_sampled), self.draft_share(num_sampled),
                         self.guard.trust(num_base_tokens), f"{speedup:.2f}" if speedup else "?")

    def _fared(self, num_sampled: int, speedup: float, plain_steps: float) -> None:
        """A step of a spell (or one that started it), `plain_steps` plain steps' time long, ran at
        `speedup` x the plain step's throughput."""
        bucket = batch_bucket(num_sampled)
        self._realized[bucket] = 0.7 * self._realized.get(bucket, 0.0) + 0.3 * (speedup - 1.0)
        self._spell_lost += plain_steps * (1.0 - speedup)
        self._spell_time += plain_steps

    def _end_spell(self, num_sampled: int) -> None:
        """A spell ended: each batch-size bucket it drafted at is judged by its recent drafting steps, or
        all of them by the spell's realized gain over all its steps where it saved time: a loss backs off
        its next spells, a clear gain (`clear_gain`) lifts its bar, a small one undoes one loss's backoff.
        Its length counts towards its bucket's horizon only where a plan at that batch size ended it (a
        spell cut short by its batch moving to another size is no measure)."""
        self._ended_buckets = self._spell_buckets
        if batch_bucket(num_sampled) == self._spell_bucket:  # its plans stopped paying, not its batch moving
            bucket = self._spell_bucket
            self._spell_steps[bucket] = (0.5 * self._horizon(bucket) + 0.5 * self._spell, self.guard.num_steps)
        # a spell that saved time over all its steps, its start's included, ended because its drafts
        # stopped paying now (its last steps are near the bar by construction: a spell goes on within
        # `stay_margin`): judged by its realized gain over all its steps (their speedup - 1, weighted by
        # their time), not by its last steps'
        saved = -self._spell_lost / self._spell_time if self._spell_lost < 0 else None
        for bucket in self._spell_buckets:
            realized = self._realized.get(bucket) if saved is None else saved
            if realized is None:
                continue
            if realized < 0:
                self._backoff[bucket] = min(self._backoff.get(bucket, 0) + 1, self.max_backoff)
                self._barred[bucket] = self.guard.num_steps
                continue
            backoff = 0 if realized >= self.clear_gain else self._backoff.get(bucket, 0) - 1
            if backoff > 0:
                self._backoff[bucket] = backoff
            else:
                self._backoff.pop(bucket, None)
                self._barred.pop(bucket, None)
        if logger.isEnabledFor(logging.DEBUG):
            judged = ", ".join(f"{2 ** (b - 1)}+ requests {self._realized[b]:+.2f} backoff {self._backoff.get(b, 0)}"
                               for b in sorted(self._spell_buckets) if b in self._realized)
            logger.debug("spell ended at step %d: %d plans, the last at %d requests, lost %.2f plain steps, "
                         "overhead %.2f; realized: %s", self.guard.num_steps, self._spell, num_sampled,
                         self._spell_lost, self.step_overhead(num_sampled), judged or "?")
        self._spell = 0
        self._spell_buckets = frozenset()

    def _learn_overhead(self, num_base_tokens: int, num_draft_tokens: int, num_draft_steps: int,
                        num_sampled: int, seconds: float) -> None:
        """A drafting step took `seconds`: how much of its draft steps' modelled cost it showed
        (`draft_share`), and what the model misses of it, into `step_overhead`."""
        unit = self.guard.plain_unit(num_base_tokens)
        if unit is None:
            return
        cap = 3.0 * self.costs(num_base_tokens)
        beyond = min(max(seconds / unit - self.costs(num_base_tokens + num_draft_tokens), 0.0), cap)
        price = self._draft_price(num_base_tokens, num_sampled)
        self._fit_draft_share(num_sampled, num_draft_steps, price, beyond)
        sample = max(beyond - num_draft_steps * price * self.draft_share(num_sampled), 0.0)  # <= beyond <= cap
        self._overheads[batch_bucket(num_sampled)] = (0.8 * self.step_overhead(num_sampled) + 0.2 * sample,
                                                      self.guard.num_steps)

    def _fit_draft_share(self, num_sampled: int, num_draft_steps: int, price: float, beyond: float) -> None:
        """A drafting step of `num_draft_steps` draft steps, each priced at `price`, took `beyond` plain
        steps beyond its modelled verification: refit `draft_share` at its batch-size bucket."""
        if price <= 0:
            return
        bucket = batch_bucket(num_sampled)
        sums = self._draft_fit.setdefault(bucket, [0.0] * 5)
        x = num_draft_steps * price
        for i, value in enumerate((1.0, x, x * x, beyond, x * beyond)):
            sums[i] = self.fit_decay * sums[i] + value
        n, sx, sxx, sy, sxy = sums
        spread = sxx / n - (sx / n) ** 2  # the variance of the drafting steps' priced draft cost
        if n < self.fit_min_steps or spread <= (self.fit_min_spread * price) ** 2:
            return  # K has not varied enough lately: the last fit holds
        slope = (sxy / n - sx / n * sy / n) / spread
        self._draft_share[bucket] = min(max(slope, 0.0), 1.0)

    def draft_share(self, num_sampled: int) -> float:
        """The share of its draft steps' modelled cost that a drafting step of a batch of `num_sampled`
        sampling requests was measured to take (1 until K has varied enough to tell)."""
        return self._draft_share.get(batch_bucket(num_sampled), 1.0)

    def step_overhead(self, num_sampled: int) -> float:
        """What a drafting step of a batch of `num_sampled` sampling requests costs beyond the model
        (plain-step units), as measured at its batch-size bucket, decayed since."""
        overhead, at = self._overheads.get(batch_bucket(num_sampled), (0.0, 0))
        return overhead * self.overhead_decay ** (self.guard.num_steps - at) if overhead else 0.0

    def assume_overhead(self, num_sampled: int, overhead: float) -> None:
        """Take `overhead` as measured now for batches of `num_sampled` (tests, replays)."""
        self._overheads[batch_bucket(num_sampled)] = (overhead, self.guard.num_steps)

    def _margin(self, num_sampled: int) -> float:
        """What drafts must beat the plain step by: to start a spell, or to go on with one (at about
        the same batch size)."""
        return self.stay_margin if self._spell and batch_bucket(num_sampled) == self._spell_bucket else self.margin

    def worth_trying(self, num_sampled: int, num_base_tokens: int, catch_up: Callable[[], int] | None = None) -> bool:
        """Could any draft pay off in this batch? (A cheap test before looking for drafts.) catch_up:
        the positions the drafter would catch up if every request drafted now (`plan`'s)."""
        if not self.adaptive:
            return True
        priced = self._prices_start(catch_up)
        rows = None
        margin = self._margin(num_sampled)
        prior = self._pooled() if self.shared_prior else self.best_prior
        best = max([self.acceptance(key) for key in self._est] + [prior])
        base = self.costs(num_base_tokens)
        trust = self.guard.trust(num_base_tokens)
        gain = 0.0
        for k in range(1, self.max_k + 1):
            gain += trust * best ** k
            # one request drafting k, or all of them (the draft steps' cost is shared)
            for num in {1, num_sampled}:
                extra = self._extra_cost(num_base_tokens, num * k, k, num, num_sampled)
                if num * gain * base > (1 + margin) * num_sampled * extra:
                    if not priced:
                        return True
                    rows = catch_up() if rows is None else rows
                    if self._repays_start(num * gain / num_sampled * base - extra, rows * num / num_sampled,
                                          num_sampled, num_base_tokens, base):
                        return True
        return False

    def _extra_cost(self, num_base_tokens: int, num_spec: int, num_draft_steps: int, num_drafting: int,
                    num_sampled: int) -> float:
        """What `num_spec` drafts of `num_drafting` requests (and `num_draft_steps` draft-model steps)
        add to a step over `num_base_tokens` tokens of `num_sampled` sampling requests."""
        target = self.costs(num_base_tokens + num_spec) - self.costs(num_base_tokens)
        return (target + num_draft_steps * self._draft_cost(num_base_tokens, num_drafting, num_sampled)
                + self.step_overhead(num_sampled))

    def _draft_cost(self, num_base_tokens: int, num_drafting: int, num_sampled: int) -> float:
        """What one draft step of `num_drafting` requests adds to a step over `num_base_tokens` tokens
        of `num_sampled` sampling requests, in plain-step units: its price (`_draft_price`) times the
        share of it such steps were measured to take (`draft_share`)."""
        return self._draft_price(num_base_tokens, num_drafting) * self.draft_share(num_sampled)

    def _draft_price(self, num_base_tokens: int, num_drafting: int = 1) -> float:
        """A draft step of `num_drafting` requests as the model prices it, in plain-step units: its
        device seconds against the guard's recent plain-step time where both are known, at most
        `draft_cost` (the device-time ratio: where the host sets the pace, a plain step takes longer
        than its device time, and a draft step queued behind the verification adds little more than
        its own device time); both scaled to the drafting batch (`draft_scale`)."""
        unit = self.guard.plain_unit(num_base_tokens) if self.draft_seconds is not None else None
        cost = min(self.draft_cost, self.draft_seconds / unit) if unit else self.draft_cost
        return cost * self._batch_scale(num_drafting)

    def _batch_scale(self, num_drafting: int) -> float:
        """A draft step's cost at `num_drafting` requests over one request's: that of the smallest
        timed batch that holds them (the chain runs padded to it), the largest's past it, 1 untimed."""
        for batch, scale in self.draft_scale:
            if batch >= num_drafting:
                return scale
        return self.draft_scale[-1][1] if self.draft_scale else 1.0

    def plan(self, rooms: dict[str, int], num_base_tokens: int, max_spec_tokens: int,
             keys: dict[str, Hashable] | None = None,
             catch_up: Callable[[list[str]], int] | None = None) -> dict[str, int]:
        """k per request. rooms: req_id -> most drafts it may take (max_tokens / max_model_len, or
        what a lookup found); num_base_tokens: tokens the next step computes without drafts;
        max_spec_tokens: token budget left; keys: req_id -> estimate key (default: req_id);
        catch_up: the positions the drafter would catch up if these requests drafted now (a spell's
        start; `catch_up_share`)."""
        keys = keys or {r: r for r in rooms}
        if not self.adaptive:
            return {r: max(0, min(self.max_k, room)) for r, room in rooms.items()}
        ks = dict.fromkeys(rooms, 0)
        self._predicted_accepted, self._cost_ratio = 0.0, 1.0
        self._skips_since_plan = 0
        if not any(rooms.values()):
            # every request ends with this step's tokens: no verdict on drafting (a spell goes on
            # with the requests that come next, which plan at once)
            self._plan_steps = -1
            return ks
        if self.barred(len(rooms)) and (not self._spell or batch_bucket(len(rooms)) != self._spell_bucket):
            # no spell starts here yet, nor goes on into it from another batch size; no probe is needed
            return self._settle(ks, keys, 0.0, 1.0)
        if max_spec_tokens <= 0 or self.probing() or self.guard.wants_probe(num_base_tokens):
            if not self.probing() and self.async_steps and max_spec_tokens > 0:
                # a few plain steps, deferred: those after the first STEADY_AFTER, but the last, are timed
                self._probe_left = self.STEADY_AFTER + 3
            self._plan_steps = -1  # no drafts this time, but not because none would pay
            self._rest({keys[r] for r in rooms})
            return ks
        if not self._spell and not self.worth_trying(len(rooms), num_base_tokens):
            # no draft could pay: skip the search (a spell's steps search at once: mostly they draft)
            return self._settle(ks, keys, 0.0, 1.0)
        # The draft steps' cost is shared: one draft forward serves every drafting request, so it is
        # a fixed cost of the step. For each number of draft steps K it is paid up front; requests,
        # in order of decreasing alpha, then each take the k <= K that most improves expected tokens
        # per unit of cost against the target's extra verification tokens alone (costs are not
        # convex: on a CPU the first extra token can cost more than the next four, so whole k's are
        # compared, not single drafts). The best K wins if its drafts' tokens per unit of their cost
        # beat the plain step's by the margin (K = 0: no drafts). Without a draft cost only K = max_k counts.
        alphas = {r: self.acceptance(keys[r]) for r in rooms}
        order = sorted(rooms, key=lambda r: -alphas[r])
        base_cost = self.costs(num_base_tokens)
        # what n more verification tokens cost the target, for every n a plan can reach
        most = min(max_spec_tokens, sum(min(room, self.max_k) for room in rooms.values()))
        extra = [self.costs(num_base_tokens + n) - base_cost for n in range(most + 1)]

        # expected accepted tokens count at the share the guard has seen drafting steps realize
        trust = self.guard.trust(num_base_tokens)
        margin = self._margin(len(rooms))
        plain = (float(len(rooms)), base_cost, ks, 0.0)  # (tokens, cost, ks, gain the model predicts)
        best = None
        draft_cost = self._draft_cost(num_base_tokens, len(rooms), len(rooms))
        for max_steps in (range(1, self.max_k + 1) if draft_cost else (self.max_k,)):
            plan = self._plan_with(order, alphas, rooms, extra, max_spec_tokens, max_steps, trust, base_cost,
                                   margin, draft_cost)
            tokens, cost = plan[0], plan[1]
            # the drafts' tokens per unit of all they cost, draft steps included, must beat the
            # plain step's by the margin
            beats_plain = (tokens - len(rooms)) * base_cost > (1 + margin) * len(rooms) * (cost - base_cost)
            if plan[3] and beats_plain and (best is None or tokens * best[1] > best[0] * cost):
                best = plan
        if best is not None and self._prices_start(catch_up):
            tokens, cost, ks, _ = best
            saving = tokens / len(rooms) * base_cost - cost
            if not self._repays_start(saving, catch_up([r for r, k in ks.items() if k]), len(rooms), num_base_tokens,
                                      base_cost):
                best = None
        _, cost, ks, model_gain = best or plain
        return self._settle(ks, keys, model_gain, cost / base_cost)

    def _prices_start(self, catch_up: Callable | None) -> bool:
        """Would drafts now start a spell whose catch-up is priced (`catch_up_share`)?"""
        return not self._spell and catch_up is not None and self.catch_up_share > 0

    def _repays_start(self, saving: float, rows: float, num_sampled: int, num_base_tokens: int,
                      base_cost: float) -> bool:
        """Would drafts that save `saving` a step (cost units: the plain time of their expected tokens
        less their step's cost), starting a spell of `num_sampled` requests, repay the drafter's
        catch-up over `rows` positions within as many steps as such spells lasted?"""
        start = self.costs(num_base_tokens + round(self.catch_up_share * rows)) - base_cost
        return saving * self._horizon(batch_bucket(num_sampled)) > start

    def _horizon(self, bucket: int) -> float:
        """How many plans spells at this batch-size bucket last (what a start must repay itself within)."""
        if bucket not in self._spell_steps:
            return self.spell_horizon
        steps, at = self._spell_steps[bucket]
        fade = 0.5 ** ((self.guard.num_steps - at) / self.horizon_half_life)
        return self.spell_horizon + (steps - self.spell_horizon) * fade

    def _settle(self, ks: dict[str, int], keys: dict[str, Hashable], model_gain: float,
                cost_ratio: float) -> dict[str, int]:
        """Record the plan `ks` (what the guard and the deferral read) and return it."""
        self._plan_steps = max(ks.values(), default=0)
        self._empty_plans = self._empty_plans + 1 if self._plan_steps == 0 else 0
        if self._plan_steps:
            self._drafted_at = self.guard.num_steps
            if not self._spell:
                self._spell_lost = self._spell_time = 0.0
            self._spell += 1
            self._spell_bucket = batch_bucket(len(ks))
            self._spell_buckets |= {self._spell_bucket}
        elif self._spell:
            self._end_spell(len(ks))
        self._predicted_accepted, self._cost_ratio = model_gain, cost_ratio
        self._plan_overhead = self.step_overhead(len(ks))
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug("plan at step %d: K %d, %d of %d drafting, gain %.2f, cost x%.2f", self.guard.num_steps,
                         self._plan_steps, sum(1 for k in ks.values() if k), len(ks), model_gain, cost_ratio)
        if not all(ks.values()):
            self._rest({keys[r] for r, k in ks.items() if k == 0} - {keys[r] for r, k in ks.items() if k})
        if self._plan_steps == 0 and self.shared_prior:  # the shared estimate drifts back too
            self._pool.accepted *= self.pool_rest_decay
            self._pool.tried *= self.pool_rest_decay
        return ks

    def _plan_with(self, order: list[str], alphas: dict[str, float], rooms: dict[str, int],
                   extra: list[float], max_spec_tokens: int, max_steps: int, trust: float,
                   base_cost: float, margin: float, draft_cost: float) -> tuple[float, float, dict[str, int], float]:
        """`plan` with at most `max_steps` draft steps of `draft_cost` each, paid for up front (when
        some request drafts): (expected tokens, cost, ks, the model's gain without the guard's scaling)."""
        ks = dict.fromkeys(rooms, 0)
        fixed = max_steps * draft_cost + self.step_overhead(len(rooms))
        tokens, num_spec, model_gain = float(len(rooms)), 0, 0.0
        cost = base_cost + fixed
        min_gain, bar = self.min_gain, 1 + margin
        for req_id in order:
            alpha = alphas[req_id]
            best_k, best_tokens, best_cost, best_raw = 0, tokens, cost, 0.0
            raw, power = 0.0, 1.0
            limit = min(max_steps, max_spec_tokens - num_spec)
            for k in range(1, min(limit, rooms[req_id]) + 1):
                power *= alpha  # alpha ** k: the k-th draft's expected tokens
                if power < min_gain:
                    break
                raw += power
                gain = trust * raw
                new_cost = base_cost + fixed + extra[num_spec + k]
                # the drafts' tokens per unit of their own cost must beat the batch's by the margin
                worth = gain * cost > bar * tokens * (new_cost - cost)
                if worth and (tokens + gain) * best_cost > best_tokens * new_cost:
                    best_k, best_tokens, best_cost, best_raw = k, tokens + gain, new_cost, raw
            if not best_k:
                if rooms[req_id] >= limit:  # the rest have lower alphas and no more room: none drafts
                    break
                continue
            ks[req_id] = best_k
            tokens, cost = best_tokens, best_cost
            model_gain += best_raw
            num_spec += best_k
        if not num_spec:
            return float(len(rooms)), base_cost, ks, 0.0
        return tokens, cost, ks, model_gain

    def _rest(self, keys) -> None:
        """Estimates that got no drafts drift back to the prior (so they get tried again)."""
        for key in keys:
            e = self._est.get(key)
            if e is not None:
                e.accepted *= self.decay
                e.tried *= self.decay


class CatchUpClock:
    """A drafter's catch-up over positions from before the step, timed for `AdaptiveK.caught_up`: the
    device work launched between its creation and `stop`, by CUDA events on a GPU (queued there, the
    host's clock would see its launch alone; read when asked, once that work is done: the step that
    waits for it is judged after it), by the host's clock elsewhere (the work ran as it was launched)."""

    def __init__(self, device: torch.device) -> None:
        self._events = None
        if device.type == "cuda":
            self._events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            self._events[0].record()
        self._t0 = time.perf_counter()

    def stop(self, share: float) -> Callable[[], float]:
        """A reading of `share` of the time so far, in seconds."""
        if self._events is None:
            seconds = (time.perf_counter() - self._t0) * share
            return lambda: seconds
        start, end = self._events
        end.record()

        def read() -> float:
            end.synchronize()
            return start.elapsed_time(end) * 1e-3 * share
        return read


@dataclass(slots=True)
class DraftSlot:
    """A request that sampled this step, and how many drafts it gets for the next one."""

    sched: ScheduledRequest
    new_ids: list[int]  # tokens sampled this step (not yet appended to the request)
    room: int  # most drafts worth proposing (max_tokens, max_model_len)
    k: int = 0  # drafts it gets


def sampled_slots(policy: AdaptiveK, sched: SchedulerOutput, out: ModelRunnerOutput, max_model_len: int,
                  key_of: Callable[[str], Hashable] = lambda req_id: req_id) -> tuple[list[DraftSlot], int]:
    """Record this step's verifications in `policy` (under `key_of(req_id)`); return the requests
    that sampled, and the tokens the next step likely computes without drafts."""
    slots: list[DraftSlot] = []
    num_base = 0
    for s in sched.scheduled:
        req = s.request
        new_ids = out.sampled_token_ids.get(req.request_id)
        if not new_ids:
            num_base += s.num_tokens  # a prefill chunk: the next step likely has one too
            continue
        if s.spec_token_ids:
            policy.observe(key_of(req.request_id), len(s.spec_token_ids),
                           out.num_accepted.get(req.request_id, len(new_ids) - 1))
        num_base += 1
        slots.append(DraftSlot(s, new_ids, draft_room(req, new_ids, max_model_len)))
    return slots, num_base


def _next_base_tokens(sched: SchedulerOutput) -> int:
    """Tokens the next step likely computes without drafts: one per sampling request, and a prefill
    chunk's again (as `sampled_slots` counts them)."""
    return sum(1 if s.sample else s.num_tokens for s in sched.scheduled)


def step_tokens(sched: SchedulerOutput) -> tuple[int, int]:
    """(tokens the step computes besides drafts, drafts it verifies): what the guard times it under."""
    num_drafts = sum(len(s.spec_token_ids) for s in sched.scheduled)
    return sum(s.num_tokens for s in sched.scheduled) - num_drafts, num_drafts


def step_verified(policy: AdaptiveK, sched: SchedulerOutput, out: ModelRunnerOutput) -> None:
    """The step's forward and verification are done: its time corrects the policy's cost model (the guard)."""
    num_base, num_drafts = step_tokens(sched)
    policy.step_finished(num_base, num_drafts, len(out.sampled_token_ids), sum(out.num_accepted.values()))


def nothing_to_draft(policy: AdaptiveK, sched: SchedulerOutput,
                     behind: Callable[[ScheduledRequest], int] | None = None) -> bool:
    """`Proposer.idle` for proposers driven by the policy: after this step (which verifies no drafts)
    no draft could pay off at this batch size, whatever it samples (the policy's cheap test).
    behind: the positions a request's drafter lacks after the step (a spell's catch-up)."""
    sampling = [s for s in sched.scheduled if s.sample]
    catch_up = (lambda: sum(behind(s) for s in sampling)) if behind is not None else None
    return (not sampling or policy.probing() or policy.plans_nothing(len(sampling))
            or not policy.worth_trying(len(sampling), _next_base_tokens(sched), catch_up))


def skipped(policy: AdaptiveK, sched: SchedulerOutput) -> None:
    """`Proposer.skip` for proposers driven by the policy: the step runs deferred (timed at the next),
    under its own token count, as `step_verified` times a synchronous step."""
    policy.step_skipped(step_tokens(sched)[0])


def plan_step(policy: AdaptiveK, sched: SchedulerOutput, out: ModelRunnerOutput, max_model_len: int,
              max_num_batched_tokens: int, behind: Callable[[ScheduledRequest], int] | None = None
              ) -> list[DraftSlot]:
    """Record this step's verifications in `policy`, then give each sampled request its k (`behind`:
    as for `nothing_to_draft`)."""
    slots, num_base = sampled_slots(policy, sched, out, max_model_len)
    return _give_ks(policy, slots, num_base, max_num_batched_tokens, behind)


def _give_ks(policy: AdaptiveK, slots: list[DraftSlot], num_base: int, max_num_batched_tokens: int,
             behind: Callable[[ScheduledRequest], int] | None) -> list[DraftSlot]:
    if slots:
        def catch_up(ids: list[str]) -> int:  # read only where a plan would start a spell
            by_id = {s.sched.request.request_id: s.sched for s in slots}
            return sum(behind(by_id[r]) for r in ids)

        ks = policy.plan({s.sched.request.request_id: s.room for s in slots}, num_base,
                         max_num_batched_tokens - num_base, catch_up=catch_up if behind is not None else None)
        for slot in slots:
            slot.k = ks[slot.sched.request.request_id]
    return slots


def planned_on_device(policy: AdaptiveK, sched: SchedulerOutput, max_model_len: int, max_num_batched_tokens: int,
                      behind: Callable[[ScheduledRequest], int] | None = None) -> list[DraftSlot]:
    """`plan_step` for a step whose verification is still on the device (drafting on the device): every
    request that samples gets its k before its new tokens are known, with the room it would have
    after the fewest of them (one): the drafts are cut to the real room later (`draft_room`). The
    step's verifications reach the policy later (`observe`). Its `new_ids` stay empty."""
    slots = [DraftSlot(s, [], max(0, s.request.room(max_model_len, 1) - 1)) for s in sched.scheduled if s.sample]
    return _give_ks(policy, slots, _next_base_tokens(sched), max_num_batched_tokens, behind)


def draft_room(req: Request, new_ids: list[int], max_model_len: int) -> int:
    """Most drafts worth proposing: never past max_tokens / max_model_len (as the scheduler caps
    them), none when the last new token ends the request."""
    if req.stop_for(new_ids[-1], req.num_output_tokens + len(new_ids)) is not None:
        return 0
    return max(0, req.room(max_model_len, len(new_ids)) - 1)
