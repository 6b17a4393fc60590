"""Speculative decoding: output tokens/s and mean acceptance length, with and without speculation,
at several concurrency levels, in one run, same engine settings and same prompts.

CPU (default): the default model (SmolLM2-135M-Instruct, bf16) with n-gram drafts on HumanEval
(the model is asked to complete the function: chat template) and ShareGPT (first human turn),
greedy, natural stops capped at --max-tokens:

    python bench/spec_decode.py --out bench/results/spec_decode_cpu

GPU: dummy weights of real shapes (configs/models/) where acceptance is meaningless, so it is
controlled: draft = target weights (the top of the range) and the Llama-3.2-1B-shaped draft with the
BENCHMARK-ONLY simulated-acceptance switch; random prompts, ignore_eos:

    python bench/spec_decode.py --device cuda --load-format dummy --model llama-3.1-8b \
        --draft-model llama-3.2-1b --max-tokens 256 --prompt-len 128 --out bench/results/spec_decode_gpu

Concurrency c = c requests in flight (closed loop: a finished request is replaced by the next);
each level uses its own prompts (no prefix-cache reuse across levels). Output tokens/s counts
generated tokens over the wall time of the level.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from prompts import humaneval_prompts, sharegpt_conversations  # noqa: E402

from specserve import LLM, SamplingParams  # noqa: E402

HUMANEVAL_INSTRUCTION = "Complete the following Python function. Reply with the whole function in a code block.\n\n"


def requests_per_level(c: int, base: int) -> int:
    return max(base, c) if c < 16 else c


def load_prompts(args, tokenizer) -> dict[str, list[list[int]]]:
    """Prompt token ids per dataset, enough for every level (disjoint slices per level)."""
    need = sum(requests_per_level(c, args.min_requests) for c in args.concurrency)
    if args.load_format == "dummy":  # no tokenizer: random ids, fixed length
        rng = random.Random(0)
        return {"random": [[rng.randrange(10, 32000) for _ in range(args.prompt_len)] for _ in range(need)]}
    chat = lambda text: tokenizer.apply_chat_template(  # noqa: E731
        [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True)
    out = {}
    if "humaneval" in args.datasets:
        texts = humaneval_prompts()[:need]
        out["humaneval"] = [tokenizer.encode(chat(HUMANEVAL_INSTRUCTION + t), add_special_tokens=False)
                            for t in texts]
    if "sharegpt" in args.datasets:
        texts = [h for h, _ in sharegpt_conversations(limit=4 * need)]
        ids = [tokenizer.encode(chat(t), add_special_tokens=False) for t in texts]
        out["sharegpt"] = [p for p in ids if len(p) <= args.max_prompt_len][:need]
    return out


def run_level(llm: LLM, prompts: list[list[int]], concurrency: int, params: SamplingParams) -> dict:
    """Closed loop with `concurrency` requests in flight; returns throughput and spec counters."""
    engine = llm.engine
    before = engine.stats()
    pending = list(enumerate(prompts))
    num_out, steps = 0, 0
    t0 = time.perf_counter()
    in_flight = 0
    while pending or engine.has_unfinished():
        while pending and in_flight < concurrency:
            i, p = pending.pop(0)
            engine.add_request(f"b{id(prompts)}-{concurrency}-{i}", {"prompt_token_ids": p}, params)
            in_flight += 1
        for out in engine.step():
            if out.finished:
                in_flight -= 1
                num_out += len(out.outputs[0].token_ids)
        steps += 1
    elapsed = time.perf_counter() - t0
    after = engine.stats()
    drafts = after["spec_decode_num_drafts"] - before["spec_decode_num_drafts"]
    draft_tokens = after["spec_decode_num_draft_tokens"] - before["spec_decode_num_draft_tokens"]
    accepted = after["spec_decode_num_accepted_tokens"] - before["spec_decode_num_accepted_tokens"]
    assert after["num_used_blocks"] == 0
    return {
        "requests": len(prompts), "output_tokens": num_out, "elapsed_s": round(elapsed, 3),
        "tokens_per_s": round(num_out / elapsed, 2), "steps": steps,
        "tokens_per_step": round(num_out / steps, 3),
        "num_drafts": drafts, "num_draft_tokens": draft_tokens, "num_accepted_tokens": accepted,
        "mean_acceptance_length": round(1 + accepted / drafts, 3) if drafts else None,
        "acceptance_rate": round(accepted / draft_tokens, 3) if draft_tokens else None,
    }


def configs(args) -> list[tuple[str, dict | None]]:
    """(name, speculative_config): the baseline first."""
    k = args.num_speculative_tokens
    base = dict(num_speculative_tokens=k, adaptive=not args.no_adaptive)
    if args.device == "cpu" or not args.draft_model:
        out = [("none", None), ("ngram", dict(base, method="ngram"))]
        if args.draft_model:
            out.append(("draft", dict(base, method="draft_model", model=args.draft_model,
                                      load_format=args.load_format)))
        return out
    draft = dict(base, method="draft_model", load_format="dummy")
    out = [("none", None), ("draft=target", dict(draft, model=args.model))]
    out += [(f"draft sim {a}", dict(draft, model=args.draft_model, simulated_acceptance=a))
            for a in args.simulated_acceptance]
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct")
    ap.add_argument("--draft-model", default=None)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--load-format", default="auto")
    ap.add_argument("--datasets", nargs="+", default=["humaneval", "sharegpt"])
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16, 64])
    ap.add_argument("--min-requests", type=int, default=4, help="requests per level below c=16")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--prompt-len", type=int, default=128, help="dummy weights: random prompt length")
    ap.add_argument("--max-prompt-len", type=int, default=384)
    ap.add_argument("--num-speculative-tokens", type=int, default=4)
    ap.add_argument("--no-adaptive", action="store_true")
    ap.add_argument("--simulated-acceptance", type=float, nargs="+", default=[0.6, 0.8])
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", default=None, help="path without suffix: writes .json and .md")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    engine_args = dict(dtype=args.dtype, device=args.device, load_format=args.load_format,
                       max_num_seqs=max(args.concurrency), max_model_len=args.max_prompt_len + args.max_tokens + 64
                       if args.load_format != "dummy" else args.prompt_len + args.max_tokens + 64)
    dummy = args.load_format == "dummy"
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=dummy)
    results = {"command": " ".join([Path(sys.executable).name] + sys.argv), "device": args.device,
               "platform": platform.processor() or platform.machine(), "torch_threads": torch.get_num_threads(),
               "load_avg_start": os.getloadavg(), "model": args.model or "SmolLM2-135M-Instruct",
               "dtype": args.dtype, "max_tokens": args.max_tokens, "k": args.num_speculative_tokens,
               "adaptive": not args.no_adaptive, "levels": []}
    # CPU: every engine alive, each level measured back to back (fair under a varying machine load);
    # GPU: one engine at a time (memory), all levels each.
    interleave = args.device == "cpu"
    names = [name for name, _ in configs(args)]
    llms: dict[str, LLM] = {}
    rows: dict[tuple[str, int], dict] = {}
    prompts = None
    for group in ([configs(args)] if interleave else [[c] for c in configs(args)]):
        for name, spec in group:
            llms[name] = LLM(args.model, speculative_config=spec, **engine_args)
            llms[name].generate({"prompt_token_ids": [5, 6, 7, 8]}, SamplingParams(max_tokens=4))  # warm up
        prompts = prompts or load_prompts(args, next(iter(llms.values())).tokenizer)
        for dataset, ids in prompts.items():
            offset = 0
            for c in args.concurrency:
                n = requests_per_level(c, args.min_requests)
                level_prompts, offset = ids[offset:offset + n], offset + n
                row = rows.setdefault((dataset, c), {"dataset": dataset, "concurrency": c})
                for name, llm in llms.items():
                    row[name] = run_level(llm, level_prompts, c, params)
                    print(f"{dataset:9s} c={c:3d} {name:14s} {row[name]['tokens_per_s']:8.2f} tok/s  "
                          f"mean acceptance length {row[name]['mean_acceptance_length']}", flush=True)
        if not interleave:
            llms.clear()
            torch.cuda.empty_cache()
    for row in rows.values():
        for name in names[1:]:
            row[name]["speedup"] = round(row[name]["tokens_per_s"] / row["none"]["tokens_per_s"], 3)
        results["levels"].append(row)
    results["load_avg_end"] = os.getloadavg()
    table = markdown(results, names)
    print(table)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out + ".json").write_text(json.dumps(results, indent=2))
        Path(args.out + ".md").write_text(table)
    return 0


def markdown(results: dict, names: list[str]) -> str:
    lines = [f"Command: `{results['command']}`", "",
             f"Model {results['model']} ({results['dtype']}, {results['device']}, {results['torch_threads']} torch "
             f"threads), greedy, max {results['max_tokens']} output tokens, k <= {results['k']}"
             f"{' (adaptive)' if results['adaptive'] else ''}. Load average at start/end: "
             f"{results['load_avg_start'][0]:.1f} / {results['load_avg_end'][0]:.1f}.", ""]
    head = "| dataset | conc. | reqs | " + " | ".join(
        f"{n} tok/s" + ("" if n == "none" else f" | {n} speedup | {n} mean acc. len") for n in names) + " |"
    lines += [head, "|" + "---|" * (head.count("|") - 1)]
    for row in results["levels"]:
        cells = [row["dataset"], str(row["concurrency"]), str(row["none"]["requests"])]
        for n in names:
            r = row[n]
            cells.append(f"{r['tokens_per_s']:.1f}")
            if n != "none":
                cells += [f"{r['speedup']:.2f}x", str(r["mean_acceptance_length"] or "-")]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
