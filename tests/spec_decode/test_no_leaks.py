"""Thousands of verifications with adversarial accept/reject patterns leak no KV block, keep the
cache manager's invariants, and (greedy) still give the reference output."""
from __future__ import annotations

import random

import pytest

from specserve import LLM, SamplingParams
from tests.cache.invariants import check_invariants
from tests.spec_decode.conftest import VOCAB, spec_prompts

K = 4
MAX_NEW = 48
ENGINE_ARGS = dict(dtype="float32", device="cpu", block_size=4, num_kv_blocks=80, max_num_seqs=8,
                   max_num_batched_tokens=48)


class AdversarialProposer:
    """Drafts built from the known greedy continuation: `right` (always accepted), `wrong` (always
    rejected at the first draft), `random` (a random accepted prefix, then garbage)."""

    cache_identity = None
    draft_model = None
    drafts_on_device = False

    def __init__(self, mode: str, reference: dict[tuple, list[int]], lookahead: int, seed: int = 0) -> None:
        self.mode = mode
        self.reference = reference
        self.num_lookahead_tokens = lookahead
        self.rng = random.Random(seed)

    def bind(self, binding) -> None:
        pass

    def begin_step(self, sched) -> None:
        pass

    def waiting(self) -> None:
        pass

    def draft_probs(self, req_id: str):
        return None

    def needs_aux(self, sched, deferred) -> bool:
        return False  # it reads no hidden states

    def idle(self, sched) -> bool:
        return False

    def propose(self, step) -> dict[str, list[int]]:
        sched, out = step.sched, step.out
        drafts = {}
        for s in sched.scheduled:
            new_ids = out.sampled_token_ids.get(s.request.request_id)
            if not new_ids:
                continue
            ref = self.reference[tuple(s.request.prompt_token_ids)]
            done = s.request.num_output_tokens + len(new_ids)
            truth = ref[done:done + K] + [3] * K  # past max_tokens: anything (the scheduler trims)
            wrong = [(t + 1) % VOCAB for t in truth[:K]]
            if self.mode == "right":
                drafts[s.request.request_id] = truth[:K]
            elif self.mode == "wrong":
                drafts[s.request.request_id] = wrong
            else:
                cut = self.rng.randrange(K + 1)
                drafts[s.request.request_id] = truth[:cut] + wrong[cut:K]
        return drafts


@pytest.fixture(scope="module")
def workload(tiny_llama_dir):
    # 60 requests; the last 10 repeat earlier prompts (prefix-cache hits)
    prompts = [p for seed in range(1, 6) for p in spec_prompts(10, seed)] + spec_prompts(10, seed=1)
    llm = LLM(str(tiny_llama_dir), **ENGINE_ARGS)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    return prompts, {tuple(p): o.outputs[0].token_ids for p, o in zip(prompts, outs)}


@pytest.mark.parametrize("mode,lookahead", [("right", 0), ("wrong", K), ("random", 0), ("random", K)])
def test_adversarial_drafts_leak_nothing(tiny_llama_dir, workload, mode, lookahead):
    prompts, reference = workload
    llm = LLM(str(tiny_llama_dir), **ENGINE_ARGS,
              speculative_config=dict(method="ngram", num_speculative_tokens=K))
    engine = llm.engine
    engine.runner.proposer = AdversarialProposer(mode, reference, lookahead)
    engine.scheduler.num_lookahead_tokens = lookahead
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", {"prompt_token_ids": p}, params)
    done, steps = {}, 0
    while engine.has_unfinished():
        for o in engine.step():
            if o.finished:
                done[o.request_id] = o.outputs[0].token_ids
        steps += 1
        if steps % 25 == 0:
            check_invariants(engine.kv_manager)
    check_invariants(engine.kv_manager)
    assert engine.kv_manager.pool.num_used_blocks == 0
    assert [done[f"r{i}"] for i in range(len(prompts))] == [reference[tuple(p)] for p in prompts]
    stats = engine.stats()
    assert stats["num_preemptions"] > 0, "the pool was meant to be tight enough to preempt"
    assert stats["spec_decode_num_drafts"] > 500  # verifications; all modes together: thousands
    rate = stats["spec_decode_acceptance_rate"]
    if mode == "right":
        assert rate == 1.0
    elif mode == "wrong":
        assert stats["spec_decode_num_accepted_tokens"] == 0
    else:
        assert 0.2 < rate < 0.8
