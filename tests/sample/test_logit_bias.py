"""`logit_bias`: a token id's bias is added to its logit before sampling — on every verified position
under speculative decoding too — and out-of-range input is refused."""
from __future__ import annotations

import pytest

from specserve import LLM, SamplingParams

PROMPT = {"prompt_token_ids": [5, 17, 42, 99, 7, 3, 5, 17, 42, 99]}
ENGINE = dict(dtype="float32", device="cpu", num_kv_blocks=64)


def _ids(llm, **params):
    return llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, **params)
                        )[0].outputs[0].token_ids


def test_bias_steers_greedy_and_speculation_keeps_identity(tiny_llama_dir):
    llm = LLM(str(tiny_llama_dir), **ENGINE)
    plain = _ids(llm)
    assert _ids(llm, logit_bias={77: 100.0}) == [77] * 12
    banned = {t: -100.0 for t in set(plain)}
    steered = _ids(llm, logit_bias=banned)
    assert not set(steered) & set(plain)
    spec = LLM(str(tiny_llama_dir), speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                                        "adaptive": False}, **ENGINE)
    assert _ids(spec, logit_bias=banned) == steered  # drafts verified against the biased target
    assert _ids(spec) == plain


@pytest.mark.parametrize("bias, message", [
    ({5: 101.0}, "biases in \\[-100, 100\\]"),
    ({-1: 1.0}, "non-negative integers"),
    ({5: float("nan")}, "biases in"),
])
def test_bad_bias_is_refused(bias, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(logit_bias=bias)


def test_bias_outside_the_vocabulary_is_refused(tiny_llama_dir):
    llm = LLM(str(tiny_llama_dir), **ENGINE)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        _ids(llm, logit_bias={10_000: 1.0})
