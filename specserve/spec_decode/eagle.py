"""EAGLE proposer: a one-layer draft head (eagle_head.py) over the target's hidden states drafts k
tokens per request, chained on its own outputs.

KV. The head runs through a ModelExecutor of its own whose KV (one layer) lives under the SAME
block ids as the target's (as a draft model's does: copy-on-write copies it, the prefix cache
keys on the head's identity). Its entry at position j reads (x_j, h_{j-1}) and so depends only on
tokens 0..j.

Hidden states beside the KV. The head's executor keeps one more per-slot tensor, the target's last
hidden state at every position the target computed (`slot_states`, engine/executor.py): each step
stores the step's hidden states at the step's KV slots (one index_copy, on the device, also on steps
async scheduling leaves in flight). So the head's entries need not be written in the step that
computed their hidden states: the head catches up lazily, only for requests about to draft, over
everything the target computed since it last ran for them (spec_decode/draft_kv.py keeps the books,
as for a draft model). A step in which nobody drafts costs the head nothing but that copy. A request
new to the head (admitted, re-admitted, forked) starts at its prefix-cache hit, short of the first
block the head has no valid entries for, and reads the real hidden states the prefix blocks hold;
only position 0 reads zeros (as trained).

Catch-up, then drafting. Target row i of a request (position s + i, hidden h_{s+i}) makes head entry
s + i + 1 with token x_{s+i+1}. For a drafting request the head computes its entries from where they
are valid up to the newest token L - 1 (hidden h_{L-2}, computed this step) in one ragged forward;
that last row gives the first draft's logits. Each further draft is one head forward of one token
per drafting request at the next position, with the previous draft as token and the head's own
output as hidden state; the chain's metadata is built and uploaded once for all its steps
(`chain_metadata`). Tokens stay on the device until the k drafts are done (one host sync per step;
drafting on the device, the host does not wait for them: engine/model_runner.py).
The chain's entries (positions >= L) are never trusted: the next catch-up rewrites them from the
target's hidden states. Random requests sample drafts from q = probs_for(draft logits) with their
temperature / top-k / top-p and generator; q, zero outside the draft vocabulary, is kept for the
rejection sampler.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from specserve.engine.cuda_graphs import query_lens_up_to, replay_seconds
from specserve.engine.outputs import ModelRunnerOutput, ScheduledRequest, SchedulerOutput
from specserve.engine.step_inputs import PendingTokens, batch_metadata, chain_metadata
from specserve.models.layers.attention import AttentionMetadata
from specserve.sample.sampler import argmax_rows, draw, probs_for
from specserve.spec_decode.adaptive import (AdaptiveK, DraftSlot, draft_room, nothing_to_draft, plan_step,
                                            planned_on_device, skipped, step_tokens, step_verified)
from specserve.spec_decode.draft_kv import DraftEntries
from specserve.spec_decode.draft_model import _context
from specserve.spec_decode.eagle_chain import ChainGraphs
from specserve.spec_decode.eagle_head import EagleHead
from specserve.spec_decode.proposer import DeviceStep, DraftStep, ProposerBinding
from specserve.utils import round_up_to_bits

if TYPE_CHECKING:
    from specserve.engine.executor import ModelExecutor
    from specserve.sample.sampler import RequestGenerators

logger = logging.getLogger(__name__)


def draft_scale(seconds: dict[int, float]) -> tuple[tuple[int, float], ...]:
    """(batch, a draft step's seconds there over one request's) from timed chains, ascending and never
    falling as the batch grows (a larger batch's chain does not cost less: a lower time is noise)."""
    one, scale, out = seconds[min(seconds)], 1.0, []
    for batch in sorted(seconds):
        scale = max(scale, seconds[batch] / one)
        out.append((batch, scale))
    return tuple(out)


class EagleProposer:
    def __init__(self, head: EagleHead, policy: AdaptiveK, *, identity: tuple, num_speculative_tokens: int,
                 max_num_batched_tokens: int) -> None:
        self.draft_model = head
        self.head = head
        self.policy = policy
        self.cache_identity = ("eagle", *identity)
        self.num_lookahead_tokens = num_speculative_tokens  # the chain's entries past the newest token
        # a catch-up computes 1 + k rows per drafting request (its verified rows, k <= the cap), one more
        # after a step it did not draft in; the eager chain (random requests) one per request
        self.draft_query_lens = query_lens_up_to(2 + num_speculative_tokens)
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = 0
        self.executor: ModelExecutor | None = None  # set by bind
        self.target: ModelExecutor | None = None  # set by bind
        self.generators: RequestGenerators | None = None
        self.entries = DraftEntries(1, 0)  # sized by bind
        self._hidden: torch.Tensor | None = None  # [num_slots + 1, h]: the target's hidden state per KV slot
        self._probs: dict[str, torch.Tensor | None] = {}  # q of the current drafts; None = greedy
        self.chain_graphs: ChainGraphs | None = None  # on CUDA, by capture_graphs
        # plain greedy steps draft through draft_on_device: on CUDA (set by bind); the same code runs on
        # the CPU when this is set there (the tests do), with the chain run eagerly
        self.drafts_on_device = False
        self.pad_catch_up = False  # draft_on_device pads its catch-up's rows (`_padding`): on CUDA

    def bind(self, binding: ProposerBinding) -> None:
        assert binding.draft is not None, "the engine builds an executor for the declared draft_model"
        self.executor, self.generators = binding.draft, binding.generators
        self.target = binding.target
        self.max_model_len = binding.max_model_len
        self.entries = DraftEntries(binding.draft.block_size, binding.draft.kv_cache.shape[2])
        self._hidden = binding.draft.slot_states["hidden_states"]
        self.policy.bind(binding)
        self.drafts_on_device = self.pad_catch_up = binding.draft.device.type == "cuda"

    def capture_graphs(self, max_model_len: int, max_num_seqs: int) -> None:
        """CUDA: the greedy chain of drafts as one graph per (batch size, k) (spec_decode/eagle_chain.py)."""
        ex = self.executor
        self.chain_graphs = ChainGraphs(self.head, ex.kv_caches, ex.device, self.entries.block_size, max_model_len,
                                        max_num_seqs, self.num_lookahead_tokens)
        self.chain_graphs.capture()
        target_s = self.target.decode_replay_seconds() if self.policy.measure_draft_cost else None
        if target_s:
            # a draft step's cost as this GPU runs it: the chain's graph per draft against the target's
            # one-request decode graph (the head's share of the parameters overrates it where the
            # host, not the device, sets the pace: each graph is one launch), and its seconds, which
            # the policy prices against the plain step's measured time once it has one; not under
            # tensor parallelism (the target's graphs replay on every rank together); each batch size's
            # chain is timed too (a chain over 64 requests reads more, e.g. an int8 head's float
            # weights past 16 rows), and the policy scales the price to the batch that drafts
            k = self.num_lookahead_tokens
            seconds = {b: replay_seconds(self.chain_graphs.graphs[(b, k)]) / k for b in self.chain_graphs.sizes}
            self.policy.draft_cost = seconds[1] / target_s
            self.policy.draft_seconds = seconds[1]
            self.policy.draft_scale = draft_scale(seconds)
            logger.info("EAGLE draft step: %.1f us, %.3f of a one-request target step (%.1f us); at %d requests "
                        "%.1f us", 1e6 * seconds[1], self.policy.draft_cost, 1e6 * target_s,
                        max(seconds), 1e6 * seconds[max(seconds)])

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
        """A head that fuses target layers reads their feature of every step unless the policy is
        dormant (no drafts for a while) and the step only decodes (every request computes one token):
        the feature of those positions is then zero (`_store`), as position 0's is, and the head
        catches up over them as over any other; a prompt's features are always kept. Under async
        scheduling only steps left in flight leave it out: the others are where the policy plans,
        and a spell starts there with the newest feature. With synchronous steps every step plans,
        so a dormant decode step leaves it out too, and if its plan drafts it drafts nothing
        (`_wake_instead_of_drafting`): the next step computes the feature."""
        if not deferred and self.policy.async_steps:
            return True
        return not (self.head.aux_layers and self.policy.dormant() and all(s.num_tokens == 1 for s in sched.scheduled))

    def _wake_instead_of_drafting(self, hidden: torch.Tensor, slots: list[DraftSlot]) -> None:
        """A step that ran without the fused feature (`needs_aux`) and whose plan drafts: its drafts
        would start from a zero feature at the newest position, which the first draft reads most.
        The plan wakes the policy instead (no drafts this step; the next step computes the feature
        and plans again): a spell starts one step later than it would have."""
        if self._without_feature(hidden) and any(s.k for s in slots):
            self.policy.wake()
            for slot in slots:
                slot.k = 0

    def skip(self, sched: SchedulerOutput, hidden: torch.Tensor, pending: PendingTokens,
             slot_mapping: torch.Tensor) -> None:
        """A step left in flight: its hidden states are stored; the head falls behind."""
        self._store(hidden, slot_mapping)
        self.entries.fall_behind((s, s.start + s.num_tokens) for s in sched.scheduled)
        skipped(self.policy, sched)

    def draft_probs(self, req_id: str) -> torch.Tensor | None:
        assert req_id in self._probs, f"{req_id} has drafts the EAGLE head did not propose"
        return self._probs[req_id]

    # -- the step --------------------------------------------------------------------------------
    @torch.inference_mode()
    def propose(self, step: DraftStep) -> dict[str, list[int]]:
        try:
            return self._propose(step)
        finally:  # the step's time, catch-up and drafting included, goes to the guard
            self.policy.proposals_made()

    def _propose(self, step: DraftStep) -> dict[str, list[int]]:
        sched, out = step.sched, step.out
        step_verified(self.policy, sched, out)
        slots = plan_step(self.policy, sched, out, self.max_model_len, self.max_num_batched_tokens, self.entries.behind)
        self._wake_instead_of_drafting(step.hidden, slots)
        for slot in slots:
            self._probs.pop(slot.sched.request.request_id, None)  # its drafts were verified (or it gets none)
        self._store(step.hidden, step.slot_mapping)
        drafting = {slot.sched.request.request_id: slot for slot in slots if slot.k > 0}
        segments = []  # (slot, first entry to compute, the newest token's position + 1)
        behind = []
        for s in sched.scheduled:
            verified = _verified(s, out)
            slot = drafting.get(s.request.request_id)
            if slot is None:
                behind.append((s, verified))
            else:
                segments.append((slot, self.entries.valid(s, verified), verified + 1))
        self.entries.fall_behind(behind)
        if not segments:
            return {}
        chained = [slot for slot, _, _ in segments]
        ks = [slot.k for slot in chained]
        # rows from before this step's positions: a spell's start (the head had not run for them)
        behind_rows = sum(max(0, slot.sched.start - start) for slot, start, _ in segments)
        g, meta, ks_d = self.policy.timed_catch_up(
            self.executor.device, behind_rows, sum(end - start for _, start, end in segments),
            lambda: self._catch_up(segments, ks))
        newest = meta.query_start_loc[1:].long() - 1  # each request's last row: its newest token's entry
        chain = self.chain_graphs
        if chain is not None and chain.can_run(len(ks), max(ks)) and \
                all(slot.sched.request.sampling_params.greedy for slot in chained):
            rows = chain.run(g, newest, meta.seq_lens, ks_d, meta.block_tables, max(ks)).tolist()
            return self._drafts(chained, rows, [[] for _ in chained])
        tokens, probs = self._chain(g[newest], chained, [end for _, _, end in segments])
        return self._drafts(chained, tokens.tolist(), probs)

    # -- the step, drafting on the device ------------------------------------------------------------
    @torch.inference_mode()
    def draft_on_device(self, step: DeviceStep) -> DeviceDrafts:
        """`propose` for plain greedy requests before the step's verification reaches the host: each
        drafting request's k is planned before its new tokens are known; its catch-up computes the
        head's entries up to the newest token it would have if every draft were accepted (the target's
        argmax of each row as the token: equal to the draft where it was accepted, the correction where
        not, rows past that untrusted, as the chain's are); its newest entry and context length are
        picked on the device by its accepted count; the chain reads them there. Nothing waits.
        A step scheduled ahead of its predecessor's tokens (`step.ahead`) drafts for requests that
        drafted in that predecessor (whose entries are valid up to its newest token: the catch-up
        covers its own rows alone, built at the host's positions and moved back on the device), and
        for requests the predecessor verified no drafts of (`ahead.in_place`: placed where they are;
        the catch-up reads their newest known token, still in flight, on the device), and for requests
        admitted in the step (not in the predecessor: every token they have is known). Another request
        the plan would have draft is held back (`DeviceDrafts.held_back`: its entries lag by drafts
        whose fate the host does not know; the engine waits for this step before the next, whose plan
        starts it)."""
        sched, policy, ahead = step.sched, self.policy, step.ahead
        num_base, num_drafts = step_tokens(sched)
        policy.step_finished(num_base, num_drafts, len(step.logits_rows), None)
        policy.proposals_made()  # this step drafts the next one's within its own time
        rows = {s.request.request_id: (i, first, count) for i, (s, first, count) in enumerate(step.logits_rows)}
        slots = planned_on_device(policy, sched, self.max_model_len, self.max_num_batched_tokens, self.entries.behind)
        self._wake_instead_of_drafting(step.hidden, slots)
        self._store(step.hidden, step.slot_mapping)
        bs, num_logits = self.entries.block_size, step.argmax.shape[0]
        # per drafting request: (slot, first entry to compute, the end of the positions whose tokens the
        # host has, known: positions [0, known) hold the verified input, moved back on the device)
        plans: list[tuple[DraftSlot, int, int, int, bool]] = []
        held_back = False
        for slot in slots:
            s = slot.sched
            req_id = s.request.request_id
            self._probs.pop(req_id, None)
            count = rows[req_id][2]
            known = s.start + s.num_tokens - count + 1
            end = known + count  # entries up to the newest token if all drafts are accepted
            # the chain's entries stay within the request's KV slots whatever is accepted
            slot.k = max(0, min(slot.k, min(len(s.block_ids) * bs, self.max_model_len) - end + 1))
            if not slot.k:
                continue
            if ahead is None or req_id not in ahead.tokens.row_of:  # not in the predecessor: admitted here
                plans.append((slot, self.entries.valid(s, known), known, known, False))
            elif req_id in ahead.drafts.row_of:  # the predecessor's catch-up covered [.., known) (books: `drafted`)
                plans.append((slot, known, known, known, True))
            elif req_id in ahead.in_place:  # its token at known - 1 is the predecessor's, in flight
                plans.append((slot, self.entries.valid(s, known - 1), known - 1, known, False))
            else:
                held_back, slot.k = True, 0
        plans.sort(key=lambda plan: not plan[4])  # those that move back first: the move's rows are theirs alone
        num_moving = sum(plan[4] for plan in plans)
        # the catch-up's token ids are picked from cat(argmax, the predecessor's tokens in flight, host ids)
        host_base = num_logits + (ahead.tokens.tokens.shape[0] if ahead is not None else 0)
        chained: list[DraftSlot] = []
        starts: list[int] = []
        host_ids: list[int] = []
        picks: list[int] = []  # per catch-up row: its token's index in cat(...) above
        query_lens, seq_lens, tables = [], [], []
        which, bases, lens = [], [], []  # per drafting request: its verification row, newest row and L at n = 0
        num_rows = 0
        for slot, start, on_host, known, _ in plans:
            s = slot.sched
            req_id = s.request.request_id
            i, first, count = rows[req_id]
            end = known + count
            picks += range(host_base + len(host_ids), host_base + len(host_ids) + on_host - start)
            if on_host < known:
                picks.append(num_logits + ahead.tokens.row_of[req_id])
            picks += range(first, first + count)
            host_ids += _context(s.request, [], start, on_host)
            which.append(i)
            bases.append(num_rows + known - start)
            num_rows += end - start
            lens.append(known + 1)
            query_lens.append(end - start)
            seq_lens.append(end)
            tables.append(s.block_ids)
            chained.append(slot)
            starts.append(start)
        pending = DeviceDrafts(sched, chained, starts, None, held_back)
        if not chained:
            return pending
        ks = [slot.k for slot in chained]
        ex = self.executor
        graphed = ex.graphs is not None and ex.graphs.holds(len(query_lens), max(query_lens), num_rows)
        padding = self._padding(num_rows, tables) if self.pad_catch_up and not graphed else []
        if padding:  # requests that compute nothing, reading the zero state, writing no KV
            num_pad = sum(padding)
            query_lens += padding
            seq_lens += padding
            tables += [[] for _ in padding]
            picks += [0] * num_pad
        # each launch costs the host ~10 us (an H200's host), and at one request the host sets the
        # step's pace: the common case takes the verification's tensors as they are (its tokens are
        # the catch-up's, every verifying request drafts)
        own_ids = not host_ids and picks == list(range(num_logits))
        every_request = which == list(range(len(step.logits_rows)))
        positions, meta, (src_d, ks_d, ends_d, *optional) = batch_metadata(
            query_lens, seq_lens, tables, bs, ex.device, staging=ex.staging,
            extra_int64=[np.asarray(a, dtype=np.int64) for a in (ks, bases + lens)] +
            ([] if own_ids else [np.asarray(a, dtype=np.int64) for a in (host_ids, picks)]) +
            ([] if every_request else [np.asarray(which, dtype=np.int64)]) +
            ([] if ahead is None else [np.repeat(np.arange(num_moving, dtype=np.int64), query_lens[:num_moving])]),
            padding_from=num_rows if padding else None, graphs=ex.graphs, prev_slots=self._hidden.shape[0] - 1)
        optional = iter(optional)  # host ids and picks, then which, then rows: those uploaded, in that order
        ids_d = step.argmax if own_ids else torch.cat(
            [step.argmax] + ([] if ahead is None else [ahead.tokens.tokens]) + [next(optional)])[next(optional)]
        which_d = None if every_request else next(optional)
        n = step.num_accepted if which_d is None else step.num_accepted[which_d]
        if ahead is not None:  # the host's positions, its sources and L, moved back on the device
            ahead.move_back(positions, meta, next(optional), which_d, sources=src_d)
            n = torch.stack([n, n - (ahead.back if which_d is None else ahead.back[which_d])])
        # rows from before this step's positions: a spell's start; its time is read when the step is judged
        behind_rows = sum(max(0, slot.sched.start - start) for slot, start in zip(chained, starts))
        g = self.policy.timed_catch_up(
            ex.device, behind_rows, num_rows,
            lambda: ex.forward(ids_d, positions, meta, hidden_states=self._sources(src_d, graphed)))
        ends = ends_d.view(2, -1) + n  # per request: its newest row in g and its context length L
        chain = self.chain_graphs
        if chain is not None and chain.can_run(len(ks), max(ks)):
            tables_d = meta.block_tables[:len(chained)]
            pending.tokens = chain.run(g, ends[0], ends[1], ks_d, tables_d, max(ks))
        else:  # eager (the CPU): the chain's metadata needs the context lengths on the host
            pending.tokens, _ = self._chain(g[ends[0]], chained, ends[1].tolist())
        return pending

    def _sources(self, src_d: torch.Tensor, graphed: bool) -> torch.Tensor:
        """The catch-up's input features (the stored ones at `src_d`): where the head's graph runs it,
        gathered straight into that graph's input buffer (one launch, where a gather and the graph's
        copy took two: at one request the host sets a drafting step's pace, ~10 us a launch)."""
        if graphed and self._hidden.dtype == self._dtype:
            buffer = self.executor.graphs.inputs["hidden_states"][:src_d.shape[0]]
            return torch.index_select(self._hidden, 0, src_d, out=buffer)
        return self._hidden[src_d].to(self._dtype)

    def _padding(self, num_rows: int, tables: list[list[int]]) -> list[int]:
        """Query lengths of padding requests that bring an eager catch-up of `num_rows` rows to its
        bucket (`catch_up_rows`): GEMMs of a new row count pay for cuBLAS's choice of kernel and the
        allocator's new blocks on the host (several ms a catch-up at a drafting spell's start, on an
        H200), where a bucketed count meets the ones seen before. (A catch-up a CUDA graph holds, as
        a drafting spell's steady steps are, is not padded: its graph pads the batch.) Each padding
        request stays within the positions of the widest block table (a zero-padded row of the
        batch's tables: block 0, only read)."""
        pad = catch_up_rows(num_rows) - num_rows
        span = max(len(t) for t in tables) * self.entries.block_size
        return [min(span, pad - i) for i in range(0, pad, span)]

    def drafted(self, pending: DeviceDrafts, out: ModelRunnerOutput) -> dict[str, int]:
        """After `draft_on_device`, with the step's tokens on the host (the drafts may still be on the
        device): the verifications go to the estimates, the head's entries are valid up to each newest
        token, the rest fall behind. Returns how many drafts each drafting request keeps (a prefix of
        its row of `pending.tokens`): k cut to the room its real new tokens leave."""
        # a request that ended since the step was launched (one scheduled ahead) has no books left
        verified = [s for s in pending.sched.scheduled if not s.request.is_finished]
        for s in verified:
            if s.spec_token_ids:
                req_id = s.request.request_id
                self.policy.observe(req_id, len(s.spec_token_ids), out.num_accepted[req_id])
        chained = {slot.sched.request.request_id for slot in pending.chained}
        self.entries.fall_behind((s, _verified(s, out)) for s in verified if s.request.request_id not in chained)
        kept: dict[str, int] = {}
        for slot, start in zip(pending.chained, pending.starts):
            s = slot.sched
            req_id = s.request.request_id
            if s.request.is_finished:
                continue
            new_ids = out.sampled_token_ids[req_id]
            self.entries.written(s, start, s.request.num_tokens + len(new_ids))
            k = min(slot.k, draft_room(s.request, new_ids, self.max_model_len))
            if k > 0:
                kept[req_id] = k
                self._probs[req_id] = None
        return kept

    def _store(self, hidden: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """The step's features at its KV slots [num_tokens]: the target's hidden states [num_tokens, h],
        or for a head over several layers the fused feature the target's forward computed beside them
        (`fuse_target_layers`): one copy per step, drafting or not. A step whose forward left the
        feature out (`needs_aux`: hidden is [num_tokens, h]) stores zeros there."""
        if self._without_feature(hidden):
            self._hidden.index_fill_(0, slot_mapping, 0)
            return
        feature = hidden[:, self.head.cfg.hidden_size:] if self.head.aux_layers else hidden
        self._hidden.index_copy_(0, slot_mapping, feature.to(self._hidden.dtype))

    def _without_feature(self, hidden: torch.Tensor) -> bool:
        """Did the step's forward leave the fused feature out (`needs_aux`)? Then hidden is [num_tokens, h]."""
        return bool(self.head.aux_layers) and hidden.shape[1] == self.head.cfg.hidden_size

    def _catch_up(self, segments: list[tuple[DraftSlot, int, int]], ks: list[int]
                  ) -> tuple[torch.Tensor, AttentionMetadata, torch.Tensor]:
        """The head's entries [start, end) of each drafting request, in one ragged forward. Returns
        its outputs [rows, h], the forward's metadata (seq_lens = the ends, block tables) and `ks` on
        the device [P]."""
        bs = self.entries.block_size
        ids: list[int] = []
        query_lens, seq_lens, tables = [], [], []
        for slot, start, end in segments:
            s = slot.sched
            ids += _context(s.request, slot.new_ids, start, end)
            query_lens.append(end - start)
            seq_lens.append(end)
            tables.append(s.block_ids)
            self.entries.written(s, start, end)
        ex = self.executor
        positions, meta, (src_d, ids_d, ks_d) = batch_metadata(
            query_lens, seq_lens, tables, bs, ex.device, staging=ex.staging,
            extra_int64=[np.asarray(ids, dtype=np.int64), np.asarray(ks, dtype=np.int64)],
            prev_slots=self._hidden.shape[0] - 1)
        return ex.forward(ids_d, positions, meta, hidden_states=self._sources(src_d, False)), meta, ks_d

    @property
    def _dtype(self) -> torch.dtype:
        return self.head.dtype

    def _chain(self, out: torch.Tensor, drafting: list[DraftSlot], ends: list[int]
               ) -> tuple[torch.Tensor, list[list[torch.Tensor]]]:
        """k drafts per drafting request: the first from its newest token's entry (`out` [P, h]),
        each next one from a head forward of one token per request (draft j - 1 and the head's
        output before it). Requests run ordered by k, most first, so step j runs a prefix of them.
        Returns the drafts [P, max k] (target ids) and each request's q per draft (random ones), in
        the order given."""
        ex = self.executor
        order = sorted(range(len(drafting)), key=lambda i: -drafting[i].k)
        reordered = order != sorted(order)
        drafting, ends = [drafting[i] for i in order], [ends[i] for i in order]
        out = out[torch.tensor(order, device=out.device)] if reordered else out
        ks = [slot.k for slot in drafting]
        max_k = ks[0]
        num_active = [sum(k > j for k in ks) for j in range(1, max_k)]  # chain step j + 1
        steps = chain_metadata(ends, num_active, [slot.sched.block_ids for slot in drafting],
                               self.entries.block_size, ex.device, staging=ex.staging) if max_k > 1 else []
        tokens = torch.zeros(len(drafting), max_k, dtype=torch.long, device=ex.device)  # [P, K] target ids
        probs: list[list[torch.Tensor]] = [[] for _ in drafting]
        # greedy on CUDA: the chain graphs' pick (ChainGraphs), so both chains draft alike
        picked_on_device = out.is_cuda and all(slot.sched.request.sampling_params.greedy for slot in drafting)
        for j in range(max_k):
            n = len(drafting) if j == 0 else num_active[j - 1]
            if j > 0:  # entry at the newest token's position + j: (draft j, the head's previous output)
                positions, meta = steps[j - 1]
                out = ex.forward(tokens[:n, j - 1], positions, meta, hidden_states=out[:n])
            if picked_on_device:
                self.head.pick_greedy(out, tokens[:n, j])
            else:
                tokens[:n, j] = self._sample(ex.compute_logits(out), drafting[:n], probs[:n])
        if not reordered:
            return tokens, probs
        back = sorted(range(len(order)), key=order.__getitem__)  # the callers' order again
        return tokens[torch.tensor(back, device=tokens.device)], [probs[i] for i in back]

    def _drafts(self, drafting: list[DraftSlot], rows: list[list[int]], probs: list[list[torch.Tensor]]
                ) -> dict[str, list[int]]:
        """Each request's first k tokens of its row; q of its drafts kept for the rejection sampler."""
        drafts: dict[str, list[int]] = {}
        for slot, row, q in zip(drafting, rows, probs):
            req_id = slot.sched.request.request_id
            drafts[req_id] = row[:slot.k]
            self._probs[req_id] = torch.stack(q) if q else None
        return drafts

    def _sample(self, logits: torch.Tensor, slots: list[DraftSlot], probs: list[list[torch.Tensor]]
                ) -> torch.Tensor:
        """One draft per row of draft-vocabulary logits [N, Vd], as a target id; random requests
        keep q over the target vocabulary (zero outside the draft vocabulary)."""
        vocab = self.head.draft_vocab
        params = [slot.sched.request.sampling_params for slot in slots]
        if all(p.greedy for p in params):
            return vocab[argmax_rows(logits)]
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


def catch_up_rows(num_rows: int) -> int:
    """The bucket an eager catch-up of `num_rows` rows is padded to: the next power of two up to 8192
    rows, then the next count with 4 significant bits (8 buckets per doubling, at most 1/8 of the rows
    padding): a spell's start at many requests catches up over every position since the head last
    ran for them (64 requests of 300 tokens: 19,200 rows), where the next power of two would
    compute up to twice the rows (on an H200, 8B shapes: the first drafting step after such a start
    took 27-30 ms, 12-14 ms since). Below 8192 rows finer buckets cost more than they save: with
    them from 512 rows up, 8B shapes at 16 requests gave 1.29-1.31x against 1.38x in the same call."""
    return 1 << (num_rows - 1).bit_length() if num_rows <= 8192 else round_up_to_bits(num_rows, 4)


def _verified(s: ScheduledRequest, out: ModelRunnerOutput) -> int:
    """The end of the positions whose target KV holds the request's real tokens after this step."""
    new_ids = out.sampled_token_ids.get(s.request.request_id)
    return s.request.num_tokens + len(new_ids) - 1 if new_ids else s.start + s.num_tokens


@dataclass(slots=True)
class DeviceDrafts:
    """`draft_on_device`'s work in flight: the plan, and the drafts [P, max k] still on the device."""

    sched: SchedulerOutput
    chained: list[DraftSlot]  # those that draft, in the order of `tokens`' rows
    starts: list[int]  # per chained request: the first head entry its catch-up wrote
    tokens: torch.Tensor | None  # [len(chained), max k] int64
    held_back: bool = False  # a step ahead kept a request from drafting (`draft_on_device`)
