"""The `Proposer` protocol: what the model runner asks of a draft source every step.

A proposer is owned by the model runner. Every step the runner calls `begin_step(sched)` first
(before any early return, so finished and preempted requests are always forgotten), runs the target
forward, samples / verifies, and then calls `propose(...)` to get the drafts the NEXT step verifies.

Drafts are proposed for requests that sampled this step, from their context *after* this step's
tokens (`request.all_token_ids + out.sampled_token_ids[req_id]`: the runner calls the proposer
before the scheduler appends them). The scheduler may still shorten a draft (token budget,
max_tokens); drafts are always used as a prefix, so per-position draft probabilities stay valid.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:
    from specserve.engine.model_runner import ModelRunner, StepInputs
    from specserve.engine.outputs import ModelRunnerOutput, SchedulerOutput


class Proposer(Protocol):
    """A draft source: n-gram prompt lookup, a draft model, later EAGLE-style heads."""

    #: extra KV slots past a request's scheduled tokens the proposer writes into (the draft model
    #: writes the KV of its own k-1 draft tokens); the scheduler allocates them with the request.
    num_lookahead_tokens: int
    #: added to the prefix-cache block hash extra keys (the draft model's identity), or None.
    cache_identity: tuple | None

    def kv_bytes_per_block(self, block_size: int) -> int:
        """Bytes of proposer KV per cache block (0 if it keeps none): sizes the shared pool."""

    def bind(self, runner: ModelRunner, max_model_len: int) -> None:
        """Attach to the runner (allocate KV over the runner's block ids, register it for copies)."""

    def begin_step(self, sched: SchedulerOutput) -> None:
        """Forget finished and preempted requests; follow the step's copy-on-write block copies."""

    def propose(self, runner: ModelRunner, sched: SchedulerOutput, inputs: StepInputs,
                hidden: torch.Tensor, out: ModelRunnerOutput) -> dict[str, list[int]]:
        """Drafts for the next step, per request. hidden: [num_tokens, hidden_size] (unused so far)."""

    def idle(self, sched: SchedulerOutput) -> bool:
        """True when `propose` after this step (which verifies no drafts) would return no drafts
        whatever the step samples. The engine may then keep the step's tokens on the device (async
        scheduling) and call `skip` instead of `propose`."""

    def skip(self, sched: SchedulerOutput) -> None:
        """The step ran without `propose` (see `idle`): keep the books (e.g. a draft model marks the
        blocks the target wrote as stale for its own KV)."""

    def draft_probs(self, req_id: str) -> torch.Tensor | None:
        """[num_drafts, vocab] probabilities the request's current drafts were sampled from;
        None = the drafts are deterministic (q is one-hot on each draft token)."""
