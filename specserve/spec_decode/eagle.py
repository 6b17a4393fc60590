"""EAGLE proposer: a one-layer draft head (eagle_head.py) over the target's hidden states drafts k
tokens per request, chained on its own outputs.

KV. The head runs through a ModelExecutor of its own whose KV (one layer) lives under the SAME
block ids as the target's (as a draft model's does: copy-on-write copies it, the prefix cache
keys on the head's identity). Its entry at position j reads (x_j, h_{j-1}) and so depends only on
tokens 0..j: a block the prefix cache finds holds valid head entries for its tokens.

Catch-up, every step. The head's entries need the target's hidden states, which exist only in the
step that computed them. So in EVERY step -- also when adaptive k gives every request k = 0, and on
steps async scheduling leaves in flight (`skip`: the sampled tokens are still on the device) -- the
head runs one ragged forward over the step's rows: target row i of a request (position s + i,
hidden h_{s+i}) becomes head entry s + i + 1 with token x_{s+i+1} (the next input token, or the
token sampled from that row). A verification keeps only its accepted rows and the bonus token's. A
request new to the head (admitted, preempted, forked) also gets its entry at its first computed
position s, with zeros for the hidden state it does not have: exact at s = 0 (as trained),
approximate after a prefix-cache hit (the drafts may be worse there, never the output). The
catch-up costs one decoder layer over the step's tokens (~1/num_layers of the target's compute),
without the LM head.

Drafting, when adaptive k gives a request k > 0: its last catch-up row (the entry of the newest
token) gives the first draft's logits; each further draft is one more head forward of one token
per drafting request at the next position, with the previous draft as token and the head's own
output as hidden state. Tokens stay on the device until the k drafts are done (one host sync per
step). Random requests sample drafts from q = probs_for(draft logits) with their temperature /
top-k / top-p and generator; q, zero outside the draft vocabulary, is kept for the rejection sampler.
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import numpy as np
import torch

from specserve.engine.outputs import SchedulerOutput
from specserve.engine.step_inputs import PendingTokens, batch_metadata
from specserve.sample.sampler import draw, probs_for
from specserve.spec_decode.adaptive import AdaptiveK, DraftSlot, nothing_to_draft, plan_step, step_verified
from specserve.spec_decode.draft_model import _context
from specserve.spec_decode.eagle_head import EagleHead
from specserve.spec_decode.proposer import DraftStep, ProposerBinding

if TYPE_CHECKING:
    from specserve.engine.executor import ModelExecutor
    from specserve.sample.sampler import RequestGenerators

logger = logging.getLogger(__name__)


class EagleProposer:
    def __init__(self, head: EagleHead, policy: AdaptiveK, *, identity: tuple, num_speculative_tokens: int,
                 max_num_batched_tokens: int) -> None:
        self.draft_model = head
        self.head = head
        self.policy = policy
        self.cache_identity = ("eagle", *identity)
        self.num_lookahead_tokens = num_speculative_tokens  # the chain's entries past the newest token
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = 0
        self.block_size = 0
        self.executor: ModelExecutor | None = None  # set by bind
        self.generators: RequestGenerators | None = None
        self._seen: set[str] = set()  # requests whose head entries are written up to their computed tokens
        self._probs: dict[str, torch.Tensor | None] = {}  # q of the current drafts; None = greedy

    def bind(self, binding: ProposerBinding) -> None:
        assert binding.draft is not None, "the engine builds an executor for the declared draft_model"
        self.executor, self.generators = binding.draft, binding.generators
        self.block_size = binding.draft.block_size
        self.max_model_len = binding.max_model_len
        if self.policy.profile_on_bind:
            self.policy.calibrate(binding.target, binding.draft)

    def begin_step(self, sched: SchedulerOutput) -> None:
        for req_id in sched.finished_req_ids | sched.preempted_req_ids:
            self._seen.discard(req_id)  # a preempted request starts over (from its prefix hits)
            self._probs.pop(req_id, None)
        for req_id in sched.finished_req_ids:
            self.policy.remove(req_id)
        self.policy.step_started()

    def idle(self, sched: SchedulerOutput) -> bool:
        return nothing_to_draft(self.policy, sched)

    def skip(self, sched: SchedulerOutput, hidden: torch.Tensor, pending: PendingTokens) -> None:
        """A step left in flight: the catch-up still runs, with the sampled tokens from the device."""
        self._catch_up(sched, hidden, {}, pending)
        self.policy.guard.tick()

    def draft_probs(self, req_id: str) -> torch.Tensor | None:
        assert req_id in self._probs, f"{req_id} has drafts the EAGLE head did not propose"
        return self._probs[req_id]

    # -- the step --------------------------------------------------------------------------------
    @torch.inference_mode()
    def propose(self, step: DraftStep) -> dict[str, list[int]]:
        sched, out = step.sched, step.out
        step_verified(self.policy, sched, out)
        slots = plan_step(self.policy, sched, out, self.max_model_len, self.max_num_batched_tokens)
        for slot in slots:
            self._probs.pop(slot.sched.request.request_id, None)  # its drafts were verified (or it gets none)
        try:
            g, last_row = self._catch_up(sched, step.hidden, out.sampled_token_ids, None)
            drafting = [slot for slot in slots if slot.k > 0 and slot.sched.request.request_id in last_row]
            return self._chain(g, drafting, last_row) if drafting else {}
        finally:  # the step's time, catch-up and drafting included, goes to the guard
            self.policy.proposals_made()

    def _catch_up(self, sched: SchedulerOutput, hidden: torch.Tensor, sampled: dict[str, list[int]],
                  pending: PendingTokens | None) -> tuple[torch.Tensor | None, dict[str, tuple[int, int]]]:
        """The head's entries for this step's rows (see the module doc). Returns its outputs and,
        per request, (its last row in them, that row's position)."""
        zero_row = hidden.shape[0]  # index of a zero hidden state, appended below when a row needs it
        ids: list[int] = []
        hidden_idx: list[int] = []
        query_lens, seq_lens, tables = [], [], []
        fill_dst, fill_src = [], []  # (deferred steps) rows whose token is on the device
        last_row: dict[str, tuple[int, int]] = {}
        row0 = 0
        for s in sched.scheduled:
            req = s.request
            req_id = req.request_id
            first, row0 = row0, row0 + s.num_tokens
            new_ids = sampled.get(req_id, [])
            # rows of the target that hold real tokens: a verification keeps its accepted drafts
            use = len(new_ids) if s.spec_token_ids else s.num_tokens
            limit = min(len(s.block_ids) * self.block_size, self.max_model_len)  # positions with a KV slot
            start = s.start if req_id not in self._seen else s.start + 1
            end = min(s.start + use + 1, limit)  # head entries [start, end)
            self._seen.add(req_id)
            if end <= start:
                continue
            base = len(ids)
            in_flight = pending is not None and s.sample and s.start + use >= req.num_tokens
            known_end = end - 1 if in_flight else end
            ids += _context(req, new_ids, start, known_end)
            if in_flight:  # the token sampled from the last row is still on the device
                fill_dst.append(len(ids))
                fill_src.append(pending.row_of[req_id])
                ids.append(0)
            hidden_idx += [first + p - s.start - 1 if p > s.start else zero_row for p in range(start, end)]
            query_lens.append(end - start)
            seq_lens.append(end)
            tables.append(s.block_ids)
            last_row[req_id] = (base + end - start - 1, end - 1)
        if not query_lens:
            return None, {}
        extra = [np.asarray(ids, dtype=np.int64), np.asarray(hidden_idx, dtype=np.int64),
                 np.asarray(fill_dst, dtype=np.int64), np.asarray(fill_src, dtype=np.int64)]
        ex = self.executor
        positions, meta, (ids_d, idx_d, dst, src) = batch_metadata(query_lens, seq_lens, tables, self.block_size,
                                                                   ex.device, staging=ex.staging,
                                                                   extra_int64=extra)
        if fill_dst:
            ids_d[dst] = pending.tokens[src]
        if zero_row in hidden_idx:  # a request new to the head: its first entry reads zeros (rare: admissions)
            hidden = torch.cat([hidden, hidden.new_zeros(1, hidden.shape[1])])
        g = ex.forward(ids_d, positions, meta, hidden_states=hidden[idx_d].to(self._dtype))
        return g, last_row

    @property
    def _dtype(self) -> torch.dtype:
        return self.head.fc.weight.dtype

    def _chain(self, g: torch.Tensor, drafting: list[DraftSlot], last_row: dict[str, tuple[int, int]]
               ) -> dict[str, list[int]]:
        """k drafts per drafting request: the first from its last catch-up row, each next one from a
        head forward of one token per request (draft j - 1 and the head's output before it)."""
        ex = self.executor
        device = ex.device
        rows = [last_row[slot.sched.request.request_id] for slot in drafting]
        ks = [slot.k for slot in drafting]
        max_k = max(ks)
        tokens = torch.zeros(len(drafting), max_k, dtype=torch.long, device=device)  # [P, K] target ids
        probs: list[list[torch.Tensor]] = [[] for _ in drafting]
        out = g[torch.tensor([r for r, _ in rows], device=device)]  # [P, h]
        active = list(range(len(drafting)))
        for j in range(max_k):
            if j > 0:  # entry at the newest token's position + j: (draft j, the head's previous output)
                keep = [a for a, i in enumerate(active) if ks[i] > j]
                active = [active[a] for a in keep]
                out = out[torch.tensor(keep, device=device)] if len(keep) < out.shape[0] else out
                seq = [rows[i][1] + j + 1 for i in active]
                out = ex.forward_tokens(tokens[active, j - 1], [1] * len(active), seq,
                                        [drafting[i].sched.block_ids for i in active], hidden_states=out)
            logits = ex.compute_logits(out)
            tokens[active, j] = self._sample(logits, [drafting[i] for i in active], [probs[i] for i in active])
        drafts: dict[str, list[int]] = {}
        for i, (slot, row) in enumerate(zip(drafting, tokens.tolist())):
            req_id = slot.sched.request.request_id
            drafts[req_id] = row[:ks[i]]
            self._probs[req_id] = torch.stack(probs[i]) if probs[i] else None
        return drafts

    def _sample(self, logits: torch.Tensor, slots: list[DraftSlot], probs: list[list[torch.Tensor]]
                ) -> torch.Tensor:
        """One draft per row of draft-vocabulary logits [N, Vd], as a target id; random requests
        keep q over the target vocabulary (zero outside the draft vocabulary)."""
        vocab = self.head.draft_vocab
        params = [slot.sched.request.sampling_params for slot in slots]
        if all(p.greedy for p in params):
            return vocab[logits.argmax(dim=-1)]
        q = probs_for(logits, params)  # [N, Vd], one-hot for greedy rows
        gens = [None if p.greedy else self.generators.get(slot.sched.request.request_id, p.seed)
                for slot, p in zip(slots, params)]
        picked = draw(q, gens)
        for i, p in enumerate(params):
            if not p.greedy:
                full = q.new_zeros(self.head.cfg.vocab_size)
                full[vocab] = q[i]
                probs[i].append(full)
        return vocab[picked]
