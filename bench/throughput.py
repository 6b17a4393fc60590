"""Offline throughput: specserve vs HF transformers `generate`, same model, same requests, one run.

Workload: prompt and output lengths from ShareGPT conversations (first human turn -> prompt text,
the reply's token count -> forced output length with ignore_eos), capped by --max-prompt/--max-output.
specserve gets all requests at once with max_num_seqs = concurrency (continuous batching); HF runs
them in arrival order in left-padded batches of `concurrency`, each batch until its longest output,
which is how users batch with it. Output tokens/s counts the requested output tokens only.

    python bench/throughput.py --concurrency 1 8 32 --out bench/results/throughput_cpu.json
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from prompts import sharegpt_conversations  # noqa: E402

from specserve import LLM, SamplingParams  # noqa: E402


def build_workload(tokenizer, num: int, max_prompt: int, max_output: int, skip: int = 0
                   ) -> list[tuple[list[int], int]]:
    reqs = []
    for human, reply in sharegpt_conversations(limit=skip + 4 * num)[skip:]:
        prompt = tokenizer.encode(human)[:max_prompt]
        out_len = min(len(tokenizer.encode(reply)), max_output)
        if len(prompt) >= 4 and out_len >= 4:
            reqs.append((prompt, out_len))
        if len(reqs) == num:
            break
    return reqs


def run_specserve(llm: LLM, reqs, concurrency: int) -> float:
    llm.engine.config.scheduler.max_num_seqs = concurrency
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for _, n in reqs]
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p, _ in reqs], params)
    elapsed = time.perf_counter() - t0
    assert [len(o.outputs[0].token_ids) for o in outs] == [n for _, n in reqs]
    return elapsed


def run_hf(model, reqs, concurrency: int, pad_id: int, device: str) -> float:
    t0 = time.perf_counter()
    for i in range(0, len(reqs), concurrency):
        batch = reqs[i:i + concurrency]
        width = max(len(p) for p, _ in batch)
        ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for j, (p, _) in enumerate(batch):  # left padding
            ids[j, width - len(p):] = torch.tensor(p)
            mask[j, width - len(p):] = 1
        longest = max(n for _, n in batch)
        with torch.inference_mode():
            model.generate(ids.to(device), attention_mask=mask.to(device), max_new_tokens=longest,
                           min_new_tokens=longest, do_sample=False, pad_token_id=pad_id)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="HF model dir (default: the default model)")
    ap.add_argument("--dtype", default="auto", help="auto: fp32 on CPUs without native bf16, else bf16")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--requests-per-level", type=int, nargs="+", default=None,
                    help="requests per concurrency level (default: 4, or 2x the concurrency)")
    ap.add_argument("--max-prompt", type=int, default=256)
    ap.add_argument("--max-output", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=1, help="runs per level; the median is reported")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", default="bench/results/throughput_cpu.json")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    llm = LLM(args.model, dtype=args.dtype, device=args.device, max_num_batched_tokens=2048)
    from transformers import AutoModelForCausalLM
    dtype = llm.engine.loaded.dtype  # the peer runs in the dtype the engine resolved
    hf = AutoModelForCausalLM.from_pretrained(llm.engine.model_name, dtype=dtype).to(
        args.device).eval()
    tok = llm.tokenizer
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id

    rows = []
    for li, conc in enumerate(args.concurrency):
        num = (args.requests_per_level[li] if args.requests_per_level else max(4, 2 * conc))
        reqs = build_workload(tok, num, args.max_prompt, args.max_output)
        out_tokens = sum(n for _, n in reqs)
        run_specserve(llm, reqs[:2], conc)  # warm-up
        ours, theirs = [], []
        for _ in range(args.repeats):
            ours.append(out_tokens / run_specserve(llm, reqs, conc))
            theirs.append(out_tokens / run_hf(hf, reqs, conc, pad_id, args.device))
        row = {"concurrency": conc, "requests": len(reqs), "output_tokens": out_tokens,
               "mean_prompt_len": statistics.mean(len(p) for p, _ in reqs),
               "specserve_tok_s": statistics.median(ours), "hf_tok_s": statistics.median(theirs),
               "specserve_runs": ours, "hf_runs": theirs}
        row["ratio"] = row["specserve_tok_s"] / row["hf_tok_s"]
        rows.append(row)
        print(f"concurrency {conc:3d}: specserve {row['specserve_tok_s']:8.1f} tok/s | "
              f"HF generate {row['hf_tok_s']:8.1f} tok/s | ratio {row['ratio']:.2f}x", flush=True)

    result = {"bench": "throughput", "model": llm.engine.model_name, "dtype": str(dtype),
              "device": args.device, "torch": torch.__version__, "threads": torch.get_num_threads(),
              "cpu": platform.processor() or platform.machine(), "max_prompt": args.max_prompt,
              "max_output": args.max_output, "rows": rows, "command": " ".join(sys.argv)}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print("\n| concurrency | requests | output tokens | specserve tok/s | HF generate tok/s | ratio |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['concurrency']} | {r['requests']} | {r['output_tokens']} | {r['specserve_tok_s']:.1f} | "
              f"{r['hf_tok_s']:.1f} | {r['ratio']:.2f}x |")


if __name__ == "__main__":
    main()
