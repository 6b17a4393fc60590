"""Greedy agreement of the triton and torch attention backends on a real model (bf16, GPU).

    python bench/gpu_agreement.py --model /path/SmolLM2-135M-Instruct.Q4_1.gguf --out r.json

Rule (bf16): per prompt, the fraction of output tokens generated before the first divergence; the
backends agree on a prompt when that fraction is >= 0.95 (bf16 reductions in a different order can flip
a near-tie, after which the texts legitimately differ). Answers are printed for a sanity read.
"""
from __future__ import annotations

import argparse
import gc
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

PROMPTS = [
    "What is the capital of France?", "Name three primary colors.", "Write a haiku about the sea.",
    "What is 12 times 12?", "Explain photosynthesis in one sentence.", "Who wrote Romeo and Juliet?",
    "Give me a synonym for 'happy'.", "What is the boiling point of water in Celsius?",
    "List the first five prime numbers.", "Translate 'good morning' into Spanish.",
    "What does a CPU do?", "Write a Python function that reverses a string.",
]


def generate(model: str, backend: str, max_tokens: int, eager: bool) -> list:
    from specserve import LLM, SamplingParams
    llm = LLM(model, dtype="bfloat16", device="cuda", attention_backend=backend, enforce_eager=eager,
              max_model_len=2048, gpu_memory_utilization=0.3)
    outs = llm.chat([[{"role": "user", "content": p}] for p in PROMPTS],
                    SamplingParams(temperature=0.0, max_tokens=max_tokens))
    result = [(o.outputs[0].token_ids, o.outputs[0].text) for o in outs]
    del llm, outs
    gc.collect()
    torch.cuda.empty_cache()
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    ref = generate(args.model, "torch", args.max_tokens, eager=True)
    tri = generate(args.model, "triton", args.max_tokens, eager=False)
    rows = []
    for prompt, (a_ids, a_text), (b_ids, b_text) in zip(PROMPTS, ref, tri):
        same = next((i for i, (x, y) in enumerate(zip(a_ids, b_ids)) if x != y), min(len(a_ids), len(b_ids)))
        frac = same / max(len(a_ids), 1) if a_ids != b_ids else 1.0
        rows.append({"prompt": prompt, "torch": a_text, "triton": b_text, "identical": a_ids == b_ids,
                     "prefix_fraction": frac, "agree": frac >= 0.95})
        print(f"[{'=' if a_ids == b_ids else '~'} {frac:.2f}] {prompt}\n  torch : {a_text!r}\n  triton: {b_text!r}")
    res = {"model": args.model, "gpu": torch.cuda.get_device_name(), "rows": rows,
           "identical": sum(r["identical"] for r in rows), "agree": sum(r["agree"] for r in rows),
           "prompts": len(rows), "mean_prefix_fraction": sum(r["prefix_fraction"] for r in rows) / len(rows)}
    Path(args.out).write_text(json.dumps(res, indent=2))
    print(json.dumps({k: v for k, v in res.items() if k != "rows"}))


if __name__ == "__main__":
    main()
