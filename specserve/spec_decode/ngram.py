"""N-gram prompt lookup: draft the tokens that followed the last occurrence of the current suffix.

No model, no KV: for each request, find the longest n-gram (prompt_lookup_max down to
prompt_lookup_min tokens) that ends the context and occurred earlier in prompt + output, and propose
the k tokens that followed it. Works well when the output copies its input (code edits, summaries,
retrieval, repetitive text). Drafts are deterministic: the rejection sampler treats q as one-hot.

Each request's context lives in a growing numpy buffer (appended to, never rebuilt), and the
search is vectorised over candidate positions: a few numpy calls per request per step.
"""
from __future__ import annotations

import numpy as np
import torch

from specserve.engine.outputs import SchedulerOutput
from specserve.engine.request import Request
from specserve.spec_decode.adaptive import AdaptiveK, nothing_to_draft, sampled_slots, skipped, step_verified
from specserve.spec_decode.proposer import DraftStep, ProposerBinding


def find_ngram_drafts(tokens: np.ndarray, min_n: int, max_n: int, k: int) -> tuple[np.ndarray, int]:
    """Drafts for the context `tokens` ([L] int64): the tokens that followed the longest earlier
    occurrence (>= min_n tokens) of the context's suffix. Among equally long matches, prefer one
    followed by k tokens, then the most recent. Returns ([<= k] drafts, match length); no match:
    (empty, 0)."""
    length = len(tokens)
    if length < 2 or k <= 0:
        return tokens[:0], 0
    # candidate match ends: earlier positions holding the last token
    ends = np.flatnonzero(tokens[:length - 1] == tokens[length - 1])
    if len(ends) == 0:
        return tokens[:0], 0
    match = np.ones(len(ends), dtype=np.int64)  # matched suffix length per candidate
    alive = np.ones(len(ends), dtype=bool)
    for j in range(1, min(max_n, length - 1)):
        prev = ends - j
        ok = alive & (prev >= 0)
        ok[ok] = tokens[prev[ok]] == tokens[length - 1 - j]
        match += ok
        alive = ok
        if not alive.any():
            break
    best = int(match.max())
    if best < min_n:
        return tokens[:0], 0
    cands = ends[match == best]
    full = cands[cands + k < length]  # followed by k tokens
    start = (full[-1] if len(full) else cands[-1]) + 1
    return tokens[start:start + k], best


class _Context:
    """A request's token ids in a numpy buffer that grows by appending."""

    __slots__ = ("buf", "length")

    def __init__(self) -> None:
        self.buf = np.empty(256, dtype=np.int64)
        self.length = 0

    def sync(self, req: Request, new_ids: list[int]) -> np.ndarray:
        """Bring the buffer to `req.all_token_ids + new_ids` (an extension of what it holds)."""
        have, num = self.length, req.num_tokens
        tail = (req.all_token_ids[have:] + new_ids) if have <= num else new_ids[have - num:]
        end = have + len(tail)
        if end > len(self.buf):
            grown = np.empty(max(2 * len(self.buf), end), dtype=np.int64)
            grown[:have] = self.buf[:have]
            self.buf = grown
        self.buf[have:end] = tail
        self.length = end
        return self.buf[:end]


class NgramProposer:
    num_lookahead_tokens = 0
    draft_query_lens = ()
    cache_identity = None
    draft_model = None
    drafts_on_device = False  # lookups read the tokens on the host

    def __init__(self, policy: AdaptiveK, *, prompt_lookup_min: int, prompt_lookup_max: int,
                 max_num_batched_tokens: int) -> None:
        """`policy` estimates acceptance per match length (the key), not per request; before any
        verification a match of n tokens is assumed accepted with probability n / (n + 1)."""
        self.policy = policy
        policy.prior_of = lambda n: n / (n + 1)
        policy.best_prior = prompt_lookup_max / (prompt_lookup_max + 1)
        self.min_n, self.max_n = prompt_lookup_min, prompt_lookup_max
        self.max_model_len = 0  # set by bind()
        self.max_num_batched_tokens = max_num_batched_tokens
        self._contexts: dict[str, _Context] = {}
        self._match_len: dict[str, int] = {}  # the match length of each request's current drafts

    def bind(self, binding: ProposerBinding) -> None:
        self.max_model_len = binding.max_model_len
        self.policy.bind(binding)

    def capture_graphs(self, max_model_len: int, max_num_seqs: int) -> None:
        """Nothing to capture: n-gram lookup runs no model."""

    def begin_step(self, sched: SchedulerOutput) -> None:
        for req_id in sched.finished_req_ids:
            self._contexts.pop(req_id, None)
            self._match_len.pop(req_id, None)
        self.policy.step_started()

    def propose(self, step: DraftStep) -> dict[str, list[int]]:
        try:
            return self._propose(step)
        finally:
            self.policy.proposals_made()  # the step's time, lookups included, goes to the guard

    def _propose(self, step: DraftStep) -> dict[str, list[int]]:
        sched, out = step.sched, step.out
        step_verified(self.policy, sched, out)
        slots, num_base = sampled_slots(self.policy, sched, out, self.max_model_len,
                                        key_of=lambda req_id: self._match_len.get(req_id, 0))
        budget = self.max_num_batched_tokens - num_base
        if budget <= 0 or not slots or not self.policy.worth_trying(len(slots), num_base):
            return {}  # no draft can pay off in this batch: skip even the lookups
        found: dict[str, np.ndarray] = {}
        keys: dict[str, int] = {}
        for slot in slots:
            if slot.room <= 0:
                continue
            req = slot.sched.request
            ctx = self._contexts.get(req.request_id)
            if ctx is None:
                ctx = self._contexts[req.request_id] = _Context()
            tokens, n = find_ngram_drafts(ctx.sync(req, slot.new_ids), self.min_n, self.max_n,
                                          min(slot.room, self.policy.max_k))
            if n:
                found[req.request_id], keys[req.request_id] = tokens, n
        if not found:
            return {}
        ks = self.policy.plan({r: len(t) for r, t in found.items()}, num_base, budget, keys)
        drafts = {r: found[r][:k].tolist() for r, k in ks.items() if k > 0}
        for r in drafts:
            self._match_len[r] = keys[r]
        return drafts

    def waiting(self) -> None:
        self.policy.waiting()

    def idle(self, sched: SchedulerOutput) -> bool:
        return nothing_to_draft(self.policy, sched)

    def needs_aux(self, sched: SchedulerOutput, deferred: bool) -> bool:
        return False  # it reads no hidden states

    def skip(self, sched: SchedulerOutput, hidden=None, pending=None, slot_mapping=None) -> None:
        skipped(self.policy, sched)  # contexts catch up from the requests' tokens at the next lookup

    def draft_probs(self, req_id: str) -> torch.Tensor | None:
        return None
