"""Sampler: seeded reproducibility, excluded tokens never drawn, penalties, logprobs."""
from __future__ import annotations

import pytest
import torch

from specserve.sample.sampler import Sampler, SamplingRow, apply_penalties, argmax_rows, probs_for
from specserve.sampling_params import SamplingParams


def row(params: SamplingParams, seed: int | None = None, out=(), prompt=(0,)) -> SamplingRow:
    gen = torch.Generator().manual_seed(seed) if seed is not None else None
    return SamplingRow(params=params, prompt_token_ids=list(prompt), output_token_ids=list(out), generator=gen,
                       eos_token_ids=frozenset({0}))


def logits_batch(n: int = 4, vocab: int = 50, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_is_argmax():
    logits = logits_batch()
    tokens, _ = Sampler()(logits.clone(), [row(SamplingParams(temperature=0.0))] * 4)
    assert tokens == logits.argmax(-1).tolist()


def test_seeded_runs_reproduce_and_seeds_differ():
    logits = logits_batch(1, 1000)
    p = SamplingParams(temperature=1.0)
    draws = lambda seed: [Sampler()(logits.clone(), [r])[0][0] for r in [row(p, seed)] for _ in range(30)]  # noqa: E731
    assert draws(7) == draws(7)
    assert draws(7) != draws(8)


@pytest.mark.parametrize("params,allowed", [
    (SamplingParams(temperature=1.5, top_k=3), lambda lg: set(lg.topk(3).indices.tolist())),
    (SamplingParams(temperature=1.5, top_p=0.5), None),
    (SamplingParams(temperature=1.5, min_p=0.2), None),
])
def test_truncation_never_emits_excluded_tokens(params, allowed):
    logits = logits_batch(1, 40, seed=3)[0]
    probs = logits.softmax(-1)
    if allowed is None and params.top_p < 1.0:
        # nucleus under the temperature: the smallest set of top tokens whose mass reaches top_p
        scaled = (logits / params.temperature).softmax(-1)
        order = scaled.argsort(descending=True)
        cum = scaled[order].cumsum(0)
        keep = int((cum < params.top_p).sum()) + 1
        allowed_set = set(order[:keep].tolist())
    elif allowed is None:
        scaled = (logits / params.temperature).softmax(-1)
        allowed_set = set((scaled >= params.min_p * scaled.max()).nonzero().flatten().tolist())
    else:
        allowed_set = allowed(logits)
    assert 1 <= len(allowed_set) < len(probs)
    seen = set()
    for seed in range(400):
        tokens, _ = Sampler()(logits[None].clone(), [row(params, seed)])
        seen.add(tokens[0])
    assert seen <= allowed_set
    assert len(seen) >= min(2, len(allowed_set))


def test_probs_for_mixed_batch_rows_are_independent():
    logits = logits_batch(3, 30)
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, top_k=2),
              SamplingParams(temperature=0.7)]
    probs = probs_for(logits.clone(), params)
    assert torch.allclose(probs.sum(-1), torch.ones(3))
    assert probs[0].max() == 1.0 and probs[0].argmax() == logits[0].argmax()
    assert (probs[1] > 0).sum() == 2
    assert torch.allclose(probs[2], (logits[2] / 0.7).softmax(-1), atol=1e-6)


def test_penalties():
    logits = torch.tensor([[2.0, -1.0, 1.0, 0.5]])
    p = SamplingParams(repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25)
    out = apply_penalties(logits.clone(), [row(p, out=[2, 2], prompt=[1])])
    # token 1 (prompt, negative) *2; token 2 (output twice): /2 - 0.5 - 0.5; token 0 untouched
    assert out.tolist() == [[2.0, -2.0, 1.0 / 2 - 0.5 - 0.25 * 2, 0.5]]


def test_min_tokens_bans_eos_and_stop_ids():
    logits = torch.zeros(1, 5)
    logits[0, 0] = 10.0  # eos
    logits[0, 3] = 9.0  # a stop token id
    p = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[3])
    tokens, _ = Sampler()(logits.clone(), [row(p, out=[4])])
    assert tokens == [1]  # eos (0) and stop id (3) banned; the remaining ties go to the lowest id


def test_logprobs_match_log_softmax_reference():
    logits = logits_batch(2, 60)
    params = [SamplingParams(temperature=0.0, logprobs=5), SamplingParams(temperature=1.0, logprobs=2)]
    tokens, lps = Sampler()(logits.clone(), [row(params[0]), row(params[1], seed=1)])
    ref = logits.log_softmax(-1)
    for i, (tok, lp) in enumerate(zip(tokens, lps)):
        assert tok in lp
        assert lp[tok] == pytest.approx(ref[i, tok].item(), abs=1e-5)
        top = ref[i].topk(params[i].logprobs)
        for t, v in zip(top.indices.tolist(), top.values.tolist()):
            assert lp[t] == pytest.approx(v, abs=1e-5)
        assert len(lp) <= params[i].logprobs + 1


@pytest.mark.parametrize("kwargs", [dict(temperature=-1), dict(top_p=0), dict(top_p=1.5), dict(top_k=-2),
                                    dict(min_p=2), dict(max_tokens=0), dict(n=0), dict(logprobs=-1),
                                    dict(min_tokens=5, max_tokens=2), dict(stop_token_ids=[-1])])
def test_bad_params_are_clear_value_errors(kwargs):
    with pytest.raises(ValueError):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_argmax_rows_is_argmax_with_ties_and_nan(dtype):
    """`argmax_rows` (on the CPU through max(dim=-1), which runs faster) gives argmax's indices: the
    first of tied maxima (few distinct values: many ties), a NaN's where a row has one."""
    gen = torch.Generator().manual_seed(0)
    for shape in [(1, 49152), (64, 49152), (130, 1000), (3, 7)]:
        for distinct in (2, 50, None):
            x = (torch.randint(0, distinct, shape, generator=gen) if distinct
                 else torch.randn(shape, generator=gen)).to(dtype)
            x[0, shape[1] // 2] = float("nan") if distinct == 50 else x[0, shape[1] // 2]
            assert torch.equal(argmax_rows(x), x.argmax(dim=-1)), (shape, distinct)
