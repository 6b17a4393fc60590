"""The draft-model proposer: full acceptance when draft = target, KV shared through block ids
(prefix hits skip the draft's prefill; stale blocks are not trusted), vocabulary checks."""
from __future__ import annotations

import types

import pytest
import torch

from specserve import LLM, SamplingParams
from specserve.config import SpecConfig
from specserve.models.loader import load_model
from specserve.spec_decode import build_proposer, check_same_vocab
from tests.spec_decode.conftest import spec_prompts

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def self_draft_llm(model_dir, k: int = 3, **args) -> LLM:
    spec = dict(method="draft_model", model=str(model_dir), num_speculative_tokens=k, adaptive=False)
    return LLM(str(model_dir), dtype="float32", device="cpu", block_size=8, speculative_config=spec, **args)


def record_draft_queries(llm: LLM) -> list[list[int]]:
    """Wrap the draft's forward to record each call's per-request query lengths."""
    executor = llm.engine.proposer.executor
    calls: list[list[int]] = []
    forward = executor.forward_tokens

    def spy(input_ids, query_lens, *rest):
        calls.append(list(query_lens))
        return forward(input_ids, query_lens, *rest)

    executor.forward_tokens = spy
    return calls


def test_draft_equal_to_target_accepts_everything(tiny_llama_dir):
    """Greedy, mixed lengths, prefix hits, chunked prefill, an n=2 request (forked children share
    and copy-on-write the draft's KV too): every draft is accepted."""
    llm = self_draft_llm(tiny_llama_dir, max_num_seqs=4, max_num_batched_tokens=64)
    prompts = [{"prompt_token_ids": p} for p in spec_prompts()]
    params = [GREEDY] * 7 + [SamplingParams(temperature=0.0, n=2, max_tokens=24, ignore_eos=True)]
    outs = llm.generate(prompts, params)
    stats = llm.engine.stats()
    assert stats["spec_decode_acceptance_rate"] == 1.0 and stats["prefix_cache_hits"] > 0
    assert stats["spec_decode_num_accepted_tokens_per_pos"][0] == stats["spec_decode_num_drafts"]
    for o in outs:
        assert o.metrics.acceptance_rate == 1.0
        assert o.metrics.mean_acceptance_length > 3.0  # 4 per step, fewer only at max_tokens
    assert outs[-1].outputs[0].token_ids == outs[-1].outputs[1].token_ids
    assert llm.engine.kv_manager.pool.num_used_blocks == 0


def test_prefix_hit_skips_the_drafts_prefill(tiny_llama_dir):
    llm = self_draft_llm(tiny_llama_dir)
    prompt = {"prompt_token_ids": spec_prompts()[4]}  # 96 tokens = 12 full blocks
    calls = record_draft_queries(llm)
    llm.generate(prompt, GREEDY)
    assert max(calls[0]) == 97  # the prompt, plus the first sampled token
    calls.clear()
    out = llm.generate(prompt, GREEDY)[0]
    assert out.num_cached_tokens == 95
    assert max(max(c) for c in calls) <= 2  # the draft's KV for the prompt came with the hit
    assert out.metrics.acceptance_rate == 1.0


@pytest.mark.parametrize("trust_stale", [False, True])
def test_blocks_computed_without_the_draft_are_not_trusted(tiny_llama_dir, trust_stale):
    """With speculation off for a step (k = 0 everywhere) the draft does not run; the blocks the
    target wrote meanwhile hold no draft KV. A later prefix hit on them must make the draft recompute
    them (acceptance stays 1.0 with draft = target); trusting them (the control) loses acceptance."""
    llm = self_draft_llm(tiny_llama_dir)
    proposer = llm.engine.proposer
    plan = proposer.policy.plan
    proposer.policy.plan = lambda rooms, *a, **kw: dict.fromkeys(rooms, 0)
    prompt = {"prompt_token_ids": spec_prompts()[4]}
    llm.generate(prompt, GREEDY)
    assert llm.engine.stats()["spec_decode_num_drafts"] == 0
    proposer.policy.plan = plan
    if trust_stale:
        proposer.entries._trusted_prefix = types.MethodType(lambda self, s: s.start, proposer.entries)
    out = llm.generate(prompt, GREEDY)[0]
    assert out.num_cached_tokens == 95
    if trust_stale:
        assert out.metrics.acceptance_rate < 0.9
    else:
        assert out.metrics.acceptance_rate == 1.0


