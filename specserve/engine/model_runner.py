"""The model runner: turns a SchedulerOutput into one forward over a flat ragged batch (through the
target's ModelExecutor), samples, verifies drafts, and asks the proposer for the next drafts. The
scheduler side never touches tensors; only dataclasses cross (SchedulerOutput, ModelRunnerOutput)."""
from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch

from typing import TYPE_CHECKING

from specserve.engine.executor import ModelExecutor
from specserve.engine.outputs import ModelRunnerOutput, SchedulerOutput
from specserve.engine.request import Request
from specserve.engine.step_inputs import (DRAFT_PLACEHOLDER, DraftsInFlight, HostStaging, PendingTokens, StepAhead,
                                          StepInputs, build_step_inputs)
from specserve.sample.sampler import RequestGenerators, Sampler, SamplingRow
from specserve.spec_decode.proposer import DeviceStep, DraftStep
from specserve.spec_decode.rejection import plain_greedy

if TYPE_CHECKING:
    from specserve.engine.cuda_graphs import Verdict
    from specserve.spec_decode.proposer import Proposer
    from specserve.spec_decode.rejection import RejectionSampler

logger = logging.getLogger(__name__)


@dataclass
class LaunchedStep:
    """A step handed to the device: finished (`result`), or with its tokens still in flight: a plain
    step's sampled ids (`pending`, which the next step's inputs take on the device), or a
    verification and the next drafts (`verifying`, whose tokens the host needs before scheduling
    again). `ModelRunner.collect` finishes either."""

    sched: SchedulerOutput
    result: ModelRunnerOutput | None = None
    pending: PendingTokens | None = None
    verifying: _Verifying | None = None


@dataclass
class _Verifying:
    """`_verify_and_draft`'s work in flight: what its host half (`_verified`) needs."""

    out: ModelRunnerOutput
    rows: list
    verified: list[torch.Tensor]  # the host copy of the argmax rows, then the accepted counts (one tensor)
    event: torch.cuda.Event | None
    pending: object  # the proposer's DeviceDrafts
    drafts: tuple | None  # the drafts' host copy and its event
    argmax: torch.Tensor  # [num_logits] int64, device: the target's argmax of every logits row
    accepted: torch.Tensor  # [len(rows)] int64, device: each request's accepted drafts
    accepted_at: int  # where the accepted counts start in the host copy (`verified`)


