"""Prefix caching end to end: greedy output with the cache on equals the cache off, token for token
(fp32 tiny random models), under shared / partial-block / identical prompts, eviction pressure,
chunked prefill and preemption; forced hash collisions; salts; counters; copy-on-write in the runner."""
from __future__ import annotations

import random

import pytest

from specserve import LLM, SamplingParams

BS = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def make_llm(model_dir, **kw) -> LLM:
    args = {"dtype": "float32", "device": "cpu", "block_size": BS, "num_kv_blocks": 256,
            "max_model_len": 256}
    return LLM(str(model_dir), **(args | kw))


def generate(llm: LLM, prompts: list[list[int]], params: SamplingParams = GREEDY) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)]


def shared_prefix_workload(seed: int = 0) -> list[list[int]]:
    """System prompts of 37 (partial last block) and 24 (block-aligned) tokens with unique questions,
    identical prompts (whole prompt cached: the last token is recomputed), and unrelated prompts."""
    rng = random.Random(seed)

    def toks(n: int) -> list[int]:
        return [rng.randrange(3, 300) for _ in range(n)]

    sys_a, sys_b = toks(37), toks(24)
    prompts = [sys_a + toks(rng.randrange(1, 12)) for _ in range(5)]
    prompts += [sys_b + toks(rng.randrange(1, 12)) for _ in range(4)]
    prompts += [sys_b, sys_b, sys_a, sys_a, sys_a[:20], toks(5), toks(1)]
    rng.shuffle(prompts)
    return prompts


@pytest.fixture(scope="module")
def workload():
    return shared_prefix_workload()


@pytest.fixture(scope="module")
def expected(tiny_model_dir, workload):
    """The oracle: the same engine without prefix caching."""
    llm = make_llm(tiny_model_dir, enable_prefix_caching=False)
    assert not llm.engine.kv_manager.enable_caching
    first = generate(llm, workload)
    stats = llm.engine.stats()
    assert stats["prefix_cache_queries"] == stats["prefix_cache_hits"] == stats["num_cached_blocks"] == 0
    return first


@pytest.mark.parametrize("engine_args", [
    {},
    {"max_num_batched_tokens": 24},  # chunked prefill: hits and chunks mix
    {"num_kv_blocks": 16, "max_model_len": 128, "max_num_batched_tokens": 64},  # eviction + preemption
], ids=["plain", "chunked", "pressure"])
def test_greedy_output_with_cache_equals_without(tiny_model_dir, workload, expected, engine_args):
    llm = make_llm(tiny_model_dir, **engine_args)
    cold = generate(llm, workload)  # all at once: later admissions hit blocks registered this step
    assert cold == expected
    warm = generate(llm, workload)  # everything cached (or partly evicted) from the first run
    assert warm == expected
    stats = llm.engine.stats()
    assert stats["prefix_cache_hits"] > 0
    assert stats["num_used_blocks"] == 0
    if "num_kv_blocks" in engine_args:
        assert stats["num_evictions"] > 0 and stats["num_preemptions"] > 0, "meant to force both"


def test_counters_and_cached_tokens_per_request(tiny_llama_dir):
    llm = make_llm(tiny_llama_dir, max_num_batched_tokens=512)
    rng = random.Random(1)
    system = [rng.randrange(3, 300) for _ in range(40)]  # 5 full blocks
    first = llm.generate({"prompt_token_ids": system + [7, 8, 9]}, GREEDY)[0]
    assert first.num_cached_tokens == 0
    s = llm.engine.stats()
    assert (s["prefix_cache_queries"], s["prefix_cache_hits"]) == (43, 0)
    # 43 prompt + 11 computed output tokens = 6 full blocks registered; all free, all still cached
    assert s["num_cached_blocks"] == 6 and s["num_used_blocks"] == 0

    outs = llm.generate([{"prompt_token_ids": system + [i, i + 1]} for i in range(10, 13)], GREEDY)
    assert [o.num_cached_tokens for o in outs] == [40, 40, 40]
    s = llm.engine.stats()
    assert (s["prefix_cache_queries"], s["prefix_cache_hits"]) == (43 + 3 * 42, 120)
    assert s["prefix_cache_hit_rate"] == pytest.approx(120 / 169)
    assert s["num_evictions"] == 0 and s["num_cow_copies"] == 0

    same = llm.generate({"prompt_token_ids": system}, GREEDY)[0]  # whole prompt cached
    assert same.num_cached_tokens == 39  # the last token is recomputed for its logits
    assert llm.engine.stats()["num_cow_copies"] == 0  # nobody else held the block: written in place


