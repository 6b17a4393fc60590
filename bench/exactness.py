"""Greedy exactness on the real default model: speculation, batching and prefix-cache hits, fp32 vs bf16.

    python bench/exactness.py --threads 1 --jobs 4 --hf bfloat16 --out bench/results/exactness_cpu.json

SmolLM2-135M-Instruct (the default model), held-out ShareGPT chat prompts (first human turns past the
slices the other benchmarks use), greedy, `--max-tokens` new tokens (stopping at EOS). Per dtype, each
comparison changes one thing against a reference run of the same prompts:

- ngram speculation on vs off, with the default adaptive k (what a user gets) batched and one at a
  time, and forced drafting (`"adaptive": false`, k drafts every step) batched;
- all prompts batched vs one at a time;
- prefix-cache hits: the same prompts again on the same engine vs the fresh engine's first run;
- (`--hf`) HF transformers `generate` (greedy, one prompt at a time) vs ours one at a time.

Per comparison: the fraction of prompts whose outputs are identical and the mean fraction of tokens
before the first difference (common prefix / the longer output). At each first difference the
reference's top-2 logprob gap is recorded: a flip is a near-tie when that gap is within rounding.
Work items run in `--jobs` spawned processes of `--threads` torch threads each; results go to the
JSON and a Markdown table next to it.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import platform
import subprocess
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from prompts import sharegpt_conversations  # noqa: E402

SKIP = 4000  # bench/serving.py reads the first 4000 conversations, the others fewer
NGRAM = {"method": "ngram", "num_speculative_tokens": 4}
# (comparison, run, reference run, what changes)
COMPARISONS = [
    ("ngram_default_batched", "ngram_batched", "batched", "ngram k=4, default adaptive k, all prompts at once"),
    ("ngram_default_single", "ngram_single", "single", "ngram k=4, default adaptive k, one prompt at a time"),
    ("ngram_forced_batched", "ngram_forced_batched", "batched", "ngram k=4, adaptive off (drafts every step)"),
    ("batched_vs_single", "batched", "single", "all prompts at once vs one at a time (no speculation)"),
    ("prefix_hit", "batched_again", "batched", "same prompts again on the same engine (prefix-cache hits)"),
    ("hf_vs_ours_single", "hf_single", "single", "HF transformers generate vs ours, one prompt at a time"),
]


def load_prompts(tokenizer, num: int, max_prompt_len: int) -> list[list[int]]:
    out = []
    for human, _ in sharegpt_conversations(limit=SKIP + 20 * num)[SKIP:]:
        text = tokenizer.apply_chat_template([{"role": "user", "content": human}], tokenize=False,
                                             add_generation_prompt=True)
        ids = tokenizer.encode(text, add_special_tokens=False)
        if len(ids) <= max_prompt_len:
            out.append(ids)
        if len(out) == num:
            return out
    raise RuntimeError(f"only {len(out)} prompts of <= {max_prompt_len} tokens")


def _spec_counts(stats: dict) -> dict:
    return {k: stats.get(k, 0) for k in ("spec_decode_num_drafts", "spec_decode_num_draft_tokens",
                                         "spec_decode_num_accepted_tokens", "prefix_cache_hits")}


def _run(llm, prompts: list[list[int]], single: bool, max_tokens: int) -> dict:
    """Greedy outputs of our engine, all prompts in one generate() call or one call each."""
    from specserve import SamplingParams
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=2)
    before = _spec_counts(llm.engine.stats())
    t0 = time.perf_counter()
    outs = [o for p in prompts for o in llm.generate([p], params)] if single else llm.generate(prompts, params)
    elapsed = time.perf_counter() - t0
    after = _spec_counts(llm.engine.stats())
    return {"token_ids": [o.outputs[0].token_ids for o in outs],
            "top2": [[sorted(d.values(), reverse=True)[:2] for d in (o.outputs[0].logprobs or [])] for o in outs],
            "num_cached_tokens": sum(o.num_cached_tokens for o in outs),
            "elapsed_s": round(elapsed, 1), **{k: after[k] - before[k] for k in after}}


# work item -> (engine arguments, [(run name, one prompt at a time)]); runs of one item share an engine
ITEMS = {
    "batched": ({}, [("batched", False), ("batched_again", False)]),
    "single": ({}, [("single", True)]),
    "ngram_batched": ({"speculative_config": NGRAM}, [("ngram_batched", False)]),
    "ngram_single": ({"speculative_config": NGRAM}, [("ngram_single", True)]),
    "ngram_forced_batched": ({"speculative_config": dict(NGRAM, adaptive=False)}, [("ngram_forced_batched", False)]),
}


def work(item: str, dtype: str, args: argparse.Namespace) -> dict:
    """One work item on a fresh engine in its own process: {run name: outputs}."""
    torch.set_num_threads(args.threads)
    if item == "hf":
        return {"hf_single": run_hf(dtype, args)}
    from specserve import LLM
    engine_args, runs = ITEMS[item]
    llm = LLM(dtype=dtype, device="cpu", threads=args.threads, max_model_len=2048, **engine_args)
    prompts = load_prompts(llm.tokenizer, args.num_prompts, args.max_prompt_len)
    out = {}
    for name, single in runs:
        out[name] = _run(llm, prompts, single, args.max_tokens)
        print(f"  {dtype} {name}: {out[name]['elapsed_s']} s", flush=True)
    return out


def run_hf(dtype: str, args: argparse.Namespace) -> dict:
    """HF transformers greedy generate on the same weights, one prompt at a time (no padding)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from specserve.models.default_model import ensure_default_model
    path = ensure_default_model()
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).eval()
    prompts = load_prompts(tokenizer, args.num_prompts, args.max_prompt_len)
    eos = tokenizer.eos_token_id
    out, t0 = [], time.perf_counter()
    with torch.inference_mode():
        for p in prompts:
            ids = model.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                                 max_new_tokens=args.max_tokens, do_sample=False, eos_token_id=eos,
                                 pad_token_id=eos)
            out.append(ids[0, len(p):].tolist())
    return {"token_ids": out, "top2": None, "elapsed_s": round(time.perf_counter() - t0, 1)}


