"""Parallel sampling (SamplingParams.n > 1) as a real fork, and LLMEngine.fork_request.

Guarantee under test: child i of a request with seed s produces exactly the tokens of an n = 1
request with seed s + i (same prompt logits, each child's own generator), with the prefix cache on or
off, under preemption; the prompt is prefilled once and its blocks are shared, the partially filled
last block too, copied only when a child writes into it.
"""
from __future__ import annotations

import random

import pytest

from specserve import LLM, SamplingParams

BS = 8


def make_llm(model_dir, **kw) -> LLM:
    args = {"dtype": "float32", "device": "cpu", "block_size": BS, "num_kv_blocks": 128, "max_model_len": 256}
    args.update(kw)
    return LLM(str(model_dir), **args)


def prompt(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 300) for _ in range(n)]


def sampled(n: int = 1, seed: int | None = 7, **kw) -> SamplingParams:
    return SamplingParams(n=n, temperature=1.0, seed=seed, max_tokens=10, ignore_eos=True, **kw)


def children(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> list[list[list[int]]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    assert all(len(o.outputs) == params.n and [c.index for c in o.outputs] == list(range(params.n))
               for o in outs)
    return [[c.token_ids for c in o.outputs] for o in outs]


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return make_llm(tiny_llama_dir)


def test_children_equal_independent_seeded_requests(llm, tiny_llama_dir):
    prompts = [prompt(21, 0), prompt(16, 1), prompt(3, 2)]
    forked = children(llm, prompts, sampled(n=3, seed=7))
    independent = [[children(llm, [p], sampled(seed=7 + i))[0][0] for i in range(3)] for p in prompts]
    assert forked == independent
    assert all(len({tuple(c) for c in group}) > 1 for group in forked), "the seeds should differ"
    no_cache = make_llm(tiny_llama_dir, enable_prefix_caching=False)
    assert children(no_cache, prompts, sampled(n=3, seed=7)) == forked


def test_the_prompt_is_prefilled_once_and_only_the_partial_block_is_copied(tiny_llama_dir):
    for caching in (True, False):
        llm = make_llm(tiny_llama_dir, enable_prefix_caching=caching)
        computed = []

        def spy(sched, *args, computed=computed, launch=llm.engine.runner.launch, **kwargs):
            computed.append(sched.num_batched_tokens)
            return launch(sched, *args, **kwargs)

        llm.engine.runner.launch = spy
        params = SamplingParams(n=4, temperature=1.0, seed=3, max_tokens=5, ignore_eos=True)
        out = llm.generate({"prompt_token_ids": prompt(21)}, params)[0]
        assert [len(c.token_ids) for c in out.outputs] == [5] * 4
        assert sum(computed) == 21 + 4 * 4  # one prefill, then 4 decodes per child
        # blocks 0, 1 are full and shared for good; block 2 (5 tokens) is copied by the first three
        # writers, the last one writes into it in place
        stats = llm.engine.stats()
        assert stats["num_cow_copies"] == 3 and stats["num_used_blocks"] == 0


def test_greedy_children_all_equal_the_single_greedy_output(llm):
    p = prompt(30, 4)
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    single = children(llm, [p], greedy)[0][0]
    many = children(llm, [p], SamplingParams(n=4, temperature=0.0, max_tokens=8, ignore_eos=True))[0]
    assert many == [single] * 4


def test_forked_children_under_preemption(tiny_llama_dir, llm):
    prompts = [prompt(21, s) for s in range(4)]
    params = sampled(n=3, seed=11)
    expected = children(llm, prompts, params)
    tight = make_llm(tiny_llama_dir, num_kv_blocks=12, max_model_len=96, max_num_batched_tokens=32)
    assert children(tight, prompts, params) == expected
    assert tight.engine.stats()["num_preemptions"] > 0, "meant to force preemption"
    assert tight.engine.stats()["num_used_blocks"] == 0


def test_children_stop_independently_and_logprobs_are_per_child(llm):
    params = SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=1, logprobs=2)
    out = llm.generate({"prompt_token_ids": prompt(10)}, params)[0]
    assert out.finished and all(len(c.token_ids) == 1 and c.finish_reason == "length" for c in out.outputs)
    assert all(c.logprobs and c.token_ids[0] in c.logprobs[0] for c in out.outputs)
    assert llm.engine.stats()["num_used_blocks"] == 0


def test_abort_before_the_fork_frees_everything(llm):
    engine = llm.engine
    engine.add_request("a", {"prompt_token_ids": prompt(40)}, sampled(n=4))
    engine.abort("a")
    assert not engine.has_unfinished() and engine.stats()["num_used_blocks"] == 0
    while engine.scheduler.has_unfinished():
        engine.step()


def test_n_larger_than_max_num_seqs_still_runs(tiny_llama_dir):
    llm = make_llm(tiny_llama_dir, max_num_seqs=2)
    outs = llm.generate([{"prompt_token_ids": prompt(9, s)} for s in range(3)], sampled(n=3))
    assert [len(o.outputs) for o in outs] == [3, 3, 3]


def test_fork_request_continues_a_running_request(llm):
    engine = llm.engine
    p = prompt(19, 8)
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    engine.add_request("src", {"prompt_token_ids": p}, greedy)
    while engine.scheduler.requests["src"].num_output_tokens < 6:
        engine.step()
    src = engine.scheduler.requests["src"]
    upto = src.all_token_ids[:22]  # the prompt and 3 generated tokens
    engine.fork_request("src", "again", greedy, num_tokens=len(p))  # regenerate the answer
    engine.fork_request("src", "mid", greedy, num_tokens=22)  # continue from a point in the answer
    assert engine.scheduler.requests["mid"].num_cached_tokens == 21
    with pytest.raises(ValueError, match="computed tokens"):
        engine.fork_request("src", "bad", greedy, num_tokens=src.num_computed_tokens + 1)
    with pytest.raises(ValueError, match="no unfinished request"):
        engine.fork_request("nope", "bad2", greedy)
    with pytest.raises(ValueError, match="cache_salt"):
        engine.fork_request("src", "bad3", SamplingParams(cache_salt="other"))
    with pytest.raises(ValueError, match="already in use"):
        engine.fork_request("src", "mid", greedy)
    done = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
    assert done["again"] == done["src"]
    fresh = children(llm, [upto], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    assert done["mid"] == fresh[0][0]
    assert engine.stats()["num_used_blocks"] == 0
