"""What quantizing an EAGLE head's weights costs in acceptance: the shipped head on the default model
(CPU, fp32, k forced, greedy), its weights rounded in place to a narrower format and back (the
numbers a kernel over that format would compute with), on held-out ShareGPT prompts and HumanEval.

Formats: `int8` (one scale per output row: quant/int8_rows.py, what `"quantization": "int8"` serves),
`int4-gG` (symmetric, round to nearest, one scale per G consecutive weights of a row), `int4-row` (one
scale per row). A suffix `:layers` or `:lm` rounds only the decoder layer's and fc's weights, or only
the draft LM head's rows. The bytes a drafting step reads set its time where the head's weights are
large (8B shapes, one request: BENCHMARKS.md); this says what a narrower format gives back first.

    python bench/head_quant_acceptance.py --formats fp32 int8 int4-g64 int4-g64:layers --prompts 16
    python bench/head_quant_acceptance.py --head DIR --formats fp32 --prompts 64   # another head's acceptance
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("SPECSERVE_CPU_LINEAR", "torch")  # packed copies would keep the unrounded weights

from spec_decode import load_prompts, run_level  # noqa: E402

from specserve import LLM, SamplingParams  # noqa: E402
from specserve.quant.int8_rows import quantize_int8_rows  # noqa: E402

SHIPPED_HEAD = Path(__file__).resolve().parents[1] / "specserve/spec_decode/heads/SmolLM2-135M-Instruct"


def rounded(weight: torch.Tensor, fmt: str) -> torch.Tensor:
    """`weight` [N, K] quantized to `fmt` and widened back to its dtype."""
    if fmt == "int8":
        q, scale = quantize_int8_rows(weight)
        return (q.float() * scale[:, None]).to(weight.dtype)
    if not fmt.startswith("int4-"):
        raise ValueError(f"unknown format {fmt!r}")
    n, k = weight.shape
    group = k if fmt == "int4-row" else int(fmt.removeprefix("int4-g"))
    if k % group:
        raise ValueError(f"{fmt}: a row of {k} weights is not a whole number of groups of {group}")
    w = weight.float().reshape(n, k // group, group)
    scale = (w.abs().amax(-1, keepdim=True) / 7).clamp_min(1e-12)
    return ((w / scale).round().clamp(-8, 7) * scale).reshape(n, k).to(weight.dtype)


@torch.no_grad()
def round_head(head: nn.Module, spec: str) -> int:
    """Rounds the head's weights in place as `spec` says (FORMAT[:layers|:lm]); returns how many tensors."""
    fmt, _, part = spec.partition(":")
    tensors = []
    if part in ("", "layers"):  # `fuse` stays: the target's forward runs it (as with int8)
        tensors += [m.weight for name, m in head.named_modules()
                    if type(m) is nn.Linear and not name.startswith("fuse")]
    if part in ("", "lm"):
        tensors.append(head._lm_head)
    for t in tensors:
        t.copy_(rounded(t, fmt))
    return len(tensors)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--formats", nargs="+", default=["fp32", "int8", "int4-g64", "int4-g64:layers", "int4-g64:lm"])
    ap.add_argument("--head", default=str(SHIPPED_HEAD), help="the head directory (default: the shipped head)")
    ap.add_argument("--prompts", type=int, default=16, help="per dataset")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--skip", type=int, default=8000,
                    help="the first ShareGPT record to read (the head trained before it)")
    ap.add_argument("--out", default=None, help="a .json path")
    args = ap.parse_args()
    # bench/spec_decode.py's prompt sets (its chat template, HumanEval's instruction), prompts of up to 512 tokens
    sets_args = argparse.Namespace(concurrency=[1], min_requests=args.prompts, waves=1, load_format="auto",
                                   datasets=["sharegpt", "humaneval"], sharegpt_skip=args.skip, max_prompt_len=512)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    rows, sets = [], None
    for spec in args.formats:
        llm = LLM(None, dtype="float32", device="cpu", speculative_config=dict(
            method="eagle", model=args.head, num_speculative_tokens=args.k, adaptive=False))
        head = llm.engine.runner.proposer.head
        if head._lm_head is None:
            raise SystemExit("the head's LM head rows are not a plain tensor here (packed or int8)")
        count = 0 if spec == "fp32" else round_head(head, spec)
        sets = sets or load_prompts(sets_args, llm.engine.tokenizer)
        for name in ("sharegpt", "humaneval"):
            run = run_level(llm, sets[name], len(sets[name]), params)  # all in flight at once
            row = {"format": spec, "tensors_rounded": count, "dataset": name, "prompts": len(sets[name]),
                   "drafts": run["num_drafts"], "mean_acceptance_length": run["mean_acceptance_length"]}
            rows.append(row)
            print(json.dumps(row), flush=True)
        del llm
    base = {r["dataset"]: r["mean_acceptance_length"] for r in rows if r["format"] == args.formats[0]}
    print("\n| format | " + " | ".join(base) + " |\n|---|" + "---|" * len(base))
    for spec in args.formats:
        cells = [f"{r['mean_acceptance_length']} ({r['mean_acceptance_length'] / base[r['dataset']]:.3f}x)"
                 for r in rows if r["format"] == spec]
        print(f"| {spec} | " + " | ".join(cells) + " |")
    if args.out:
        Path(args.out).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