def test_draft_catches_up_after_speculation_was_off(tiny_llama_dir):
    """k = 0 for the first steps (the draft falls behind), then on again: the draft catches up in
    one forward (reported to the policy as the spell's start) and, being the target, is accepted
    every time."""
    llm = self_draft_llm(tiny_llama_dir)
    proposer = llm.engine.proposer
    plan, steps = proposer.policy.plan, []

    def sometimes(rooms, *a, **kw):
        steps.append(1)
        return plan(rooms, *a, **kw) if len(steps) > 6 else dict.fromkeys(rooms, 0)

    proposer.policy.plan = sometimes
    starts = []  # the catch-ups reported as a spell's start (judged apart from its steps: `caught_up`)
    caught_up = proposer.policy.caught_up
    proposer.policy.caught_up = lambda seconds: starts.append(seconds) or caught_up(seconds)
    calls = record_draft_queries(llm)
    out = llm.generate({"prompt_token_ids": spec_prompts()[1]}, GREEDY)[0]
    assert calls[0] == [25 + 7]  # prompt + 6 plain steps' tokens + the newest token, in one go
    # that catch-up alone covered positions from before its step; the steps after it catch up their own
    assert len(starts) == 1 and starts[0]() > 0
    assert out.metrics.num_drafts > 0 and out.metrics.acceptance_rate == 1.0


def test_random_requests_with_draft_equal_to_target(tiny_llama_dir):
    llm = self_draft_llm(tiny_llama_dir)
    params = SamplingParams(temperature=0.8, top_k=20, seed=3, max_tokens=24, ignore_eos=True)
    a = llm.generate([{"prompt_token_ids": p} for p in spec_prompts()[:4]], params)
    assert llm.engine.stats()["spec_decode_acceptance_rate"] > 0.95  # p == q up to float rounding
    b = self_draft_llm(tiny_llama_dir).generate([{"prompt_token_ids": p} for p in spec_prompts()[:4]], params)
    assert [o.outputs[0].token_ids for o in a] == [o.outputs[0].token_ids for o in b]


def test_draft_with_another_vocabulary_is_refused(tiny_llama_dir, tiny_qwen2_dir):
    with pytest.raises(ValueError, match="vocabulary of 300 tokens.*has 320.*tokenizer"):
        LLM(str(tiny_llama_dir), dtype="float32", device="cpu",
            speculative_config=dict(method="draft_model", model=str(tiny_qwen2_dir)))


def test_draft_with_another_tokenizer_is_refused(tiny_llama_dir):
    target = load_model(str(tiny_llama_dir), dtype="float32", device=torch.device("cpu"))
    draft = load_model(str(tiny_llama_dir), dtype="float32", device=torch.device("cpu"))
    target.tokenizer = types.SimpleNamespace(get_vocab=lambda: {"a": 0, "b": 1})
    draft.tokenizer = types.SimpleNamespace(get_vocab=lambda: {"a": 1, "b": 0})
    with pytest.raises(ValueError, match="different tokenizer"):
        check_same_vocab(target, draft)


def test_an_already_built_model_can_be_the_draft(tiny_llama_dir):
    """The `self-nf4` path: a module of our family (e.g. the target quantized) instead of a path."""
    target = load_model(str(tiny_llama_dir), dtype="float32", device=torch.device("cpu"))
    module = load_model(str(tiny_llama_dir), dtype="float32", device=torch.device("cpu")).model
    spec = SpecConfig(method="draft_model", model="self-test", num_speculative_tokens=2)
    proposer = build_proposer(spec, target=target, device=torch.device("cpu"), max_positions=512,
                              max_num_batched_tokens=64, draft_model=module)
    assert proposer.draft_model is module and proposer.cache_identity[:2] == ("draft", "self-test")
    assert proposer.num_lookahead_tokens == 2
