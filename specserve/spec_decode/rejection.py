"""Verify drafts against the target: greedy prefix matching and exact rejection sampling.

A request that speculated contributed 1 + k rows of target logits: row j scores the token after
context + d_1..d_j, so rows 0..k-1 judge the drafts d_1..d_k and row k gives the bonus token.

- Greedy requests accept the longest prefix of drafts equal to the target's argmax, then append
  the argmax at the first mismatch (or the bonus argmax when every draft matched): every token is
  the target's argmax given the tokens before it, so in fp32 the output is exactly that of decoding
  without speculation (tested); in bf16 the verification forward's other shape may round a near-tie
  the other way (docs/speculative.md, Exactness).
- Random requests use the rule of Leviathan et al. (2023) / Chen et al. (2023), which keeps the
  output distributed exactly as the target's p whatever the draft distribution q was:
      accept d_j with probability min(1, p_j(d_j) / q_j(d_j));
      at the first rejection, sample from normalize(max(p_j - q_j, 0)) and stop;
      if all k are accepted, sample a bonus token from p_k.
  p and q are both shaped by the request's temperature / top-k / top-p / min-p (`probs_for`), and
  penalties see the history up to each row's position (output + d_1..d_j), as plain decoding would.
  N-gram drafts are deterministic: q is one-hot, so d_j is accepted with probability p_j(d_j).

Greedy and random requests are handled in the same batch, each group in a few batched tensor ops
over a [num_requests, k_max + 1] grid; seeded requests draw from their own generator.

Structured outputs: a constrained request's 1 + k rows are each masked by its grammar in the state
after the drafts before them (the matcher walks the drafts tentatively and rolls back; the scheduler
advances it by the accepted tokens only). A draft the grammar refuses ends the acceptable prefix:
it is rejected, and its position samples a corrected token under the mask; the rules above then
run on the masked target p, so the output follows the target's distribution restricted to the
grammar, exactly as decoding without speculation does.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from specserve.engine.outputs import ModelRunnerOutput
from specserve.sample.sampler import SamplingRow, apply_penalties, argmax_rows, draw, probs_for, top_logprobs
from specserve.sample.structured import GrammarMasks

if TYPE_CHECKING:
    from specserve.engine.step_inputs import HostStaging
    from specserve.sampling_params import SamplingParams


@dataclass(slots=True)
class VerifyRequest:
    first_row: int  # first of this request's 1 + k rows in the logits
    draft_ids: list[int]  # d_1..d_k
    row: SamplingRow  # params, history before this step, generator
    draft_probs: torch.Tensor | None = None  # [k, V] q the drafts were sampled from; None = one-hot


@dataclass(slots=True)
class VerifyResult:
    token_ids: list[list[int]]  # per request: accepted drafts + one target token
    num_accepted: list[int]
    logprobs: list[list[dict[int, float]] | None]


def accept_drafts(u: torch.Tensor, p_draft: torch.Tensor, q_draft: torch.Tensor) -> torch.Tensor:
    """Accept each draft with probability min(1, p/q): with u ~ U[0, 1), `u < p / q`, written
    `u * q < p` so that q = 0 cannot divide (a draft q never proposes gets accepted iff p > 0)."""
    return u * q_draft < p_draft


def recovered_distribution(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """normalize(max(p - q, 0)) per row ([N, V]); rows where it is all zero (p == q up to rounding,
    so a rejection was a rounding artefact) fall back to p. q = 0 rows give p: the bonus token."""
    residual = (p - q).clamp_min_(0.0)
    total = residual.sum(dim=-1, keepdim=True)
    return torch.where(total > 0, residual / total.clamp_min(1e-30), p)


def accepted_in_rows(argmax: torch.Tensor, row_ids: torch.Tensor, num: int, rows: int,
                     out: torch.Tensor | None = None) -> torch.Tensor:
    """The greedy rule for `num` requests of `rows` (1 + k) rows each, laid out one after another:
    argmax [num * rows] the target's argmax of each row, row_ids the input token at each. Returns
    each request's accepted-prefix length [num] int64 (the drafts its argmaxes match, up to the first
    that does not): row j judges the token at row j + 1. No host work beyond the launches; a CUDA
    graph can hold it (`StepGraphs`' verdict graphs)."""
    grid, ids = argmax.view(num, rows), row_ids.view(num, rows)
    return torch.sum((grid[:, :-1] == ids[:, 1:]).cumprod(dim=1), dim=1, out=out)  # a bool cumprod is int64


def plain_greedy(params: SamplingParams, grammar) -> bool:
    """Is a request's next token the argmax of its raw logits row (and nothing else wanted of them)?"""
    return params.greedy and not params.adjusts_logits and grammar is None and params.logprobs is None


class RejectionSampler:
    def __init__(self, simulated_acceptance: float | None = None, seed: int = 0) -> None:
        # Benchmarks only: accept each draft with this probability, whatever the models say.
        self.simulated_acceptance = simulated_acceptance
        self._sim_seed = seed
        self._sim_generators: dict[str, torch.Generator] = {}  # by device: the draws stay where they are read
        self._sim_rates: dict[tuple[str, int], torch.Tensor] = {}  # per-position rates, by (device, k)
        self.masks = GrammarMasks()

    def verify(self, logits: torch.Tensor, verify_rows: Sequence[tuple], rows: Sequence[SamplingRow],
               draft_probs: Sequence[torch.Tensor | None], out: ModelRunnerOutput) -> None:
        """Model-runner entry point. logits: [num_logits, V] fp32; verify_rows: (ScheduledRequest,
        first row, 1 + k) for the requests with drafts, with their sampling rows and the draft
        probabilities q their drafts were drawn from (None: deterministic drafts). Fills sampled
        tokens and acceptance counts into `out`."""
        reqs = [VerifyRequest(first_row, s.spec_token_ids, row, None if q is None else q[:count - 1])
                for (s, first_row, count), row, q in zip(verify_rows, rows, draft_probs)]
        result = self.sample(logits, reqs)
        for (s, _, _), token_ids, num_accepted, lps in zip(verify_rows, result.token_ids,
                                                           result.num_accepted, result.logprobs):
            req_id = s.request.request_id
            out.sampled_token_ids[req_id] = token_ids
            out.num_accepted[req_id] = num_accepted
            if lps is not None:
                out.logprobs[req_id] = lps

    @torch.inference_mode()
    def sample(self, logits: torch.Tensor, reqs: Sequence[VerifyRequest]) -> VerifyResult:
        """logits: [N, V] fp32 holding each request's 1 + k rows from `first_row`."""
        if all(plain_greedy(r.row.params, r.row.grammar) for r in reqs):
            return self._sample_plain_greedy(logits, reqs)
        device, vocab = logits.device, logits.shape[1]
        num_reqs = len(reqs)
        ks = [len(r.draft_ids) for r in reqs]
        max_k = max(ks)
        k_t = torch.tensor(ks, device=device)
        pos = torch.arange(max_k + 1, device=device)
        first = torch.tensor([r.first_row for r in reqs], device=device)
        rows = first[:, None] + torch.minimum(pos[None, :], k_t[:, None])  # [R, K+1], padding repeats row k
        target = logits[rows.reshape(-1)]  # [R * (K+1), V] (a copy: penalties may edit it)
        raw = target.clone() if any(r.row.params.logprobs is not None for r in reqs) else None
        self._penalize(target, reqs, max_k)
        num_allowed = self._mask_grammars(target, reqs, max_k)
        target = target.view(num_reqs, max_k + 1, vocab)
        drafts = torch.tensor([r.draft_ids + [0] * (max_k - k) for r, k in zip(reqs, ks)],
                              dtype=torch.long, device=device).view(num_reqs, max_k)  # [R, K]
        valid = pos[None, :max_k] < k_t[:, None]  # [R, K]
        if num_allowed is not None:  # a draft the grammar refuses (and every one after it) is rejected
            valid &= pos[None, :max_k] < torch.tensor(num_allowed, device=device)[:, None]
        num_accepted = torch.zeros(num_reqs, dtype=torch.long, device=device)
        final = torch.zeros(num_reqs, dtype=torch.long, device=device)  # token after the accepted prefix

        greedy = [i for i, r in enumerate(reqs) if r.row.params.greedy]
        rand = [i for i, r in enumerate(reqs) if not r.row.params.greedy]
        if greedy:
            g = torch.tensor(greedy, device=device)
            argmax = argmax_rows(target[g])  # [G, K+1]
            if self.simulated_acceptance is None:
                accepted = (argmax[:, :max_k] == drafts[g]) & valid[g]
            else:
                accepted = self._simulated(len(greedy), max_k, device) & valid[g]
            n = accepted.long().cumprod(dim=1).sum(dim=1)  # length of the accepted prefix
            num_accepted[g] = n
            final[g] = argmax.gather(1, n[:, None]).squeeze(1)
        if rand:
            self._sample_random(rand, reqs, target, drafts, valid, num_accepted, final)

        n_list, final_list = torch.stack([num_accepted, final]).tolist()
        token_ids = [r.draft_ids[:n] + [t] for r, n, t in zip(reqs, n_list, final_list)]
        logprobs: list[list[dict[int, float]] | None] = [None] * num_reqs
        if raw is not None:
            raw = raw.view(num_reqs, max_k + 1, vocab)
            for i, r in enumerate(reqs):
                if r.row.params.logprobs is not None:
                    ids = torch.tensor(token_ids[i], device=device)
                    logprobs[i] = top_logprobs(raw[i, :len(ids)], ids, [r.row.params.logprobs] * len(ids))
        return VerifyResult(token_ids, n_list, logprobs)

    def _sample_plain_greedy(self, logits: torch.Tensor, reqs: Sequence[VerifyRequest]) -> VerifyResult:
        """`sample` for a batch of greedy requests without penalties, grammars or logprobs (the common
        case): the target's argmax of every row in one kernel and one copy to the host, compared with
        the drafts there. The same tokens as the general path (the same argmax of the same rows),
        without its dozen small kernels and host-to-device copies per step."""
        argmax = argmax_rows(logits).tolist()
        simulated = None
        if self.simulated_acceptance is not None:
            simulated = self._simulated(len(reqs), max(len(r.draft_ids) for r in reqs), "cpu").tolist()
        token_ids, num_accepted = [], []
        for i, r in enumerate(reqs):
            row, n = r.first_row, 0
            for j, draft in enumerate(r.draft_ids):
                if not (simulated[i][j] if simulated is not None else argmax[row + j] == draft):
                    break
                n += 1
            token_ids.append(r.draft_ids[:n] + [argmax[row + n]])
            num_accepted.append(n)
        return VerifyResult(token_ids, num_accepted, [None] * len(reqs))

    def greedy_on_device(self, argmax: torch.Tensor, row_ids: torch.Tensor, counts: Sequence[int],
                         staging: HostStaging, out: torch.Tensor | None = None) -> torch.Tensor:
        """The greedy rule with the verification left on the device, for drafting on the device: `argmax`
        [M] the target's argmax of every logits row, `row_ids` [M] the input token at each row, `counts`
        the requests' rows (1 + k each, in row order: a request's rows are its last 1 + k input tokens,
        its newest token and its drafts, so the draft row j judges is the token at row j + 1). Returns
        the accepted-prefix lengths n [R] on the device: request r's tokens are its first n drafts,
        then argmax[its first row + n]. (With `simulated_acceptance` n is drawn on the device, as
        cheap for the host as the real rule's few launches.) No host wait; nothing uploaded when every
        request has the same count. `out`: an int64 [R] tensor to write n into (it is returned)."""
        num, max_k = len(counts), max(counts) - 1
        if out is None:
            out = torch.empty(num, dtype=torch.long, device=argmax.device)
        if max_k == 0:
            return out.zero_()
        uniform = all(c == max_k + 1 for c in counts)
        if self.simulated_acceptance is not None:  # (benchmarks) each request's accepted prefix, drawn
            accepted = self._simulated(num, max_k, argmax.device)
            if not uniform:  # draws past a request's own drafts are not its
                (ks_d,) = staging.to_device([np.asarray(counts, dtype=np.int64) - 1], torch.int64)
                accepted &= torch.arange(max_k, device=argmax.device) < ks_d[:, None]
            return torch.sum(accepted.cumprod(dim=1), dim=1, out=out)
        if uniform:  # every request verifies k drafts: its rows reshape (nothing built on the host)
            return accepted_in_rows(argmax, row_ids, num, max_k + 1, out=out)
        ks = np.asarray(counts, dtype=np.int64) - 1
        valid = np.arange(max_k)[None, :] < ks[:, None]  # [R, K]
        firsts = np.concatenate([[0], np.cumsum(counts)[:-1]])
        grid = np.where(valid, firsts[:, None] + np.arange(max_k)[None, :], len(argmax))  # padding: no match
        (grid_d,) = staging.to_device([grid.ravel()], torch.int64)
        # row i judges the token at row i + 1 (rows past a request's last draft are never in the grid)
        match = torch.cat([argmax[:-1] == row_ids[1:], argmax.new_zeros(2, dtype=torch.bool)])
        return torch.sum(match[grid_d].view(num, max_k).cumprod(dim=1), dim=1, out=out)

    def _sample_random(self, rand: list[int], reqs: Sequence[VerifyRequest], target: torch.Tensor,
                       drafts: torch.Tensor, valid: torch.Tensor, num_accepted: torch.Tensor,
                       final: torch.Tensor) -> None:
        """The exact rule for the random requests (indices `rand`); writes num_accepted and final."""
        device = target.device
        num, max_k, vocab = len(rand), drafts.shape[1], target.shape[2]
        idx = torch.tensor(rand, device=device)
        params = [reqs[i].row.params for i in rand for _ in range(max_k + 1)]
        p = probs_for(target[idx].reshape(-1, vocab), params).view(num, max_k + 1, vocab)  # [Rr, K+1, V]
        d = drafts[idx]  # [Rr, K]
        p_draft = p[:, :max_k].gather(2, d[..., None]).squeeze(2)  # p_j(d_j): [Rr, K]
        # q over the K+1 positions, zero past each request's last draft (so the bonus row gives p_k)
        q = torch.zeros(num, max_k + 1, vocab, device=device, dtype=p.dtype)
        for j, i in enumerate(rand):
            k = len(reqs[i].draft_ids)
            if reqs[i].draft_probs is not None:
                q[j, :k] = reqs[i].draft_probs[:k].to(p.dtype)
            elif k:  # deterministic drafts: one-hot q
                q[j, torch.arange(k, device=device), d[j, :k]] = 1.0
        q_draft = q[:, :max_k].gather(2, d[..., None]).squeeze(2)  # q_j(d_j): [Rr, K]

        if self.simulated_acceptance is None:
            accepted = accept_drafts(self._uniforms(rand, reqs, max_k, device), p_draft, q_draft) & valid[idx]
        else:
            accepted = self._simulated(num, max_k, device) & valid[idx]
        n = accepted.long().cumprod(dim=1).sum(dim=1)  # [Rr] accepted prefix length
        rows = torch.arange(num, device=device)
        p_next, q_next = p[rows, n], q[rows, n]  # [Rr, V]: the position after the accepted prefix
        if self.simulated_acceptance is not None:
            q_next = torch.zeros_like(q_next)  # a forced "rejection" is not a real one: sample p
        dist = recovered_distribution(p_next, q_next)  # residual at a rejection, p_k for the bonus
        num_accepted[idx] = n
        final[idx] = draw(dist, [reqs[i].row.generator for i in rand])

    @staticmethod
    def _uniforms(rand: list[int], reqs: Sequence[VerifyRequest], max_k: int, device) -> torch.Tensor:
        """[Rr, K] U[0,1); a seeded request draws exactly k values from its own generator."""
        u = torch.rand(len(rand), max_k, device=device)
        for j, i in enumerate(rand):
            gen, k = reqs[i].row.generator, len(reqs[i].draft_ids)
            if gen is not None and k:
                u[j, :k] = torch.rand(k, generator=gen, device=device)
        return u

    def _simulated(self, num: int, max_k: int, device) -> torch.Tensor:
        """[num, max_k]: draft j accepted (given j-1 was) with the simulated rate of position j (a list
        gives one per position, its last value repeating past its end)."""
        device = str(device)
        generator = self._sim_generators.get(device)
        if generator is None:  # one seeded stream per device
            generator = self._sim_generators[device] = torch.Generator(device=device).manual_seed(self._sim_seed)
        rates = self.simulated_acceptance
        if isinstance(rates, list):
            rates = self._sim_rates.get((device, max_k))
            if rates is None:  # made once per k: uploading them would cost the host a copy each step
                listed = self.simulated_acceptance
                rates = self._sim_rates[(device, max_k)] = torch.tensor(
                    [listed[min(j, len(listed) - 1)] for j in range(max_k)], device=device)
        return torch.rand(num, max_k, generator=generator, device=device) < rates

    def _mask_grammars(self, target: torch.Tensor, reqs: Sequence[VerifyRequest], max_k: int) -> list[int] | None:
        """Mask each constrained request's 1 + k rows of target ([R * (K+1), V], in place) with its
        grammar at that position. Returns per request how many leading drafts the grammar accepts
        (all k for unconstrained ones), or None when no request is constrained."""
        constrained = [i for i, r in enumerate(reqs) if r.row.grammar is not None]
        if not constrained:
            return None
        bitmask = self.masks.buffer(target.shape[0], target.shape[1])
        num_allowed = [len(r.draft_ids) for r in reqs]
        rows = []
        for i in constrained:
            first, k = i * (max_k + 1), len(reqs[i].draft_ids)
            num_allowed[i] = reqs[i].row.grammar.fill_drafts(reqs[i].draft_ids, bitmask, first)
            rows.extend(range(first, first + k + 1))
        self.masks.apply(target, bitmask, rows)
        return num_allowed

    @staticmethod
    def _penalize(target: torch.Tensor, reqs: Sequence[VerifyRequest], max_k: int) -> None:
        """Penalties and the min_tokens ban on every row, with the history up to that row's position.
        target: [R * (K+1), V], edited in place."""
        need = [i for i, r in enumerate(reqs) if r.row.params.adjusts_logits]
        if not need:
            return
        rows, index = [], []
        for i in need:
            r = reqs[i].row
            for j in range(max_k + 1):
                history = list(r.output_token_ids) + reqs[i].draft_ids[:j]
                rows.append(SamplingRow(r.params, r.prompt_token_ids, history, r.generator, r.eos_token_ids))
                index.append(i * (max_k + 1) + j)
        idx = torch.tensor(index, device=target.device)
        target[idx] = apply_penalties(target[idx], rows)