def test_salted_requests_share_only_with_the_same_salt(tiny_llama_dir):
    llm = make_llm(tiny_llama_dir)
    prompt = {"prompt_token_ids": list(range(10, 50))}

    def salted(salt: str | None) -> SamplingParams:
        return SamplingParams(temperature=0.0, max_tokens=4, cache_salt=salt)

    assert llm.generate(prompt, salted("alice"))[0].num_cached_tokens == 0
    assert llm.generate(prompt, salted("bob"))[0].num_cached_tokens == 0
    assert llm.generate(prompt, salted(None))[0].num_cached_tokens == 0
    alice = llm.generate(prompt, salted("alice"))[0]
    assert alice.num_cached_tokens == 39
    assert alice.outputs[0].token_ids == llm.generate(prompt, salted(None))[0].outputs[0].token_ids


def test_forced_hash_collisions_never_change_the_output(tiny_llama_dir, workload):
    reference = generate(make_llm(tiny_llama_dir, enable_prefix_caching=False), workload)
    llm = make_llm(tiny_llama_dir)
    llm.engine.kv_manager.hash_fn = lambda data: b"\x00" * 16  # every block hash collides
    assert generate(llm, workload) == reference
    assert generate(llm, workload) == reference
    assert llm.engine.stats()["prefix_cache_hits"] > 0  # real prefixes are still found
    assert len(llm.engine.kv_manager.pool.cached) == 1


def test_copy_on_write_copies_the_kv_in_the_runner(tiny_llama_dir):
    """Two requests with the same block-aligned prompt in one step: the second recomputes its last
    token into a private copy of the first's last block, whose KV must equal the source's."""
    llm = make_llm(tiny_llama_dir)
    runner = llm.engine.runner
    performed = []
    original = runner.copy_blocks

    def spy(copies):
        original(copies)
        for src, dst in copies:
            assert runner.kv_cache[:, :, dst].equal(runner.kv_cache[:, :, src])
            performed.append((src, dst, runner.kv_cache[:, :, src].clone()))

    runner.copy_blocks = spy
    prompt = list(range(20, 36))  # two full blocks
    llm.generate({"prompt_token_ids": prompt}, GREEDY)  # cache it
    outs = generate(llm, [prompt, prompt])  # both hit all blocks; each recomputes token 15
    assert llm.engine.stats()["num_cow_copies"] == 1 and len(performed) == 1
    _src, dst, src_kv = performed[0]
    # after the forward, dst holds the source's KV for tokens 8..14 and a recomputed token 15
    assert runner.kv_cache[:, :, dst, :BS - 1].equal(src_kv[:, :, :BS - 1])
    assert runner.kv_cache[:, :, dst, BS - 1].allclose(src_kv[:, :, BS - 1], atol=1e-5)
    assert outs[0] == outs[1] == generate(make_llm(tiny_llama_dir, enable_prefix_caching=False), [prompt])[0]


def test_cli_flag_turns_caching_off():
    from specserve.cli import build_parser, engine_kwargs

    args = build_parser().parse_args(["generate", "hi", "--no-enable-prefix-caching"])
    assert engine_kwargs(args)["enable_prefix_caching"] is False
    args = build_parser().parse_args(["generate", "hi"])
    assert engine_kwargs(args)["enable_prefix_caching"] is True
