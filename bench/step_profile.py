"""Where a step's time goes: host phases (schedule, input building, sampling, bookkeeping) vs the
forward, per step, for a decode-heavy workload.

    python bench/step_profile.py --model llama-3.1-8b --load-format dummy --device cuda \
        --requests 1 256 --out r.json                      # GPU: 8B shape, batch 1 and 256
    python bench/step_profile.py --model /path/to/tiny-model --device cpu --requests 256

Each phase is wrapped with a timer. With `--sync` (a second pass on CUDA) the device is synchronised
after the forward, so "forward" is its GPU time and the other phases are pure host time; without it,
the forward is only launched and the wait for its result lands in "sample" or, with async scheduling,
in "collect" (which then overlaps the next step's host work). Times are
per step, averaged over the decode steps of one `generate` call (prefill steps included: they are
few next to `--new-tokens` decode steps).
"""
from __future__ import annotations

import argparse
import collections
import json
import random
import sys
import time
from pathlib import Path

import torch

from specserve import LLM, SamplingParams
from specserve.engine import model_runner

sys.path.insert(0, str(Path(__file__).resolve().parent))
from timing import engine_parser  # noqa: E402


def timed(counter: collections.Counter, key: str, fn, sync: torch.device | None = None):
    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        result = fn(*args, **kwargs)
        if sync is not None:
            torch.cuda.synchronize(sync)
        counter[key] += time.perf_counter() - t0
        return result
    return wrapper


def profile(llm: LLM, requests: int, prompt_len: int, new_tokens: int, sync: bool) -> dict:
    engine, runner = llm.engine, llm.engine.runner
    device = runner.device if sync and runner.device.type == "cuda" else None
    times: collections.Counter = collections.Counter()
    saved = (engine.step, engine.scheduler.schedule, engine.scheduler.resolve, runner.target.forward, runner._sample,
             runner._sample_deferred, runner.collect, model_runner.build_step_inputs)
    engine.step = timed(times, "step", engine.step)
    engine.scheduler.schedule = timed(times, "schedule", engine.scheduler.schedule)
    engine.scheduler.resolve = timed(times, "update", engine.scheduler.resolve)
    runner.target.forward = timed(times, "forward", runner.target.forward, device)
    runner._sample = timed(times, "sample", runner._sample)
    runner._sample_deferred = timed(times, "sample", runner._sample_deferred)
    runner.collect = timed(times, "collect", runner.collect)
    model_runner.build_step_inputs = timed(times, "build_inputs", model_runner.build_step_inputs)
    try:
        vocab = engine.loaded.arch.vocab_size
        rng = random.Random(requests)
        batch = [{"prompt_token_ids": [rng.randrange(10, vocab - 10) for _ in range(prompt_len)]}
                 for _ in range(requests)]
        params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
        steps = [0]
        step = engine.step

        def counting_step(*a, **k):
            steps[0] += 1
            return step(*a, **k)
        engine.step = counting_step
        t0 = time.perf_counter()
        llm.generate(batch, params)
        elapsed = time.perf_counter() - t0
    finally:
        (engine.step, engine.scheduler.schedule, engine.scheduler.resolve, runner.target.forward, runner._sample,
         runner._sample_deferred, runner.collect, model_runner.build_step_inputs) = saved
    n = steps[0]
    phases = {k: round(v / n * 1e3, 3) for k, v in times.most_common()}
    phases["other"] = round(phases["step"] - sum(phases.get(k, 0.0) for k in (
        "schedule", "update", "forward", "sample", "collect", "build_inputs")), 3)
    return {"requests": requests, "sync": sync, "steps": n, "elapsed_s": round(elapsed, 3),
            "tokens_per_s": round(requests * new_tokens / elapsed, 1), "ms_per_step": phases}


def main() -> None:
    ap = engine_parser(__doc__)
    ap.add_argument("--requests", type=int, nargs="+", default=[1, 256])
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    llm = LLM(args.model, load_format=args.load_format, device=args.device, dtype=args.dtype,
              max_num_seqs=max(args.requests), max_model_len=args.prompt_len + args.new_tokens + 16,
              max_num_batched_tokens=8192, enforce_eager=args.enforce_eager, enable_prefix_caching=False,
              async_scheduling=args.async_scheduling,
              **({"gpu_memory_utilization": 0.85} if args.device == "cuda" else {}))
    profile(llm, 2, args.prompt_len, 8, False)  # warm-up
    results = []
    for n in args.requests:
        for sync in ([False, True] if args.device == "cuda" else [False]):
            r = profile(llm, n, args.prompt_len, args.new_tokens, sync)
            print(json.dumps(r), flush=True)
            results.append(r)
    out = {"command": " ".join([Path(sys.executable).name] + sys.argv), "model": args.model,
           "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu", "results": results}
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
