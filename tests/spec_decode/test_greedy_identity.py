"""Greedy output with speculation equals the no-speculation engine token for token (fp32), whatever
the draft, k, batch mix, prefix-cache hits, chunked prefill or preemption."""
from __future__ import annotations

import pytest

from specserve import LLM, SamplingParams
from tests.spec_decode.conftest import spec_prompts

MAX_NEW = 32
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
ENGINE_ARGS = {
    # 4 seqs at a time: later admissions hit the shared prefix; 64-token budget chunks long prompts
    "mixed": dict(max_num_seqs=4, max_num_batched_tokens=64, block_size=8),
    "preempt": dict(num_kv_blocks=24, block_size=8, max_num_batched_tokens=64),
}
_reference: dict[str, list[list[int]]] = {}


def generate(model_dir, args: str, params=GREEDY, **spec_args) -> tuple[LLM, list[list[int]]]:
    llm = LLM(str(model_dir), dtype="float32", device="cpu", **ENGINE_ARGS[args], **spec_args)
    outs = llm.generate([{"prompt_token_ids": p} for p in spec_prompts()], params)
    assert llm.engine.kv_manager.pool.num_used_blocks == 0
    return llm, [o.outputs[0].token_ids for o in outs]


def reference(model_dir, args: str) -> list[list[int]]:
    if args not in _reference:
        _reference[args] = generate(model_dir, args)[1]
    return _reference[args]


def spec_config(method: str, k: int, draft_dir=None, **extra) -> dict:
    cfg = dict(method=method, num_speculative_tokens=k, **{"adaptive": False, **extra})
    if method == "draft_model":
        cfg["model"] = str(draft_dir)
    return cfg


@pytest.mark.parametrize("k", [1, 3, 5])
@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_greedy_identity_mixed_batch(tiny_llama_dir, noisy_draft_dir, method, k):
    llm, got = generate(tiny_llama_dir, "mixed", speculative_config=spec_config(method, k, noisy_draft_dir))
    assert got == reference(tiny_llama_dir, "mixed")
    stats = llm.engine.stats()
    assert stats["prefix_cache_hits"] > 0, "the batch was meant to hit the prefix cache"
    assert stats["spec_decode_num_drafts"] > 0
    assert 0 < stats["spec_decode_num_accepted_tokens"] < stats["spec_decode_num_draft_tokens"]


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_greedy_identity_under_preemption(tiny_llama_dir, noisy_draft_dir, method):
    llm, got = generate(tiny_llama_dir, "preempt", speculative_config=spec_config(method, 3, noisy_draft_dir))
    assert got == reference(tiny_llama_dir, "preempt")
    assert llm.engine.scheduler.num_preemptions > 0, "the test meant to force preemption"
    assert llm.engine.stats()["spec_decode_num_accepted_tokens"] > 0


@pytest.mark.parametrize("draft", ["small_draft_dir", "seed1_draft_dir"])
def test_greedy_identity_with_unrelated_drafts(tiny_llama_dir, request, draft):
    """Drafts that are almost always wrong (another seed, fewer layers): every draft is rejected
    at some point and the output must not move."""
    draft_dir = request.getfixturevalue(draft)
    _, got = generate(tiny_llama_dir, "mixed", speculative_config=spec_config("draft_model", 3, draft_dir))
    assert got == reference(tiny_llama_dir, "mixed")


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_greedy_identity_with_adaptive_k(tiny_llama_dir, noisy_draft_dir, method):
    # the noisy draft is as big as the target (draft_cost 1.0 would rightly switch it off): say it is cheap
    cfg = spec_config(method, 4, noisy_draft_dir, adaptive=True,
                      **({"draft_cost": 0.1} if method == "draft_model" else {}))
    llm, got = generate(tiny_llama_dir, "mixed", speculative_config=cfg)
    assert got == reference(tiny_llama_dir, "mixed")
    assert llm.engine.stats()["spec_decode_num_drafts"] > 0


def test_shorthand_flags_speculate(tiny_llama_dir, noisy_draft_dir):
    """`draft_model=` / `num_speculative_tokens=` (the --draft-model / --num-speculative-tokens flags)."""
    llm, got = generate(tiny_llama_dir, "mixed", draft_model=str(noisy_draft_dir), num_speculative_tokens=2)
    assert got == reference(tiny_llama_dir, "mixed")
    spec = llm.engine.config.spec
    assert (spec.method, spec.num_speculative_tokens) == ("draft_model", 2)


def test_greedy_requests_unchanged_next_to_random_ones(tiny_llama_dir, noisy_draft_dir):
    """Greedy and seeded random requests in one batch: the greedy ones still match the reference,
    and the random ones are reproducible run to run."""
    prompts = spec_prompts()
    params = [GREEDY if i % 2 == 0 else SamplingParams(temperature=0.9, top_p=0.9, seed=i, max_tokens=MAX_NEW,
                                                        ignore_eos=True) for i in range(len(prompts))]
    runs = []
    for _ in range(2):
        llm = LLM(str(tiny_llama_dir), dtype="float32", device="cpu", **ENGINE_ARGS["mixed"],
                  speculative_config=spec_config("draft_model", 3, noisy_draft_dir))
        runs.append([o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts],
                                                                   params)])
    expected = reference(tiny_llama_dir, "mixed")
    assert [runs[0][i] for i in range(0, 8, 2)] == [expected[i] for i in range(0, 8, 2)]
    assert runs[0] == runs[1]
    assert llm.engine.kv_manager.pool.num_used_blocks == 0


def test_default_model_ngram_matches_no_speculation(default_model_dir):
    """The real SmolLM2 (fp32) with n-gram drafts on chat prompts."""
    prompts = [[{"role": "user", "content": "Write a Python function that returns the sum of a list, "
                                            "then show it on the list [1, 2, 3]."}],
               [{"role": "user", "content": "Repeat this sentence twice: the quick brown fox jumps."}]]
    params = SamplingParams(temperature=0.0, max_tokens=40)
    outs = {}
    for name, spec in [("plain", None), ("ngram", dict(method="ngram", num_speculative_tokens=4, adaptive=False))]:
        llm = LLM(str(default_model_dir), dtype="float32", device="cpu", max_model_len=512,
                  speculative_config=spec)
        outs[name] = [o.outputs[0].token_ids for o in llm.chat(prompts, params)]
    assert outs["ngram"] == outs["plain"]
    assert llm.engine.stats()["spec_decode_num_accepted_tokens"] > 0
