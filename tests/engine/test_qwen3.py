"""Qwen3 (per-head q/k RMSNorm before RoPE, explicit head_dim): greedy output equals HF transformers'
token for token in fp32, with prefill chunked into 16-token steps."""
from __future__ import annotations

import torch

from specserve import LLM, SamplingParams
from tests.conftest import build_tiny_model


def test_qwen3_greedy_matches_transformers(tmp_path):
    from transformers import AutoModelForCausalLM

    path = build_tiny_model("qwen3", tmp_path / "qwen3")
    prompts = [[5, 17, 42, 99, 7, 3], [5, 17, 42, 99, 7, 3, 250, 11], list(range(20, 60))]
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    expected = []
    for p in prompts:
        with torch.no_grad():
            out = hf.generate(torch.tensor([p]), max_new_tokens=12, min_new_tokens=12, do_sample=False,
                              pad_token_id=0)
        expected.append(out[0, len(p):].tolist())
    llm = LLM(str(path), dtype="float32", device="cpu", num_kv_blocks=64, max_num_batched_tokens=16)
    assert llm.engine.loaded.arch.qk_norm and llm.engine.loaded.arch.head_dim == 32
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == expected
