"""Where a speculative engine step's time goes: the mean wall time of decode steps, with and without
speculation (and the slowest steps: one-off stalls such as kernel compiles), the wall time inside the
step's phases (timers around the runner, rejection sampler, proposer and scheduler: a phase that
waits for the device shows the wait), then cProfile over the same steps, with and without
speculation (our functions by cumulative and own time; cProfile inflates Python-heavy code, so read
its shares, not its seconds).

    python bench/spec_profile.py --device cuda --load-format dummy --model llama-3.1-8b \
        --eagle dummy --eagle-acceptance 0.43 0.44 0.57 0.41 --concurrency 1 16 64
    python bench/spec_profile.py --eagle specserve/spec_decode/heads/SmolLM2-135M-Instruct   # CPU, default model
"""
from __future__ import annotations

import argparse
import collections
import cProfile
import io
import statistics
import json
import pstats
import random
import time

import torch

from specserve import LLM, SamplingParams


def build(args, spec: dict | None) -> LLM:
    max_len = args.prompt_len + args.steps * (args.k + 1) + 64
    extra = {"num_kv_blocks": 2 * max(args.concurrency) * -(-max_len // 16)} if args.device != "cpu" else {}
    return LLM(args.model, dtype=args.dtype, device=args.device, load_format=args.load_format,
               max_num_seqs=max(args.concurrency), max_model_len=max_len, speculative_config=spec, **extra)


def decode_steps(llm: LLM, concurrency: int, args, profile: cProfile.Profile | None) -> dict:
    """`concurrency` requests prefilled, then `args.steps` timed steps (all of them decoding)."""
    engine = llm.engine
    rng = random.Random(0)
    params = SamplingParams(temperature=0.0, max_tokens=args.steps * (args.k + 1) + 8, ignore_eos=True)
    for i in range(concurrency):
        prompt = [rng.randrange(3, 1000) for _ in range(args.prompt_len)]
        engine.add_request(f"p{time.monotonic_ns()}-{i}", {"prompt_token_ids": prompt}, params)
    while any(r.num_output_tokens == 0 for r in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()
    before = engine.stats()
    phases = collections.Counter()
    restore = _time_phases(engine, phases)
    if profile is not None:
        profile.enable()
    t0 = time.perf_counter()
    steps = []
    for _ in range(args.steps):
        t = time.perf_counter()
        engine.step()
        steps.append(time.perf_counter() - t)
    if args.device == "cuda":
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - t0
    restore()
    if profile is not None:
        profile.disable()
    after = engine.stats()
    for req_id in [r.request_id for r in engine.scheduler.running] + [r.request_id for r in engine.scheduler.waiting]:
        engine.abort(req_id)
    while engine.has_unfinished():
        engine.step()
    drafts = after["spec_decode_num_drafts"] - before["spec_decode_num_drafts"]
    accepted = after["spec_decode_num_accepted_tokens"] - before["spec_decode_num_accepted_tokens"]
    median = statistics.median(steps)
    return {"step_ms": round(1000 * elapsed / args.steps, 3), "median_step_ms": round(1000 * median, 3),
            "slowest_ms": [round(1000 * t, 1) for t in sorted(steps)[-3:]],
            "steps_over_3x_median": sum(t > 3 * median for t in steps),
            "drafts_per_step": round(drafts / args.steps, 2),
            "mean_acceptance_length": round(1 + accepted / drafts, 3) if drafts else None,
            "phase_ms_per_step": {k: round(1000 * v / args.steps, 3) for k, v in sorted(phases.items())}}


def _time_phases(engine, phases: collections.Counter):
    """Wrap the step's phases with wall-clock timers; returns a function that unwraps them."""
    runner, proposer = engine.runner, engine.runner.proposer
    targets = [(engine.scheduler, "schedule"), (engine.scheduler, "resolve"), (runner, "launch"),
               (runner, "collect"), (runner, "_sample"), (runner, "_verify_and_draft")]
    if proposer is not None:
        names = ("propose", "skip", "_catch_up", "_chain", "draft_on_device", "drafted")
        targets += [(proposer, name) for name in names if hasattr(proposer, name)]
        if runner.rejection_sampler is not None:
            targets += [(runner.rejection_sampler, "verify"), (runner.rejection_sampler, "greedy_on_device")]
        if getattr(proposer, "chain_graphs", None) is not None:
            targets.append((proposer.chain_graphs, "run"))
    saved = []
    for obj, name in targets:
        fn = getattr(obj, name)
        saved.append((obj, name, obj.__dict__.get(name)))

        def timed(*a, _fn=fn, _key=f"{type(obj).__name__}.{name}", **kw):
            t = time.perf_counter()
            try:
                return _fn(*a, **kw)
            finally:
                phases[_key] += time.perf_counter() - t
        setattr(obj, name, timed)

    def restore() -> None:
        for obj, name, old in saved:
            if old is None:
                delattr(obj, name)
            else:
                setattr(obj, name, old)
    return restore


def top(profile: cProfile.Profile, key: str, n: int) -> str:
    buf = io.StringIO()
    stats = pstats.Stats(profile, stream=buf)
    stats.sort_stats(key).print_stats(r"specserve|kernels|torch/nn/modules/module.py|cuda/graphs", n)
    return "\n".join(line for line in buf.getvalue().splitlines() if line.strip())[-6000:]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--load-format", default="auto")
    ap.add_argument("--eagle", default=None, help="a head directory, or with dummy weights any value")
    ap.add_argument("--eagle-acceptance", type=float, nargs="+", default=None,
                    help="dummy weights: acceptance per draft position (BENCHMARK-ONLY replay)")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--no-adaptive", action="store_true")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--out", default=None, help="a .json path")
    args = ap.parse_args()
    spec = {"method": "eagle", "model": args.eagle, "num_speculative_tokens": args.k, "adaptive": not args.no_adaptive}
    if args.load_format == "dummy":
        spec.update(load_format="dummy", simulated_acceptance=args.eagle_acceptance or [0.8])
    results = {"args": vars(args), "levels": []}
    engines = {"none": build(args, None), "eagle": build(args, spec)}
    for c in args.concurrency:
        row = {"concurrency": c}
        for name, llm in engines.items():
            decode_steps(llm, c, args, None)  # warm-up: this level's shapes
            row[name] = decode_steps(llm, c, args, None)
        profiles = {name: cProfile.Profile() for name in engines}
        for name, llm in engines.items():
            row[f"{name}_profiled"] = decode_steps(llm, c, args, profiles[name])
        print(f"== c={c}: {json.dumps(row)}", flush=True)
        for name, profile in profiles.items():
            print(f"-- {name}, c={c}", flush=True)
            print(top(profile, "cumulative", args.top), flush=True)
            print(top(profile, "tottime", args.top), flush=True)
        results["levels"].append(row)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