class ModelRunner:
    """Runs one step of the target: block copies, inputs, one forward through the target's executor,
    sampling / verification, then the proposer's drafts for the next step. Its collaborators come
    built (engine/build.py): `executors` are every model over the shared block ids (the target's
    first; copy-on-write copies all of their KV)."""

    def __init__(self, executors: list[ModelExecutor], generators: RequestGenerators,
                 proposer: Proposer | None = None, rejection_sampler: RejectionSampler | None = None,
                 seed: int = 0) -> None:
        self.target = executors[0]
        self.executors = executors
        self.model = self.target.model
        self.device = self.target.device
        self.block_size = self.target.block_size
        self.generators = generators
        self.proposer = proposer
        self.rejection_sampler = rejection_sampler
        self.sampler = Sampler()
        self.staging = HostStaging(self.device)  # step inputs, host -> device
        self.token_staging = HostStaging(self.device)  # sampled ids and drafts, device -> host
        self._drafts: DraftsInFlight | None = None  # the last step's, for the next step's inputs
        self._unsettled: DraftsInFlight | None = None  # taken by a step whose host books still hold placeholders
        torch.manual_seed(seed)

    @property
    def kv_cache(self) -> torch.Tensor:
        """The target's KV: [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]."""
        return self.target.kv_cache

    @property
    def graphs(self):
        return self.target.graphs

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy-on-write: copy whole KV blocks src -> dst in every layer (all reads before writes)."""
        if not copies:
            return
        for ex in self.executors:
            ex.copy_blocks(copies)

    @torch.inference_mode()
    def launch(self, sched: SchedulerOutput, prev: LaunchedStep | None = None, defer: bool = False,
               ahead_of: LaunchedStep | None = None) -> LaunchedStep:
        """Hand one step to the device. Tokens of `prev` still in flight feed this step's inputs on the
        device. With `defer` (only for steps whose requests all sample plainly, one token each, with no
        drafts to verify and an idle proposer) the sampled ids stay on the device and `collect` fetches
        them later; a step that verifies and drafts on the device leaves its verification for
        `collect` too; otherwise the step is finished here. `ahead_of`: a verification still in flight
        that this step (`Scheduler.schedule_ahead`'s) follows: its inputs take that step's tokens and
        drafts on the device and move each request back by the drafts it rejected (`StepAhead`)."""
        ahead = self._ahead_inputs(sched, ahead_of) if ahead_of is not None else None
        # a deferred step verifies no drafts (so takes none): its requests need not be looked at
        on_device = ahead is not None or (not defer and self._drafts_on_device(sched))
        drafts = ahead.drafts if ahead is not None else self._fill_drafts(sched, on_device)
        self.generators.forget(sched.finished_req_ids)
        if self.proposer is not None:
            self.proposer.begin_step(sched)
        step = LaunchedStep(sched)
        out = ModelRunnerOutput()
        if sched.is_empty:
            step.result = out
            return step
        self.copy_blocks(sched.block_copies)
        prev_tokens = ahead.tokens if ahead is not None else prev.pending if prev is not None else None
        inputs = build_step_inputs(sched.scheduled, self.block_size, self.device, staging=self.staging,
                                   prev_tokens=prev_tokens, drafts=drafts, graphs=self.target.graphs)
        if ahead is not None:
            ahead.move_back(inputs.positions, inputs.meta, ahead.rows)
        # the aux outputs (an EAGLE head's feature) only where they may be read
        aux = self.proposer is None or self.proposer.needs_aux(sched, defer)
        verdict = None
        if on_device and not defer and inputs.logits_rows and inputs.every_row_logits:
            hidden, verdict = self.target.forward_verifying(inputs.input_ids, inputs.positions, inputs.meta, aux=aux)
        else:
            hidden = self.target.forward(inputs.input_ids, inputs.positions, inputs.meta, aux=aux)
        if defer and inputs.logits_rows:
            step.pending = self._sample_deferred(inputs, hidden)
            if self.proposer is not None:  # idle this step: it only keeps its books (or its KV)
                self.proposer.skip(sched, hidden, step.pending, inputs.meta.slot_mapping)
            return step
        if inputs.logits_rows and on_device:
            step.verifying = self._verify_and_draft(sched, inputs, hidden, out, ahead, verdict)
            return step
        if inputs.logits_rows:
            self._sample(inputs, hidden, out)
        if self.proposer is not None:  # also without logits: a draft model follows every prefill chunk
            out.draft_token_ids = self.proposer.propose(DraftStep(sched, out, hidden, inputs.meta.slot_mapping))
        step.result = out
        return step

    def _drafts_on_device(self, sched: SchedulerOutput) -> bool:
        """Does the proposer draft on the device, and is every sampling request plain greedy?"""
        return (self.proposer is not None and self.proposer.drafts_on_device
                and all(self.verifies_on_device(s.request) for s in sched.scheduled if s.sample))

    @staticmethod
    def verifies_on_device(request) -> bool:
        """Can a step that drafts on the device verify this request there (plain greedy, no forks)?"""
        return not request.forks and plain_greedy(request.sampling_params, request.grammar)

    def drafts_ahead(self, step: LaunchedStep) -> list[int] | None:
        """For a verification in flight (`step`): the drafts it made on the device for each of its
        requests, in its order (0: none), where every one of them samples, some drafted, and none was
        held back from drafting (a drafting batch, which `Scheduler.schedule_ahead` may schedule the
        next step of); else None."""
        pending = step.verifying.pending
        if pending.tokens is None or pending.held_back or not all(s.sample for s in step.sched.scheduled):
            return None
        ks = {slot.sched.request.request_id: slot.k for slot in pending.chained}
        return [ks.get(s.request.request_id, 0) for s in step.sched.scheduled]

    def _ahead_inputs(self, sched: SchedulerOutput, prev: LaunchedStep) -> StepAhead:
        """What a step scheduled ahead of `prev`'s tokens takes from `prev` on the device: each
        request's token after its accepted drafts (the target's argmax there), its drafts, and how
        far it is behind the host's placement (prev's drafts it rejected). The step's requests are
        prev's that go on, in prev's order, then those admitted in it (behind nothing: back 0)."""
        v = prev.verifying
        firsts = [first for _, first, _ in v.rows]
        # prev's requests that go on lead the step, in prev's order; those admitted in it follow (in place)
        row_in_prev = {s.request.request_id: i for i, (s, _, _) in enumerate(v.rows)}
        kept = [row_in_prev[s.request.request_id] for s in sched.scheduled if s.request.request_id in row_in_prev]
        counts = [s.num_tokens for s in sched.scheduled[:len(kept)]]
        every = len(kept) == len(v.rows)  # else some of prev's ended in a step collected after prev was launched
        firsts_d, drafted_d, rows_d, *kept_d = self.staging.to_device(
            [np.asarray(firsts, dtype=np.int64), np.asarray([c - 1 for _, _, c in v.rows], dtype=np.int64),
             np.repeat(np.arange(len(counts), dtype=np.int64), counts)] +
            ([] if every else [np.asarray(kept, dtype=np.int64)]), torch.int64)
        tokens = PendingTokens(v.argmax[firsts_d + v.accepted], row_in_prev, None, None)
        drafted = v.pending.tokens  # a row per request that drafted, in `chained` order
        width = drafted.shape[1]
        chained = [slot.sched.request for slot in v.pending.chained]
        drafts = DraftsInFlight(drafted.reshape(-1), {r.request_id: i * width for i, r in enumerate(chained)},
                                {r.request_id: r for r in chained}, None, None)
        in_place = frozenset(s.request.request_id for s, _, count in v.rows if count == 1)
        back = drafted_d - v.accepted  # per row of prev; the step's: its leading requests', then those admitted
        if not every:
            back = back[kept_d[0]]
        admitted = sum(s.sample for s in sched.scheduled[len(kept):])
        if admitted:
            back = torch.nn.functional.pad(back, (0, admitted))
        return StepAhead(tokens, drafts, back, rows_d, in_place)

    def settle_ahead(self, step: LaunchedStep, prev: LaunchedStep) -> None:
        """`prev` is collected (its tokens are on the host): the books of `step`, launched ahead of
        them, move back by the drafts prev rejected, as the device's inputs did; prev's drafts (which
        `step` took on the device) reach the host books when `step` is collected."""
        result = prev.result
        back = {s.request.request_id: len(s.spec_token_ids) - result.num_accepted.get(s.request.request_id, 0)
                for s in prev.sched.scheduled}
        for s in step.sched.scheduled:
            s.start -= back.get(s.request.request_id, 0)  # none for a request admitted in the step
        pending = step.verifying.pending
        pending.starts = [start - back.get(slot.sched.request.request_id, 0)
                          for slot, start in zip(pending.chained, pending.starts)]
        self._unsettled, self._drafts = self._drafts, None

    def _verify_and_draft(self, sched: SchedulerOutput, inputs: StepInputs, hidden: torch.Tensor,
                          out: ModelRunnerOutput, ahead: StepAhead | None = None,
                          verdict: Verdict | None = None) -> _Verifying:
        """Verification and the next drafts, queued with nothing waited for: the target's argmax of
        every row and the accepted prefixes (on the device) start on their way to the host, and the
        proposer's catch-up and chain are queued behind them. The host half (`_verified`, from
        `collect`) waits for the step's tokens alone (a request's tokens are the argmax of its rows up
        to its first rejected draft's: equal to its drafts before it). The engine collects the step
        before it schedules the next one, and after it has handed this step's predecessor's tokens
        to the user (engine.py: `_step`), so that work overlaps the device's. The drafts stay on the
        device: the next step's inputs take them there (`_fill_drafts`), and their host copy arrives
        meanwhile. Until it is read, the drafts the scheduler holds are placeholders
        (DRAFT_PLACEHOLDER) of the right number. `verdict`: the argmax and accepted counts where the
        forward's graph computed them (`ModelExecutor.forward_verifying`)."""
        rows = inputs.logits_rows
        counts = [c for _, _, c in rows]
        simulated = self.rejection_sampler.simulated_acceptance is not None
        if verdict is not None:
            # the argmax of every row, then each request's accepted count, in one tensor: one copy to the host
            flat, argmax, n, accepted_at = verdict.flat, verdict.argmax, verdict.accepted, verdict.accepted_at
            if simulated:  # (benchmarks) the replayed acceptance replaces the graph's
                self.rejection_sampler.greedy_on_device(argmax, inputs.input_ids, counts, self.staging, out=n)
        else:
            logits = self.target.compute_logits(inputs.at_logits_rows(hidden))
            accepted_at = logits.shape[0]
            flat = torch.empty(accepted_at + len(rows), dtype=torch.long, device=self.device)
            # torch's argmax, not greedy_pick's split: that saved ~12 us of device work on the default model
            # and its two eager Triton launches cost ~80 us of host work a drafting step (H100, BENCHMARKS.md)
            argmax = torch.argmax(logits, dim=-1, out=flat[:accepted_at])
            n = self.rejection_sampler.greedy_on_device(argmax, inputs.at_logits_rows(inputs.input_ids), counts,
                                                        self.staging, out=flat[accepted_at:])
        verified, event = self._to_host([flat])
        pending = self.proposer.draft_on_device(DeviceStep(sched, rows, hidden, inputs.meta.slot_mapping, argmax, n,
                                                           ahead))
        drafts = self._to_host([pending.tokens.reshape(-1)]) if pending.tokens is not None else None
        return _Verifying(out, rows, verified, event, pending, drafts, argmax, n, accepted_at)

    def _verified(self, sched: SchedulerOutput, v: _Verifying) -> ModelRunnerOutput:
        """The host half of `_verify_and_draft`: the step's one wait, then its tokens and the number
        of drafts each request keeps."""
        out, pending = v.out, v.pending
        if v.event is not None:
            v.event.synchronize()  # the step's one wait
        self._settle_drafts(sched)  # this step's drafts (read from the device) reach the host books
        verdict = v.verified[0].tolist()
        tokens, accepted = verdict[:v.argmax.shape[0]], verdict[v.accepted_at:v.accepted_at + len(v.rows)]
        for i, (s, first, _) in enumerate(v.rows):
            if s.request.is_finished:  # by its step before (a step scheduled ahead): its work is dropped
                continue
            req_id = s.request.request_id
            out.sampled_token_ids[req_id] = tokens[first:first + accepted[i] + 1]
            if s.spec_token_ids:
                out.num_accepted[req_id] = accepted[i]
        kept = self.proposer.drafted(pending, out)
        out.draft_token_ids = {req_id: [DRAFT_PLACEHOLDER] * k for req_id, k in kept.items()}
        if kept:
            (host,), drafts_event = v.drafts
            width = pending.tokens.shape[1]
            requests = {slot.sched.request.request_id: slot.sched.request for slot in pending.chained}
            offsets = dict(zip(requests, range(0, len(requests) * width, width)))
            self._drafts = DraftsInFlight(pending.tokens.reshape(-1), offsets, requests, host, drafts_event)
        return out

    def _to_host(self, tensors: list[torch.Tensor]) -> tuple[list[torch.Tensor], torch.cuda.Event | None]:
        """Host copies of 1-D int64 device tensors on their way (pinned, on CUDA) and the event that
        says they have arrived (None: they are there)."""
        if self.device.type != "cuda":
            return tensors, None
        return self.token_staging.to_host(tensors), self.token_staging.last_event

    def _fill_drafts(self, sched: SchedulerOutput, on_device: bool) -> DraftsInFlight | None:
        """The drafts of the last step (`_verify_and_draft`) for this step's inputs. A step that
        verifies on the device with every drafting request scheduled takes them on the device (their
        host copy is read after its wait: `_settle_drafts`); otherwise the host waits for them here."""
        drafts, self._drafts = self._drafts, None
        if self._unsettled is not None:  # a step that failed before its wait
            self._settle_drafts(sched)
        if drafts is None:
            return None
        self._unsettled = drafts
        scheduled = {s.request.request_id for s in sched.scheduled if s.spec_token_ids}
        if on_device and scheduled and all(r in scheduled for r in drafts.row_of if drafts.requests[r].spec_token_ids):
            return drafts
        self._settle_drafts(sched)
        return None

    def _settle_drafts(self, sched: SchedulerOutput) -> None:
        """The last drafts' host copy replaces their placeholders: in their requests (a step may leave
        a request unscheduled) and in this step's."""
        drafts, self._unsettled = self._unsettled, None
        if drafts is None:
            return
        if drafts.event is not None:
            drafts.event.synchronize()
        flat = drafts.host.tolist()
        for req_id, offset in drafts.row_of.items():
            request = drafts.requests[req_id]
            if request.spec_token_ids:  # a prefix of the kept drafts (the scheduler may cut them)
                request.spec_token_ids = flat[offset:offset + len(request.spec_token_ids)]
        for s in sched.scheduled:
            offset = drafts.row_of.get(s.request.request_id)
            if offset is not None and s.spec_token_ids:
                s.spec_token_ids[:] = flat[offset:offset + len(s.spec_token_ids)]

    def collect(self, step: LaunchedStep) -> ModelRunnerOutput:
        """The step's output (waits for its tokens if they are still in flight)."""
        if step.result is None and step.verifying is not None:
            verifying, step.verifying = step.verifying, None
            step.result = self._verified(step.sched, verifying)
        elif step.result is None:
            pending = step.pending
            if pending.event is not None:
                pending.event.synchronize()
            ids = pending.host.tolist()
            step.result = ModelRunnerOutput(sampled_token_ids={r: [ids[i]] for r, i in pending.row_of.items()})
        return step.result

    def _sample_deferred(self, inputs: StepInputs, hidden: torch.Tensor) -> PendingTokens:
        """Sample every row (one per request, no logprobs) on the device; start the copy to the host."""
        rows = [s.request for s, _, _ in inputs.logits_rows]
        logits = self.target.compute_logits(inputs.at_logits_rows(hidden))
        tokens = self.sampler.sample(logits, [self._sampling_row(req) for req in rows])
        row_of = {req.request_id: i for i, req in enumerate(rows)}
        if self.device.type != "cuda":
            return PendingTokens(tokens, row_of, tokens, None)
        (host,) = self.token_staging.to_host([tokens])
        return PendingTokens(tokens, row_of, host, self.token_staging.last_event)

    def _sample(self, inputs: StepInputs, hidden: torch.Tensor, out: ModelRunnerOutput) -> None:
        logits = self.target.compute_logits(inputs.at_logits_rows(hidden))  # [num_logits, V] fp32
        # a request about to fork (SamplingParams.n > 1) samples each child's first token from its
        # own logits row, with the child's own generator
        plain = [(req, row) for s, row, count in inputs.logits_rows if not s.spec_token_ids
                 for req in (s.request, *s.request.forks)]
        if plain:
            rows = [self._sampling_row(req) for req, _ in plain]
            idx = torch.tensor([row for _, row in plain], device=self.device)
            tokens, logprobs = self.sampler(logits[idx], rows)
            for (req, _), token, lp in zip(plain, tokens, logprobs):
                out.sampled_token_ids[req.request_id] = [token]
                if lp is not None:
                    out.logprobs[req.request_id] = [lp]
        verify = [(s, row, count) for s, row, count in inputs.logits_rows if s.spec_token_ids]
        if verify:
            reqs = [s.request for s, _, _ in verify]
            self.rejection_sampler.verify(logits, verify, [self._sampling_row(r) for r in reqs],
                                          [self.proposer.draft_probs(r.request_id) for r in reqs], out)

    def _sampling_row(self, req: Request) -> SamplingRow:
        return SamplingRow(params=req.sampling_params, prompt_token_ids=req.prompt_token_ids,
                           output_token_ids=req.output_token_ids,
                           generator=self.generators.get(req.request_id, req.sampling_params.seed),
                           eos_token_ids=req.eos_token_ids, grammar=req.grammar)
