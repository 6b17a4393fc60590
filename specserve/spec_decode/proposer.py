"""The `Proposer` protocol: the one seam between the engine and a draft source.

A proposer never sees the model runner. It declares what it needs as attributes (extra KV slots, a
draft model whose KV the engine keeps under the same block ids, a prefix-cache identity); the engine
builder provides it (`ProposerBinding`: executors, the request generators, sizes), and every step
the runner hands it plain data:

1. `begin_step(sched)` first (before any early return, so finished and preempted requests are always
   forgotten, and copy-on-write copies followed);
2. after the target forward and sampling / verification, `propose(DraftStep)`: drafts for the NEXT
   step, for requests that sampled this step, from their context *after* this step's tokens
   (`request.all_token_ids + step.out.sampled_token_ids[req_id]`: the scheduler appends them later).
   The scheduler may still shorten a draft (token budget, max_tokens); drafts are always used as a
   prefix, so per-position draft probabilities stay valid;
3. or, on a step the engine left in flight because `idle(sched)` said no draft could pay,
   `skip(sched)` instead of `propose` (before any step's forward, the runner asks whether it
   `needs_aux` of that step);
4. or, for a proposer with `drafts_on_device` and a step whose sampling requests are all plain
   greedy, `draft_on_device(DeviceStep)` instead of `propose`, before the step's verification has
   reached the host (its accepted counts are device tensors), then `drafted(...)` once the host has
   the step's tokens: the host waits for the verification only; the drafts reach the host while it
   resolves and schedules the next step (the runner fills them in before that step's inputs).
   With async drafting the next step may be launched before this one's tokens reach the host
   (`Scheduler.schedule_ahead`): its `DeviceStep.ahead` says how far each request is behind the
   host's books on the device; its `drafted(...)` comes after the runner moved its books back.
5. `waiting()` once the engine's last request has ended (finished or aborted): it waits for new ones,
   and nothing may be timed across the pause.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:
    from specserve.engine.executor import ModelExecutor
    from specserve.engine.outputs import ModelRunnerOutput, ScheduledRequest, SchedulerOutput
    from specserve.engine.step_inputs import PendingTokens, StepAhead
    from specserve.models.llama import LlamaForCausalLM
    from specserve.sample.sampler import RequestGenerators
    from specserve.spec_decode.eagle import DeviceDrafts


@dataclass(slots=True)
class ProposerBinding:
    """What the engine gives a proposer once, before the first step."""

    target: ModelExecutor  # the target's executor (a start-up cost profile runs through it)
    draft: ModelExecutor | None  # the executor of the proposer's `draft_model`, if it declared one
    generators: RequestGenerators  # per-request generators, shared with the target's sampling
    max_model_len: int
    async_scheduling: bool = False  # steps without drafts to verify may be left in flight (`idle` / `skip`)


@dataclass(slots=True)
class DraftStep:
    """One finished step, as a proposer sees it."""

    sched: SchedulerOutput
    out: ModelRunnerOutput  # this step's sampled tokens and acceptance counts
    hidden: torch.Tensor  # [num_tokens, hidden_size]: the target's last hidden states of this step
    slot_mapping: torch.Tensor  # [num_tokens] int64, device: the KV slot of each of those rows


@dataclass(slots=True)
class DeviceStep:
    """A step of plain greedy requests whose verification is still on the device."""

    sched: SchedulerOutput
    logits_rows: list[tuple[ScheduledRequest, int, int]]  # (request, its first logits row, 1 + its drafts)
    hidden: torch.Tensor  # [num_tokens, hidden_size]: the target's last hidden states of this step
    slot_mapping: torch.Tensor  # [num_tokens] int64, device: the KV slot of each of those rows
    argmax: torch.Tensor  # [num_logits] int64, device: the target's argmax of every logits row
    num_accepted: torch.Tensor  # [len(logits_rows)] int64, device: each request's accepted drafts
    # a step scheduled ahead of its predecessor's tokens: the host's positions are each request's if
    # every draft of the predecessor was accepted; on the device it is `ahead.back` behind them
    ahead: StepAhead | None = None


class Proposer(Protocol):
    """A draft source: n-gram prompt lookup, a draft model, an EAGLE-style head."""

    #: extra KV slots past a request's scheduled tokens the proposer writes into (the draft model
    #: writes the KV of its own k-1 draft tokens); the scheduler allocates them with the request.
    num_lookahead_tokens: int
    #: added to the prefix-cache block hash extra keys (the draft model's identity), or None.
    cache_identity: tuple | None
    #: a model the engine must run over the shared block ids (KV, graphs), or None.
    draft_model: LlamaForCausalLM | None
    #: the query lengths (tokens per request) of the draft model's forwards to capture CUDA graphs for.
    draft_query_lens: tuple[int, ...]
    #: drafts plain greedy steps through `draft_on_device` / `drafted` (step 4 above).
    drafts_on_device: bool

    def bind(self, binding: ProposerBinding) -> None:
        """Called once by the engine builder, before the first step."""

    def capture_graphs(self, max_model_len: int, max_num_seqs: int) -> None:
        """On CUDA, after the executors captured theirs: capture the proposer's own graphs (if any)."""

    def begin_step(self, sched: SchedulerOutput) -> None:
        """Forget finished and preempted requests; follow the step's copy-on-write block copies."""

    def propose(self, step: DraftStep) -> dict[str, list[int]]:
        """Drafts for the next step, per request id."""

    def idle(self, sched: SchedulerOutput) -> bool:
        """True when `propose` after this step (which verifies no drafts) would return no drafts
        whatever the step samples. The engine may then keep the step's tokens on the device (async
        scheduling) and call `skip` instead of `propose`."""

    def needs_aux(self, sched: SchedulerOutput, deferred: bool) -> bool:
        """Before the step's forward (`deferred`: the engine leaves it in flight, see `idle`): will the
        proposer read the aux outputs of the target's forward (an EAGLE head's fused feature)? False
        lets the target leave them out of the step (then `skip`, `propose` or `draft_on_device` gets
        the final hidden states alone)."""

    def skip(self, sched: SchedulerOutput, hidden: torch.Tensor, pending: PendingTokens,
             slot_mapping: torch.Tensor) -> None:
        """The step ran without `propose` (see `idle`): keep the books (e.g. a draft model marks the
        blocks the target wrote as stale for its own KV; an EAGLE head stores `hidden`, the step's
        hidden states, at their KV slots `slot_mapping`; `pending`: the step's sampled tokens, still
        on the device)."""

    def draft_on_device(self, step: DeviceStep) -> DeviceDrafts:
        """Queue the next step's drafts on the device from a step whose verification is still there
        (only with `drafts_on_device`). The result's `tokens` [P, K] are read by the runner."""

    def drafted(self, pending: DeviceDrafts, out: ModelRunnerOutput) -> dict[str, int]:
        """After `draft_on_device`: the step's tokens are in `out`; the drafts (`pending.tokens`) may
        still be on the device. Keep the books; return how many drafts (a prefix of its row of
        `pending.tokens`) each request keeps for the next step."""

    def waiting(self) -> None:
        """The engine has no request left and waits for new ones (after the step that finished the
        last): nothing may be timed across the wait."""

    def draft_probs(self, req_id: str) -> torch.Tensor | None:
        """[num_drafts, vocab] probabilities the request's current drafts were sampled from;
        None = the drafts are deterministic (q is one-hot on each draft token)."""
