"""The rejection sampler: hand-built cases, penalties per position, seeds, and a statistical test
that the emitted tokens follow the target distribution (and that wrong rules fail that test)."""
from __future__ import annotations

import pytest
import torch

import specserve.spec_decode.rejection as rejection
from specserve.engine.step_inputs import HostStaging
from specserve.sample.sampler import SamplingRow, probs_for
from specserve.sampling_params import SamplingParams
from specserve.spec_decode.rejection import RejectionSampler, VerifyRequest

V = 12
GREEDY = SamplingParams(temperature=0.0)


def peaked(tokens: list[int], vocab: int = V, high: float = 10.0) -> torch.Tensor:
    """One logits row per token, each with its token on top by `high`."""
    logits = torch.zeros(len(tokens), vocab)
    logits[torch.arange(len(tokens)), torch.tensor(tokens)] = high
    return logits


def req(first_row: int, drafts: list[int], params: SamplingParams = GREEDY, q=None, output=(), gen=None):
    row = SamplingRow(params, [1, 2, 3], list(output), gen, frozenset({0}))
    return VerifyRequest(first_row, list(drafts), row, q)


# -- hand-built cases ----------------------------------------------------------------------------
def test_greedy_perfect_match_takes_all_drafts_and_the_bonus():
    res = RejectionSampler().sample(peaked([5, 7, 2, 9]), [req(0, [5, 7, 2])])
    assert res.token_ids == [[5, 7, 2, 9]] and res.num_accepted == [3]


def test_greedy_first_token_mismatch_emits_the_target_token():
    res = RejectionSampler().sample(peaked([5, 7, 2, 9]), [req(0, [4, 7, 2])])
    assert res.token_ids == [[5]] and res.num_accepted == [0]


def test_greedy_mismatch_in_the_middle():
    res = RejectionSampler().sample(peaked([5, 7, 2, 9]), [req(0, [5, 3, 2])])
    assert res.token_ids == [[5, 7]] and res.num_accepted == [1]


def test_empty_draft_is_a_plain_sample():
    res = RejectionSampler().sample(peaked([6]), [req(0, [])])
    assert res.token_ids == [[6]] and res.num_accepted == [0]
    res = RejectionSampler().sample(peaked([6], high=50.0), [req(0, [], SamplingParams(temperature=1.0))])
    assert res.token_ids == [[6]]


def test_mixed_greedy_and_random_batch():
    hot = SamplingParams(temperature=1.0, seed=1)
    logits = torch.cat([peaked([5, 7, 2, 9]),  # greedy, k=3, mismatch at 2
                        peaked([3, 3, 8], high=60.0),  # random, ngram drafts [3, 3]: accepted, bonus 8
                        peaked([4, 1], high=60.0),  # random, draft 6 has p ~ 0: rejected, residual -> 4
                        peaked([10], high=2.0)])  # random, no drafts: a plain draw
    gens = [torch.Generator().manual_seed(i) for i in range(3)]
    reqs = [req(0, [5, 7, 1]), req(4, [3, 3], hot, gen=gens[0]), req(7, [6], hot, gen=gens[1]),
            req(9, [], hot, gen=gens[2])]
    res = RejectionSampler().sample(logits, reqs)
    assert res.token_ids[:3] == [[5, 7, 2], [3, 3, 8], [4]]
    assert res.num_accepted == [2, 2, 0, 0]
    assert len(res.token_ids[3]) == 1


def test_random_draft_equal_to_target_is_always_accepted():
    torch.manual_seed(0)
    logits = torch.randn(4, V)
    params = SamplingParams(temperature=0.8, top_k=6)
    p = probs_for(logits.clone(), [params] * 4)
    drafts = [int(torch.multinomial(p[j], 1)) for j in range(3)]
    for _ in range(20):
        res = RejectionSampler().sample(logits, [req(0, drafts, params, q=p[:3])])
        assert res.num_accepted == [3] and res.token_ids[0][:3] == drafts
        assert p[3, res.token_ids[0][3]] > 0  # the bonus respects top-k


def test_penalties_see_the_history_up_to_each_position():
    """Row 1 judges d_2 after d_1 = 5 was emitted: the frequency penalty must count it, exactly as
    plain decoding would (5 drops below 6 there)."""
    params = SamplingParams(temperature=0.0, frequency_penalty=2.0)
    logits = torch.zeros(3, V)
    logits[:, 5], logits[:, 6] = 3.0, 2.5
    res = RejectionSampler().sample(logits, [req(0, [5, 5], params, output=[1])])
    assert res.token_ids == [[5, 6]]


def test_min_tokens_bans_eos_per_position():
    params = SamplingParams(temperature=0.0, min_tokens=2)
    logits = peaked([0, 0, 0])  # eos (0) on top everywhere; 1 output token so far
    logits[:, 4] = 5.0
    res = RejectionSampler().sample(logits, [req(0, [4, 0], params, output=[7])])
    assert res.token_ids == [[4, 0, 0]]  # row 0 bans eos (1 output < 2), row 1 allows it (2 outputs)