def _strip_eos(ids: list[int], eos: int) -> list[int]:
    return ids[:-1] if ids and ids[-1] == eos else ids


def compare(run: dict, ref: dict, eos: int) -> dict:
    """Identical fraction, mean token fraction before the first difference, top-2 gaps at flips."""
    rows, gaps = [], []
    for i, (a, b) in enumerate(zip(run["token_ids"], ref["token_ids"])):
        a, b = _strip_eos(a, eos), _strip_eos(b, eos)
        n = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        frac = 1.0 if a == b else n / max(len(a), len(b), 1)
        gap = None
        if a != b and ref.get("top2") and n < len(ref["top2"][i]) and len(ref["top2"][i][n]) == 2:
            top = ref["top2"][i][n]
            gap = round(top[0] - top[1], 4)
            gaps.append(gap)
        rows.append({"identical": a == b, "first_diff": None if a == b else n, "prefix_fraction": round(frac, 4),
                     "ref_top2_gap_at_diff": gap})
    num = len(rows)
    return {"prompts": num, "identical": sum(r["identical"] for r in rows),
            "identical_fraction": round(sum(r["identical"] for r in rows) / num, 4),
            "mean_prefix_fraction": round(sum(r["prefix_fraction"] for r in rows) / num, 4),
            "median_top2_gap_at_diff": round(sorted(gaps)[len(gaps) // 2], 4) if gaps else None,
            "max_top2_gap_at_diff": max(gaps) if gaps else None, "rows": rows}


def machine() -> dict:
    info = open("/proc/cpuinfo").read() if Path("/proc/cpuinfo").exists() else ""
    model = next((ln.split(":", 1)[1].strip() for ln in info.splitlines() if ln.startswith("model name")), "?")
    flags = subprocess.run("grep -o 'avx512_bf16\\|amx' /proc/cpuinfo | sort -u", shell=True,
                           capture_output=True, text=True).stdout.split()
    import transformers
    return {"cpu": model, "avx512_bf16_or_amx": flags or "none", "logical_cpus": mp.cpu_count(),
            "torch": torch.__version__, "transformers": transformers.__version__, "python": platform.python_version()}


def write_markdown(res: dict, path: Path) -> None:
    m = res["machine"]
    lines = ["# Greedy exactness (CPU)", "", f"`{res['command']}`", "",
             f"Machine: {m['cpu']}, {m['logical_cpus']} logical CPUs, avx512_bf16/amx: {m['avx512_bf16_or_amx']}, "
             f"torch {m['torch']}, transformers {m['transformers']}. Model {res['model']}; {res['num_prompts']} "
             f"ShareGPT chat prompts (<= {res['max_prompt_len']} tokens), greedy, up to {res['max_tokens']} new "
             f"tokens. Wall time {res['wall_s']} s.", "",
             "| comparison | dtype | identical | mean prefix fraction | median / max top-2 gap at the first "
             "difference | drafts (accepted tokens) | prompt tokens from the prefix cache |",
             "|---|---|---|---|---|---|---|"]
    for name, run_name, _, what in COMPARISONS:
        for dtype, per in res["results"].items():
            c = per["comparisons"].get(name)
            if c is None:
                continue
            run = per["runs"][run_name]
            drafts = (f"{run['spec_decode_num_drafts']} ({run['spec_decode_num_accepted_tokens']})"
                      if "spec_decode_num_drafts" in run and name.startswith("ngram") else "")
            gap = (f"{c['median_top2_gap_at_diff']} / {c['max_top2_gap_at_diff']}"
                   if c["median_top2_gap_at_diff"] is not None else "")
            share = f"{c['identical']}/{c['prompts']} ({100 * c['identical_fraction']:.0f}%)"
            cached = run.get("num_cached_tokens", "")
            lines.append(f"| {name}: {what} | {dtype} | {share} | {c['mean_prefix_fraction']:.3f} | {gap} "
                         f"| {drafts} | {cached} |")
    times = [f"{dtype} {name} {run['elapsed_s']}" for dtype, per in res["results"].items()
             for name, run in per["runs"].items()]
    lines += ["", "Run wall times (s): " + "; ".join(times)]
    path.write_text("\n".join(lines) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--num-prompts", type=int, default=24)
    ap.add_argument("--max-prompt-len", type=int, default=96)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per worker process")
    ap.add_argument("--jobs", type=int, default=4, help="worker processes")
    ap.add_argument("--hf", nargs="*", default=[], help="dtypes to also run HF generate in")
    ap.add_argument("--out", default="bench/results/exactness_cpu.json")
    args = ap.parse_args()
    from transformers import AutoTokenizer

    from specserve.models.default_model import ensure_default_model
    eos = AutoTokenizer.from_pretrained(ensure_default_model()).eos_token_id
    items = [(item, d) for d in args.dtypes for item in ITEMS] + [("hf", d) for d in args.hf]
    # roughly longest first (bf16 costs ~4x fp32 on CPUs without native bf16), HF last
    cost = {"ngram_forced_batched": 3, "single": 2, "ngram_single": 2, "batched": 2, "ngram_batched": 1.5, "hf": 0}
    items.sort(key=lambda it: -cost[it[0]] * (4 if it[1] == "bfloat16" else 1))
    t0 = time.perf_counter()
    results: dict[str, dict] = {d: {"runs": {}} for d in dict.fromkeys(args.dtypes + args.hf)}
    with ProcessPoolExecutor(args.jobs, mp_context=mp.get_context("spawn")) as pool:
        futures = {pool.submit(work, item, d, args): (item, d) for item, d in items}
        for fut in as_completed(futures):
            item, d = futures[fut]
            results[d]["runs"].update(fut.result())
            print(f"done: {d} {item} at {time.perf_counter() - t0:.0f} s", flush=True)
            write_results(args, results, eos, time.perf_counter() - t0)  # up to date after every item


def write_results(args: argparse.Namespace, results: dict, eos: int, wall_s: float) -> None:
    """The comparisons whose runs are done so far -> the JSON (no raw token ids) and the Markdown."""
    from specserve.models.default_model import MODEL_NAME
    slim = {}
    for d, per in results.items():
        runs = per["runs"]
        comparisons = {name: compare(runs[a], runs[b], eos) for name, a, b, _ in COMPARISONS
                       if a in runs and b in runs}
        for name, c in comparisons.items():
            print(f"  {d:9s} {name:24s} identical {c['identical']}/{c['prompts']} "
                  f"prefix {c['mean_prefix_fraction']:.3f} gap med {c['median_top2_gap_at_diff']}", flush=True)
        slim[d] = {"runs": {name: {k: v for k, v in run.items() if k not in ("token_ids", "top2")}
                            for name, run in runs.items()}, "comparisons": comparisons}
    res = {"command": "python " + " ".join(sys.argv), "machine": machine(), "model": MODEL_NAME,
           "num_prompts": args.num_prompts, "max_prompt_len": args.max_prompt_len, "max_tokens": args.max_tokens,
           "speculative_config": NGRAM, "wall_s": round(wall_s, 1), "results": slim}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=1))
    write_markdown(res, out.with_suffix(".md"))

if __name__ == "__main__":
    main()
