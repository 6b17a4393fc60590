"""Draft-model proposer: a smaller causal LM of our family (same tokenizer) drafts k tokens.

KV layout. The draft runs through a ModelExecutor of its own (engine/executor.py: the engine builder
makes it from `draft_model`), whose KV tensor lives over the SAME block ids as the target's: a
request's block table addresses the target's KV and the draft's KV for the same tokens, copy-on-write
copies both, and a prefix-cache hit skips the draft's prefill as well as the target's. For
that to hold, the draft runs over every token the target computes, in the same step (prefill chunks
included): a block registered in the prefix index always holds the draft's KV for its tokens too.

Bookkeeping (spec_decode/draft_kv.py). Per request the draft's KV is valid for positions [0, n).
Each step the draft
  1. catches up, in ONE ragged forward over all scheduled requests, from n to the target's
     verified end (plus the newest sampled token for requests that get drafts); rejected drafts
     need no cleanup: n = min(n, verified) and their slots are simply written again;
  2. proposes k tokens autoregressively for the requests the adaptive policy picked (the first
     comes from the catch-up forward), writing its own drafts' KV into the lookahead slots the
     scheduler allocated (`num_lookahead_tokens`).

When the policy gives every request k = 0 (a batch that saturates compute), the draft does not run
at all and falls behind; it catches up in one batched forward when speculation resumes. Blocks the
target wrote meanwhile are marked stale, so a prefix hit on them does not trust the draft's KV there
and the draft recomputes those positions for the new request.

Random (non-greedy) requests sample their drafts from q = probs_for(draft logits) with the
request's temperature / top-k / top-p and generator; q is kept for the rejection sampler.
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from specserve.engine.cuda_graphs import query_lens_up_to
from specserve.engine.outputs import SchedulerOutput
from specserve.models.llama import LlamaForCausalLM
from specserve.sample.sampler import argmax_rows, draw, probs_for
from specserve.spec_decode.adaptive import (AdaptiveK, DraftSlot, nothing_to_draft, plan_step, skipped,
                                             step_verified)
from specserve.spec_decode.draft_kv import DraftEntries
from specserve.spec_decode.proposer import DraftStep, ProposerBinding

if TYPE_CHECKING:
    from specserve.engine.executor import ModelExecutor
    from specserve.sample.sampler import RequestGenerators

logger = logging.getLogger(__name__)


class DraftModelProposer:
    drafts_on_device = False  # its chain runs step by step on the host's tokens

    def __init__(self, model: LlamaForCausalLM, policy: AdaptiveK, *, identity: tuple,
                 num_speculative_tokens: int, max_num_batched_tokens: int) -> None:
        """`model`: a loaded draft (or an already-built one, e.g. the target's weights quantized);
        `identity`: what distinguishes its KV in the prefix-cache hash (path, dtype, quantization)."""
        self.draft_model = model
        self.policy = policy
        self.cache_identity = ("draft", *identity)
        self.num_lookahead_tokens = num_speculative_tokens
        # its chain's steps are one token per request; a catch-up is the bonus token + accepted drafts
        self.draft_query_lens = query_lens_up_to(1 + num_speculative_tokens)
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = 0
        self.executor: ModelExecutor | None = None  # set by bind
        self.generators: RequestGenerators | None = None
        self._probs: dict[str, torch.Tensor | None] = {}  # q of the current drafts; None = greedy
        self.entries = DraftEntries(1, 0)  # sized by bind

    def bind(self, binding: ProposerBinding) -> None:
        assert binding.draft is not None, "the engine builds an executor for the declared draft_model"
        self.executor, self.generators = binding.draft, binding.generators
        self.max_model_len = binding.max_model_len
        self.entries = DraftEntries(binding.draft.block_size, binding.draft.kv_cache.shape[2])
        self.policy.bind(binding)

    def capture_graphs(self, max_model_len: int, max_num_seqs: int) -> None:
        """Nothing of its own to capture (a draft model's steps replay its executor's graphs)."""

    def begin_step(self, sched: SchedulerOutput) -> None:
        for req_id in sched.finished_req_ids | sched.preempted_req_ids:
            self.entries.forget(req_id)
            self._probs.pop(req_id, None)
        for req_id in sched.finished_req_ids:
            self.policy.remove(req_id)
        self.entries.follow_copies(sched.block_copies)
        self.policy.step_started()

    def waiting(self) -> None:
        self.policy.waiting()

    def idle(self, sched: SchedulerOutput) -> bool:
        return nothing_to_draft(self.policy, sched, self.entries.behind)

    def needs_aux(self, sched: SchedulerOutput, deferred: bool) -> bool:
        return False  # it reads no hidden states

    def skip(self, sched: SchedulerOutput, hidden=None, pending=None, slot_mapping=None) -> None:
        """Like a step where every request gets k = 0: the draft falls behind, the blocks the target
        wrote are stale for it. (No drafts were verified: the target computed [start, start + n).)"""
        self.entries.fall_behind((s, s.start + s.num_tokens) for s in sched.scheduled)
        skipped(self.policy, sched)

    def draft_probs(self, req_id: str) -> torch.Tensor | None:
        assert req_id in self._probs, f"{req_id} has drafts the draft model did not propose"
        return self._probs[req_id]

    # -- the step --------------------------------------------------------------------------------
    @torch.inference_mode()
    def propose(self, step: DraftStep) -> dict[str, list[int]]:
        try:
            return self._propose(step)
        finally:
            self.policy.proposals_made()  # the step's time, the draft model's included, goes to the guard

    def _propose(self, step: DraftStep) -> dict[str, list[int]]:
        sched, out = step.sched, step.out
        step_verified(self.policy, sched, out)
        slots = {s.sched.request.request_id: s for s in
                 plan_step(self.policy, sched, out, self.max_model_len, self.max_num_batched_tokens,
                           self.entries.behind)}
        for req_id in slots:
            self._probs.pop(req_id, None)  # its drafts were verified (or it gets none)
        run = any(s.k > 0 for s in slots.values())
        segments = []  # (scheduled, first position to compute, verified end, slot if it sampled)
        behind = []
        for s in sched.scheduled:
            slot = slots.get(s.request.request_id)
            verified = s.request.num_tokens + len(slot.new_ids) - 1 if slot else s.start + s.num_tokens
            if not run:
                behind.append((s, verified))
            else:
                segments.append((s, self.entries.valid(s, verified), verified, slot))
        if not run:
            self.entries.fall_behind(behind)
            return {}
        drafts = self._run(segments)
        for s, done, verified, _ in segments:
            self.entries.mark(s.block_ids, done, verified, stale=False)
        return drafts

    def _run(self, segments: list[tuple]) -> dict[str, list[int]]:
        """Catch-up forward over all segments (first drafts from its logits), then k - 1 more steps."""
        executor = self.executor
        device = executor.device
        input_ids: list[int] = []
        query_lens, seq_lens, tables, last_rows = [], [], [], []
        proposing: list[DraftSlot] = []
        ends: list[int] = []  # per proposing request: context length (its last token is new)
        behind_rows = 0  # rows from before the step's positions: a spell's start (the draft had not run)
        for s, done, verified, slot in segments:
            drafting = slot is not None and slot.k > 0
            end = verified + 1 if drafting else verified  # a drafting request feeds its newest token
            self.entries.computed[s.request.request_id] = end
            if end <= done:
                continue
            behind_rows += max(0, min(s.start, end) - done)
            input_ids += _context(s.request, slot.new_ids if slot else [], done, end)
            query_lens.append(end - done)
            seq_lens.append(end)
            tables.append(s.block_ids)
            if drafting:
                last_rows.append(len(input_ids) - 1)
                proposing.append(slot)
                ends.append(end)
        if not query_lens:
            return {}
        hidden = self.policy.timed_catch_up(executor.device, behind_rows, len(input_ids),
                                            lambda: executor.forward_tokens(input_ids, query_lens, seq_lens, tables))
        if not proposing:
            return {}
        logits = executor.compute_logits(hidden[torch.tensor(last_rows, device=device)])  # [P, V]
        ks = [slot.k for slot in proposing]
        max_k = max(ks)
        tokens = torch.zeros(len(proposing), max_k, dtype=torch.long, device=device)  # [P, K]
        probs: list[list[torch.Tensor]] = [[] for _ in proposing]
        active = list(range(len(proposing)))
        for j in range(max_k):
            if j > 0:  # feed draft j-1 at position end - 1 + j
                active = [i for i in active if ks[i] > j]
                hidden = executor.forward_tokens(tokens[active, j - 1], [1] * len(active),
                                                 [ends[i] + j for i in active],
                                                 [proposing[i].sched.block_ids for i in active])
                logits = executor.compute_logits(hidden)
            tokens[active, j] = self._sample(logits, [proposing[i] for i in active], [probs[i] for i in active])
        drafts: dict[str, list[int]] = {}
        for i, (slot, row) in enumerate(zip(proposing, tokens.tolist())):
            req_id = slot.sched.request.request_id
            drafts[req_id] = row[:ks[i]]
            self.entries.computed[req_id] = ends[i] + ks[i] - 1  # its last draft's KV is not written
            self._probs[req_id] = torch.stack(probs[i]) if probs[i] else None
        return drafts

    def _sample(self, logits: torch.Tensor, slots: list[DraftSlot], probs: list[list[torch.Tensor]]
                ) -> torch.Tensor:
        """One draft token per row of logits [N, V]; random requests keep the q they drew from."""
        params = [slot.sched.request.sampling_params for slot in slots]
        if all(p.greedy for p in params):
            return argmax_rows(logits)
        q = probs_for(logits, params)  # [N, V], one-hot for greedy rows
        gens = [None if p.greedy else self.generators.get(slot.sched.request.request_id, p.seed)
                for slot, p in zip(slots, params)]
        out = draw(q, gens)
        for i, p in enumerate(params):
            if not p.greedy:
                probs[i].append(q[i])
        return out


def _context(req, new_ids: list[int], start: int, end: int) -> list[int]:
    """Tokens [start, end) of the request's context after this step (`new_ids` appended)."""
    num = req.num_tokens
    if end <= num:
        return req.all_token_ids[start:end]
    return req.all_token_ids[start:] + new_ids[max(0, start - num):end - num]
