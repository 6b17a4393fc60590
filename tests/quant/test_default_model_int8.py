"""int8 on the real default model (SmolLM2-135M-Instruct) keeps its answers, compared with bf16:

- fact agreement: for 12 simple questions, the greedy answer states the key fact (Paris, 100, ...)
  exactly when bf16's answer does;
- first sentence: the greedy answer's first sentence is identical;
- teacher-forced top-1: the next-token choice along bf16's own answers.

Measured here (2026-11-30, AVX2 CPU; docs/quantization.md): int8 11/12 facts, 6/12 first
sentences, 88.9% top-1; for scale, unquantized fp32 vs bf16 gives 10/12 first sentences and 97.4%.
Whole 24-token answers agree less often (3/12): on a 135M model one flipped token sends greedy
decoding elsewhere, and bitsandbytes int8 through transformers diverges from bf16 just as often on
this model. The thresholds leave margin for other CPUs' kernels.
"""
from __future__ import annotations

import re

import pytest
import torch

from specserve import LLM, SamplingParams

FACTS = {  # prompt -> the key fact of a right answer
    "What is the capital of France?": "Paris", "Name three primary colors.": "red", "What is 2 + 2?": "4",
    "Who wrote Romeo and Juliet?": "Shakespeare", "What is the boiling point of water in Celsius?": "100",
    "How many days are in a week?": "7", "What color is the sky on a clear day?": "blue",
    "What is the largest planet in the solar system?": "Jupiter", "Write a haiku about the sea.": "sea",
    "What does a bee make?": "honey", "What is the opposite of hot?": "cold",
    "How many legs does a spider have?": "8",
}
PROMPTS = list(FACTS)
MAX_TOKENS = 24
MIN_FACT_AGREEMENT = 9  # of 12 (measured 11)
MIN_SENTENCE_AGREEMENT = 4  # of 12 (measured 6)
MIN_TOP1_AGREEMENT = 0.85  # (measured 0.889)


def states(text: str, fact: str) -> bool:
    return re.search(rf"\b{re.escape(fact)}\b", text, re.IGNORECASE) is not None


def first_sentence(text: str) -> str:
    m = re.search(r"[.!?\n]", text.strip())
    return text.strip() if m is None else text.strip()[:m.end()]


def chat_answers(llm: LLM) -> tuple[list[list[int]], list[str], list[list[int]]]:
    outs = llm.chat([[{"role": "user", "content": p}] for p in PROMPTS],
                    SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS))
    return [o.prompt_token_ids for o in outs], [o.outputs[0].text for o in outs], \
        [o.outputs[0].token_ids for o in outs]


@torch.inference_mode()
def teacher_forced_argmax(llm: LLM, prompt_ids: list[int], continuation: list[int]) -> list[int]:
    """The model's argmax at every position of prompt + continuation, in one forward (the
    continuation rides along as 'drafts', so the runner returns logits for each of its positions)."""
    from specserve.engine.step_inputs import build_step_inputs
    from specserve.engine.outputs import ScheduledRequest
    from specserve.engine.request import Request

    runner = llm.engine.runner
    req = Request("teacher-forced", list(prompt_ids), SamplingParams(max_tokens=1), frozenset())
    num = len(prompt_ids) + len(continuation)
    blocks = list(range(-(-num // runner.block_size)))
    sched = ScheduledRequest(req, 0, num, list(continuation), blocks, True)
    inputs = build_step_inputs([sched], runner.block_size, runner.device)
    hidden = runner.target.forward(inputs.input_ids, inputs.positions, inputs.meta)
    return runner.target.compute_logits(hidden[inputs.logits_indices]).argmax(-1).tolist()[:-1]


def agreement(base: LLM, other: LLM) -> dict:
    """fact / first-sentence agreement (counts of len(PROMPTS)) and teacher-forced top-1 rate."""
    prompts, base_text, base_ids = chat_answers(base)
    _, other_text, _ = chat_answers(other)
    pairs = list(zip(base_text, other_text))
    facts = sum(states(a, f) == states(b, f) for (a, b), f in zip(pairs, FACTS.values()))
    sentences = sum(first_sentence(a) == first_sentence(b) for a, b in pairs)
    hits = total = 0
    for prompt, cont in zip(prompts, base_ids):
        got = teacher_forced_argmax(other, prompt, cont)
        hits += sum(g == c for g, c in zip(got, cont))
        total += len(cont)
    return {"facts": facts, "first_sentence": sentences, "identical": sum(a == b for a, b in pairs),
            "top1": hits / total, "pairs": pairs}


@pytest.fixture(scope="module")
def bf16(default_model_dir):
    return LLM(str(default_model_dir), dtype="bfloat16", device="cpu", num_kv_blocks=64)


def test_int8_keeps_default_model_answers(default_model_dir, bf16):
    int8 = LLM(str(default_model_dir), dtype="bfloat16", device="cpu", num_kv_blocks=64,
               quantization="bitsandbytes-int8")
    assert int8.engine.weight_bytes < 0.65 * bf16.engine.weight_bytes
    got = agreement(bf16, int8)
    detail = "\n".join(f"  bf16: {a!r}\n  int8: {b!r}" for a, b in got["pairs"])
    assert got["facts"] >= MIN_FACT_AGREEMENT, f"{got['facts']}/{len(PROMPTS)} facts agree:\n{detail}"
    assert got["first_sentence"] >= MIN_SENTENCE_AGREEMENT, f"first sentences:\n{detail}"
    assert got["top1"] >= MIN_TOP1_AGREEMENT, f"teacher-forced top-1 agreement {got['top1']:.3f}"


def test_nf4_on_the_q4_default_model_warns(default_model_dir, caplog):
    from specserve.quant.checkpoint import warn_if_requantizing

    with caplog.at_level("WARNING", logger="specserve.quant.checkpoint"):
        warn_if_requantizing(default_model_dir, "bitsandbytes-nf4")
    assert "Q4_1" in caplog.text and "poor quality" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="specserve.quant.checkpoint"):
        warn_if_requantizing(default_model_dir, "bitsandbytes-int8")
    assert caplog.text == ""
