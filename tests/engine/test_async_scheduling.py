"""Async scheduling: a plain decode step stays in flight while the next one is scheduled and launched
(its tokens feed the next step on the device). Outputs must be exactly those of the synchronous
engine — stops, seeds, forks, logprobs, penalties, aborts and preemption included — and no block may
leak. On the CPU the device work is not actually overlapped, but every code path is the same."""
from __future__ import annotations

import pytest

from specserve import LLM, SamplingParams

PROMPTS = [[5 + i, 6, 7, 8 + i] * (2 + i % 3) for i in range(8)]


def run(tiny_llama_dir, params, async_scheduling, prompts=PROMPTS, **engine_args):
    llm = LLM(str(tiny_llama_dir), dtype="float32", device="cpu", async_scheduling=async_scheduling,
              **engine_args)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    assert llm.engine.kv_manager.pool.num_used_blocks == 0
    assert not llm.engine.scheduler.has_unfinished()
    return llm, [[(c.token_ids, c.finish_reason, c.stop_reason, c.logprobs) for c in o.outputs] for o in outs]


def greedy_ids(tiny_llama_dir, n=24):
    llm = LLM(str(tiny_llama_dir), dtype="float32", device="cpu")
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                        SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("engine_args", [dict(), dict(num_kv_blocks=9, block_size=4, max_num_batched_tokens=32)],
                         ids=["roomy", "preempt"])
def test_stops_and_lengths_match_sync(tiny_llama_dir, engine_args):
    """Requests stop on stop ids at different steps (and by length): the in-flight step computed a
    token past the stop, which must be dropped."""
    ids = greedy_ids(tiny_llama_dir)
    # odd i: stop at the first occurrence of token 3 + i; even i: length, before that token
    params = [SamplingParams(temperature=0.0, max_tokens=24 - i if i % 2 else 1 + ids[i].index(ids[i][3 + i]) // 2,
                             stop_token_ids=[ids[i][3 + i]]) for i in range(8)]
    _, sync = run(tiny_llama_dir, params, False, **engine_args)
    llm, got = run(tiny_llama_dir, params, True, **engine_args)
    assert got == sync
    assert llm.engine.stats()["num_deferred_steps"] > 0, "no step was left in flight"
    assert any(o[0][1] == "stop" for o in got) and any(o[0][1] == "length" for o in got)
    if "num_kv_blocks" in engine_args:
        assert llm.engine.scheduler.num_preemptions > 0


def test_sampling_features_match_sync(tiny_llama_dir):
    """Seeded sampling, penalties, min_tokens, logprobs and n > 1 in one batch: the steps that need
    the token history on the host run synchronously, the rest in flight; outputs are identical."""
    params = [SamplingParams(temperature=1.0, seed=7, max_tokens=12, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=12, repetition_penalty=1.3, ignore_eos=True),
              SamplingParams(temperature=0.8, top_k=20, seed=3, max_tokens=12, min_tokens=6),
              SamplingParams(temperature=0.0, max_tokens=12, logprobs=2, ignore_eos=True),
              SamplingParams(temperature=1.0, seed=11, n=3, max_tokens=12, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
              SamplingParams(temperature=0.7, top_p=0.9, seed=5, max_tokens=12, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=[9], ignore_eos=True),
              SamplingParams(temperature=1.0, seed=1, max_tokens=30, ignore_eos=True)]  # outlives the rest
    prompts = PROMPTS + [PROMPTS[1]]
    _, sync = run(tiny_llama_dir, params, False, prompts)
    llm, got = run(tiny_llama_dir, params, True, prompts)
    assert got == sync
    assert llm.engine.stats()["num_deferred_steps"] > 0


def test_abort_in_flight_frees_everything(tiny_llama_dir):
    llm = LLM(str(tiny_llama_dir), dtype="float32", device="cpu", async_scheduling=True)
    eng = llm.engine
    for i in range(3):
        eng.add_request(f"r{i}", PROMPTS[i], SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
    for _ in range(4):
        eng.step()
    assert eng._inflight is not None, "a decode step should be in flight"
    eng.abort("r1")
    outs = []
    while eng.has_unfinished():
        outs += eng.step()
    assert {o.request_id for o in outs} == {"r0", "r2"}
    assert all(len(o.outputs[0].token_ids) == 40 for o in outs if o.finished)
    assert eng.kv_manager.pool.num_used_blocks == 0 and eng._inflight is None


def test_fork_request_waits_for_the_token_in_flight(tiny_llama_dir):
    """fork_request between steps sees the source's last token (the step in flight is collected)."""
    llm = LLM(str(tiny_llama_dir), dtype="float32", device="cpu", async_scheduling=True)
    eng = llm.engine
    eng.add_request("src", PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True))
    for _ in range(5):
        eng.step()
    assert eng._inflight is not None
    fork_id = eng.fork_request("src", "fork", SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True))
    source = eng.scheduler.requests["src"]
    assert source.num_pending == 0 and eng._inflight is None
    outs = {}
    while eng.has_unfinished():
        for o in eng.step():
            outs[o.request_id] = o
    src_ids = outs["src"].outputs[0].token_ids
    forked_prefix = len(outs[fork_id].prompt_token_ids) - len(PROMPTS[0])
    assert forked_prefix > 0
    # greedy: the fork continues exactly as the source did
    assert outs[fork_id].outputs[0].token_ids == src_ids[forked_prefix:forked_prefix + 10]

