"""What admitting prompts into a decoding batch costs: the time of a step that decodes D requests and
prefills n new prompts of P tokens beside them, against a step that only decodes them.

    python bench/admission_steps.py --model llama-3.1-8b --load-format dummy --device cuda \
        --decoding 64 --admit 1 2 3 4 8 --out r.json [--kernels 3]

Under a server's load, requests end at different steps and new ones are admitted a few at a time, so
these mixed steps are frequent (with speculation, which staggers request ends, at every turnover of a
batch). Each step is timed with the device synchronised after it (async scheduling off, so a step's
time is its own); the median of `--repeats` admissions of each size (the admitted requests are aborted
after their prefill, so the batch stays at D). `--speculative-config JSON` decodes with
speculation (its drafting steps then are the "decode" row). `--kernels N` also prints the device kernels of an
admission of N prompts (torch.profiler), by total time.
"""
from __future__ import annotations

import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch

from specserve import LLM, SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parent))
from timing import engine_parser  # noqa: E402


def timed_step(engine, sync) -> float:
    t0 = time.perf_counter()
    engine.step_updates()
    sync()
    return time.perf_counter() - t0


def main() -> None:
    ap = engine_parser(__doc__)
    ap.add_argument("--decoding", type=int, default=64, help="requests decoding in every step")
    ap.add_argument("--admit", type=int, nargs="+", default=[1, 2, 3, 4, 8], help="prompts admitted in one step")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--kernels", type=int, default=0, help="print the device kernels of an admission of N prompts")
    ap.add_argument("--speculative-config", default=None,
                    help="JSON: decode with speculation (e.g. a dummy EAGLE head with simulated acceptance)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    llm = LLM(args.model, load_format=args.load_format, device=args.device, dtype=args.dtype,
              max_num_seqs=max(256, args.decoding + max(args.admit)), enable_prefix_caching=False,
              enforce_eager=args.enforce_eager, async_scheduling=False,
              speculative_config=json.loads(args.speculative_config) if args.speculative_config else None,
              **({"gpu_memory_utilization": 0.85} if args.device == "cuda" else {}))
    engine = llm.engine
    sync = (lambda: torch.cuda.synchronize()) if args.device == "cuda" else (lambda: None)
    vocab = engine.loaded.arch.vocab_size
    rng = random.Random(0)

    def prompt():
        return {"prompt_token_ids": [rng.randrange(10, vocab - 10) for _ in range(args.prompt_len)]}

    forever = SamplingParams(temperature=0.0, max_tokens=100_000, ignore_eos=True)
    for i in range(args.decoding):
        engine.add_request(f"d{i}", prompt(), forever)
    while len(engine.scheduler.running) < args.decoding or any(
            r.num_output_tokens == 0 for r in engine.scheduler.running):
        engine.step_updates()
    for _ in range(5):
        timed_step(engine, sync)
    serial = [0]

    def admission(n: int) -> float:
        ids = []
        for _ in range(n):
            serial[0] += 1
            ids.append(f"a{serial[0]}")
            engine.add_request(ids[-1], prompt(), forever)
        took = timed_step(engine, sync)
        for rid in ids:
            engine.abort(rid)
        timed_step(engine, sync)  # the aborts' step
        return took

    results = {"decode": [timed_step(engine, sync) for _ in range(args.repeats)]}
    for n in args.admit:
        admission(n)  # a first one of this size (a kernel variant, a graph's first replay)
        results[f"admit {n}"] = [admission(n) for _ in range(args.repeats)]
    rows = []
    plain = statistics.median(results["decode"])
    for key, times in results.items():
        n = int(key.split()[1]) if key != "decode" else 0
        med = statistics.median(times)
        rows.append({"step": key, "tokens": args.decoding + n * args.prompt_len, "median_ms": round(med * 1e3, 3),
                     "min_ms": round(min(times) * 1e3, 3), "plain_steps": round(med / plain, 2),
                     "ms_per_prompt_token": round((med - plain) * 1e3 / (n * args.prompt_len), 4) if n else None})
        print(json.dumps(rows[-1]), flush=True)
    if args.kernels and args.device == "cuda":
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
            admission(args.kernels)
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=30), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({
            "command": " ".join([Path(sys.executable).name] + sys.argv), "model": args.model,
            "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu", "rows": rows,
            "times_s": results}, indent=2))


if __name__ == "__main__":
    main()