def test_simulated_acceptance_forces_the_rate():
    logits = peaked([5, 7, 2, 9])
    always = RejectionSampler(simulated_acceptance=1.0)
    assert always.sample(logits, [req(0, [1, 1, 1])]).token_ids == [[1, 1, 1, 9]]
    assert RejectionSampler(simulated_acceptance=0.0).sample(logits, [req(0, [5, 7, 2])]).token_ids == [[5]]


def test_plain_greedy_batches_take_the_host_path_with_the_same_tokens(monkeypatch):
    """A batch of greedy requests without penalties, grammars or logprobs is verified from one argmax
    copied to the host; it gives the general path's tokens, ties (the first maximum wins) and empty
    drafts included, and the general path still serves a batch with one penalized request."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.randint(0, 4, (40, V), generator=gen).float()  # many tied maxima
    argmax = logits.argmax(dim=-1).tolist()
    reqs, row = [], 0
    for i in range(10):
        k = i % 5
        drafts = [argmax[row + j] if (i + j) % 3 else (argmax[row + j] + 1) % V for j in range(k)]
        reqs.append(req(row, drafts))
        row += k + 1
    calls = []
    general = RejectionSampler._sample_plain_greedy
    monkeypatch.setattr(RejectionSampler, "_sample_plain_greedy",
                        lambda self, *a: calls.append(1) or general(self, *a))
    fast = RejectionSampler().sample(logits, reqs)
    assert calls == [1]
    monkeypatch.setattr(rejection, "plain_greedy", lambda params, grammar: False)
    slow = RejectionSampler().sample(logits, reqs)
    assert fast.token_ids == slow.token_ids and fast.num_accepted == slow.num_accepted
    assert fast.num_accepted == [0, 1, 1, 0, 2, 0, 0, 2, 1, 0]
    # the same rule left on the device (drafting on the device): a request's rows hold its newest
    # token, then its drafts (the draft row j judges is the token at row j + 1)
    row_ids = torch.tensor([t for r in reqs for t in [3] + r.draft_ids])
    n = RejectionSampler().greedy_on_device(torch.tensor(argmax[:row]), row_ids, [len(r.draft_ids) + 1 for r in reqs],
                                            HostStaging(torch.device("cpu")))
    assert n.tolist() == fast.num_accepted
    counts = [len(r.draft_ids) + 1 for r in reqs]
    # requests that all verify the same number of drafts (the rows reshape: nothing uploaded)
    same = [r for r in reqs if len(r.draft_ids) == 2]
    rows = torch.tensor([r.first_row + j for r in same for j in range(3)])
    same_ids = torch.tensor([t for r in same for t in [5] + r.draft_ids])
    n_same = RejectionSampler().greedy_on_device(torch.tensor(argmax)[rows], same_ids, [3] * len(same),
                                                 HostStaging(torch.device("cpu")))
    assert n_same.tolist() == [fast.num_accepted[reqs.index(r)] for r in same] == [1, 2]
    for rate, want in ((1.0, [c - 1 for c in counts]), (0.0, [0] * len(reqs))):  # benchmarks' replay
        sim = RejectionSampler(simulated_acceptance=rate)
        assert sim.greedy_on_device(torch.tensor(argmax[:row]), row_ids, counts,
                                    HostStaging(torch.device("cpu"))).tolist() == want
    monkeypatch.undo()
    penalized = req(0, reqs[1].draft_ids, SamplingParams(temperature=0.0, repetition_penalty=1.5))
    RejectionSampler().sample(logits, [penalized, *reqs[2:]])
    assert calls == [1]


def test_replayed_acceptance_on_the_device_follows_its_rates_per_position():
    """Benchmarks' replayed acceptance (`simulated_acceptance`, a rate per draft position) for drafting on
    the device: drawn where the verification is (nothing but launches on the host), each draft accepted
    with its position's rate given the ones before it, never past a request's own drafts, the same
    draws for the same seed."""
    staging = HostStaging(torch.device("cpu"))
    argmax = torch.zeros(5 * 4, dtype=torch.long)

    def drawn(rates, counts, seed=0):
        rows = sum(counts)
        return RejectionSampler(simulated_acceptance=rates, seed=seed).greedy_on_device(
            argmax[:rows], argmax[:rows], counts, staging)

    uploads = []
    upload = staging.to_device
    staging.to_device = lambda *a: uploads.append(1) or upload(*a)
    assert drawn([1.0, 1.0, 0.0], [5, 5, 5, 5]).tolist() == [2, 2, 2, 2]  # the last rate repeats past the list
    assert not uploads  # every request verifying as many drafts: nothing goes up from the host
    assert drawn([1.0], [5, 2, 1, 4]).tolist() == [4, 1, 0, 3]  # uneven counts: each request's own drafts
    assert drawn([0.0, 1.0], [5, 2, 1, 4]).tolist() == [0, 0, 0, 0]
    many = RejectionSampler(simulated_acceptance=[0.6, 0.5], seed=3)
    n = torch.cat([many.greedy_on_device(argmax[:15], argmax[:15], [3] * 5, staging) for _ in range(4000)])
    # P(n >= 1) = 0.6, P(n = 2) = 0.6 * 0.5
    assert abs((n >= 1).float().mean().item() - 0.6) < 0.02 and abs((n == 2).float().mean().item() - 0.3) < 0.02
    assert torch.equal(drawn(0.5, [4] * 5, seed=1), drawn(0.5, [4] * 5, seed=1))
    assert not all(torch.equal(drawn(0.5, [4] * 5, seed=1), drawn(0.5, [4] * 5, seed=s)) for s in (2, 3, 4))


def test_seeded_requests_are_reproducible():
    params = SamplingParams(temperature=1.0, seed=7)
    torch.manual_seed(3)
    logits = torch.randn(4, V)
    q = torch.softmax(torch.randn(3, V), dim=-1)

    def run(seed):
        g = torch.Generator().manual_seed(seed)
        return [RejectionSampler().sample(logits, [req(0, [1, 2, 3], params, q=q, gen=g)]).token_ids[0]
                for _ in range(30)]

    assert run(7) == run(7)
    assert run(7) != run(8)


# -- the output distribution ---------------------------------------------------------------------
P = torch.tensor([0.40, 0.30, 0.10, 0.10, 0.05, 0.05])
Q = torch.tensor([0.05, 0.10, 0.40, 0.30, 0.10, 0.05])
N = 20000
K = 2


def emitted_distributions(params: SamplingParams, target_logits: torch.Tensor, draft_logits: torch.Tensor,
                          one_hot: bool = False, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """N requests, each with K drafts drawn from q and the same target row at every position.
    Returns (p, distribution of emitted token 0, of emitted token 1 when there is one)."""
    torch.manual_seed(seed)
    vocab = target_logits.shape[0]
    p = probs_for(target_logits[None].clone(), [params])[0]
    q = probs_for(draft_logits[None].clone(), [params])[0]
    drafts = torch.multinomial(q, N * K, replacement=True).view(N, K).tolist()
    logits = target_logits[None].expand(N * (K + 1), vocab).contiguous()
    q_rows = None if one_hot else q[None].expand(K, vocab)
    reqs = [VerifyRequest(i * (K + 1), d, SamplingRow(params, [], [], None), q_rows) for i, d in enumerate(drafts)]
    if one_hot:  # deterministic drafts: every request proposes the same fixed tokens
        for r in reqs:
            r.draft_ids = [0, 2]
    res = RejectionSampler().sample(logits, reqs)
    first = torch.bincount(torch.tensor([t[0] for t in res.token_ids]), minlength=vocab).float()
    second = torch.bincount(torch.tensor([t[1] for t in res.token_ids if len(t) > 1]), minlength=vocab).float()
    return p, first / first.sum(), second / second.sum()


def tv(a: torch.Tensor, b: torch.Tensor) -> float:
    return 0.5 * float((a - b).abs().sum())


TV_BOUND = 0.025  # sampling noise at N = 20000 over 6 tokens is ~0.008; wrong rules give 0.15+


@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0),
                                    SamplingParams(temperature=0.7, top_k=5, top_p=0.95)],
                         ids=["plain", "temp-topk-topp"])
def test_emitted_tokens_follow_the_target(params):
    p, first, second = emitted_distributions(params, P.log(), Q.log())
    assert tv(first, p) < TV_BOUND and tv(second, p) < TV_BOUND
    assert first[p == 0].sum() == 0  # nothing outside top-k / top-p is ever emitted


def test_deterministic_drafts_follow_the_target():
    p, first, second = emitted_distributions(SamplingParams(temperature=1.0), P.log(), Q.log(), one_hot=True)
    assert tv(first, p) < TV_BOUND and tv(second, p) < TV_BOUND


@pytest.mark.parametrize("wrong", ["accept-always", "resample-from-p", "residual-q-minus-p"])
def test_wrong_rules_fail_the_same_test(monkeypatch, wrong):
    """The statistical test has teeth: each broken rule moves the distribution far past the bound."""
    if wrong == "accept-always":
        monkeypatch.setattr(rejection, "accept_drafts", lambda u, p, q: torch.ones_like(p, dtype=torch.bool))
    elif wrong == "resample-from-p":
        monkeypatch.setattr(rejection, "recovered_distribution", lambda p, q: p)
    else:
        right = rejection.recovered_distribution
        monkeypatch.setattr(rejection, "recovered_distribution",
                            lambda p, q: torch.where(q.sum(-1, keepdim=True) > 0, right(q, p), p))
    p, first, _ = emitted_distributions(SamplingParams(temperature=1.0), P.log(), Q.log())
    assert tv(first, p) > 4 * TV_BOUND
