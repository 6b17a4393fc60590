"""The engine's greedy output equals HF transformers generate token for token (fp32)."""
from __future__ import annotations

import random

import pytest

from specserve import LLM, SamplingParams
from tests.conftest import hf_greedy


def mixed_prompts(vocab: int, lengths: list[int], seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


LENGTHS = [5, 17, 33, 1, 64, 9, 40, 23]
MAX_NEW = 24


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    from transformers import AutoConfig
    vocab = AutoConfig.from_pretrained(str(tiny_model_dir)).vocab_size
    prompts = mixed_prompts(vocab, LENGTHS)
    return prompts, hf_greedy(tiny_model_dir, prompts, MAX_NEW)


@pytest.mark.parametrize("engine_args", [
    dict(),  # plenty of budget: whole prompts in one step
    dict(max_num_batched_tokens=16, block_size=4),  # chunked prefill forced
    dict(num_kv_blocks=14, block_size=8, max_num_batched_tokens=64),  # preemption forced
    dict(enable_prefix_caching=False, max_num_seqs=3),
    # async scheduling (the CUDA default): plain decode steps stay in flight while the next is scheduled
    dict(async_scheduling=True),
    dict(async_scheduling=True, max_num_batched_tokens=16, block_size=4),
    dict(async_scheduling=True, num_kv_blocks=14, block_size=8, max_num_batched_tokens=64),
    dict(async_scheduling=True, enable_prefix_caching=False, max_num_seqs=3),
], ids=["plain", "chunked", "preempt", "nocache-3seqs", "async", "async-chunked", "async-preempt",
        "async-3seqs"])
def test_greedy_matches_hf(tiny_model_dir, reference, engine_args):
    prompts, expected = reference
    llm = LLM(str(tiny_model_dir), dtype="float32", device="cpu", **engine_args)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    got = [o.outputs[0].token_ids for o in outs]
    assert got == expected
    if "num_kv_blocks" in engine_args:
        assert llm.engine.scheduler.num_preemptions > 0, "the test meant to force preemption"
    assert llm.engine.kv_manager.pool.num_used_blocks == 0


def test_default_model_greedy_matches_hf(default_model_dir):
    """The real SmolLM2-135M-Instruct in fp32, mixed prompt lengths, chunked prefill and preemption."""
    from specserve.models.loader import load_tokenizer
    tok = load_tokenizer(default_model_dir)
    texts = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village by the sea,",
             "1, 2, 3, 4,"]
    prompts = [tok.encode(t) for t in texts]
    expected = hf_greedy(default_model_dir, prompts, 16)
    llm = LLM(str(default_model_dir), dtype="float32", device="cpu", max_num_batched_tokens=16,
              num_kv_blocks=10, block_size=8)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert llm.engine.scheduler.num_preemptions > 0
    assert "Paris" in outs[0].outputs[0].text
