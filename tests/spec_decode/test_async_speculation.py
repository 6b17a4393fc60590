"""Speculation under async scheduling: steps where adaptive k would draft nothing are deferred like
plain ones (the proposer idles and only keeps its books); output is unchanged."""
from __future__ import annotations

import pytest

from specserve import SamplingParams
from tests.engine.test_async_scheduling import run
from tests.spec_decode.conftest import spec_prompts


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_speculation_defers_the_steps_where_no_draft_pays(tiny_llama_dir, noisy_draft_dir, method):
    """With adaptive k on analytic costs (ridge at 2 tokens), drafts pay for a batch of 1-2 requests
    but not for 8: the 8-request steps are deferred like plain ones (the proposer idles), and drafting
    resumes as the batch shrinks. Greedy output equals the plain synchronous engine's."""
    prompts = spec_prompts()[:8]
    params = [SamplingParams(temperature=0.0, max_tokens=6 + 6 * i, ignore_eos=True) for i in range(8)]
    _, plain = run(tiny_llama_dir, params, False, prompts)
    spec = dict(method=method, num_speculative_tokens=4, adaptive=True, compute_bound_tokens=2)
    if method == "draft_model":
        spec.update(model=str(noisy_draft_dir), draft_cost=0.1)
    llm, got = run(tiny_llama_dir, params, True, prompts, speculative_config=spec)
    assert got == plain
    stats = llm.engine.stats()
    assert stats["num_deferred_steps"] > 0, "the full batch should not have drafted"
    assert stats["spec_decode_num_drafts"] > 0, "the shrunken batch should have drafted"


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_the_engine_tells_the_proposer_when_it_waits_for_requests(tiny_llama_dir, async_scheduling):
    """When its last request ends (finished or aborted) the engine tells the
    proposer it waits (`waiting`): no step is timed across the pause before the next request."""
    from specserve import LLM

    llm = LLM(str(tiny_llama_dir), dtype="float32", device="cpu", async_scheduling=async_scheduling,
              speculative_config=dict(method="ngram", num_speculative_tokens=3))
    policy = llm.engine.runner.proposer.policy
    waits = []
    policy.waiting = lambda: waits.append(llm.engine.has_unfinished())
    prompts = [{"prompt_token_ids": p} for p in spec_prompts()[:3]]
    llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    assert waits == [False]  # once, when nothing was left
    llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    assert waits == [False, False]
    req = llm.engine.add_request(None, {"prompt_token_ids": spec_prompts()[0]},
                                 SamplingParams(temperature=0.0, max_tokens=50))
    llm.engine.step()
    llm.engine.abort(req)
    assert waits == [False, False, False]
