"""Where a speculative engine step's time goes: the mean wall time of decode steps, with and without
speculation (and the slowest steps: one-off stalls such as kernel compiles), the wall time inside the
step's phases (timers around the runner, rejection sampler, proposer and scheduler: a phase that
waits for the device shows the wait), then cProfile over the same steps, with and without
speculation (our functions by cumulative and own time; cProfile inflates Python-heavy code, so read
its shares, not its seconds). With `--trace DIR` (CUDA) the device's timeline too: a torch profiler
trace of `--trace-steps` steps per engine and level (DIR/trace_<engine>_c<c>.json.gz, for Perfetto or
chrome://tracing) and its summary: the device's busy share of the wall time, and its idle gaps by the
host phase that ended them (the launch that gave the device work again) and the one it idled in.
With `--fine`, a further run per engine times ~30 more host phases and the host's waits for the device
(`Event.synchronize`), no profiler (timers nest: a phase includes those inside it); `--no-cprofile` skips
cProfile. `host_probe_ms` in the results is a fixed piece of pure Python timed in the process: where the
host sets a step's pace, compare runs of different processes against it.

    python bench/spec_profile.py --device cuda --load-format dummy --model llama-3.1-8b \
        --eagle dummy --eagle-acceptance 0.43 0.44 0.57 0.41 --concurrency 1 16 64
    python bench/spec_profile.py --eagle specserve/spec_decode/heads/SmolLM2-135M-Instruct   # CPU, default model

On a CPU, `--drafts-on-device --async-scheduling` runs the path a GPU takes (verification and drafts
queued without a host wait, the step left in flight), eagerly: its host phases and books can be
timed where no GPU is at hand (the phases that launch device work also hold the CPU's compute).
"""
from __future__ import annotations

import argparse
import bisect
import collections
import cProfile
import io
import statistics
import json
import os
import pstats
import subprocess
import random
import sys
import time
import types
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from timing import host_probe  # noqa: E402

from specserve import LLM, SamplingParams  # noqa: E402
from specserve.engine import model_runner  # noqa: E402


def build(args, spec: dict | None) -> LLM:
    max_len = args.prompt_len + args.steps * (args.k + 1) + 64
    extra = {"num_kv_blocks": 2 * max(args.concurrency) * -(-max_len // 16)} if args.device != "cpu" else {}
    if args.async_scheduling:
        extra["async_scheduling"] = True
    if args.async_drafting:
        extra["async_drafting"] = True
    llm = LLM(args.model, dtype=args.dtype, device=args.device, load_format=args.load_format,
              max_num_seqs=max(args.concurrency), max_model_len=max_len, speculative_config=spec, **extra)
    if spec is not None and args.drafts_on_device:  # the CUDA path, run eagerly (as the tests do on the CPU)
        llm.engine.runner.proposer.drafts_on_device = True
    return llm


def decode_steps(llm: LLM, concurrency: int, args, profile: cProfile.Profile | None, trace: str | None = None,
                 steps: int | None = None, fine: bool = False) -> dict:
    """`concurrency` requests prefilled, then `steps` (default `args.steps`) timed steps, all of them
    decoding; with `trace` (a path) under the torch profiler, its trace written there."""
    engine = llm.engine
    steps_wanted = steps or args.steps
    rng = random.Random(0)
    params = SamplingParams(temperature=0.0, max_tokens=steps_wanted * (args.k + 1) + 8, ignore_eos=True)
    for i in range(concurrency):
        prompt = [rng.randrange(3, min(1000, engine.model_info().vocab_size)) for _ in range(args.prompt_len)]
        engine.add_request(f"p{time.monotonic_ns()}-{i}", {"prompt_token_ids": prompt}, params)
    while any(r.num_output_tokens == 0 for r in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()
    before = engine.stats()
    phases = collections.Counter()
    restore = _time_phases(engine, phases, annotate=trace is not None, fine=fine)
    tracer = None
    if trace is not None:
        activities = [torch.profiler.ProfilerActivity.CPU]
        if args.device == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        tracer = torch.profiler.profile(activities=activities)
        tracer.start()
    if profile is not None:
        profile.enable()
    t0 = time.perf_counter()
    steps = []
    for _ in range(steps_wanted):
        t = time.perf_counter()
        engine.step()
        steps.append(time.perf_counter() - t)
    if args.device == "cuda":
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - t0
    restore()
    if profile is not None:
        profile.disable()
    if tracer is not None:
        tracer.stop()
        tracer.export_chrome_trace(trace)
    after = engine.stats()
    for req_id in [r.request_id for r in engine.scheduler.running] + [r.request_id for r in engine.scheduler.waiting]:
        engine.abort(req_id)
    while engine.has_unfinished():
        engine.step()
    drafts = after["spec_decode_num_drafts"] - before["spec_decode_num_drafts"]
    accepted = after["spec_decode_num_accepted_tokens"] - before["spec_decode_num_accepted_tokens"]
    median = statistics.median(steps)
    return {"step_ms": round(1000 * elapsed / steps_wanted, 3), "median_step_ms": round(1000 * median, 3),
            "slowest_ms": [round(1000 * t, 1) for t in sorted(steps)[-3:]],
            "steps_over_3x_median": sum(t > 3 * median for t in steps),
            "drafts_per_step": round(drafts / steps_wanted, 2),
            "mean_acceptance_length": round(1 + accepted / drafts, 3) if drafts else None,
            "phase_ms_per_step": {k: round(1000 * v / steps_wanted, 3) for k, v in sorted(phases.items())}}


def _time_phases(engine, phases: collections.Counter, annotate: bool = False, fine: bool = False):
    """Wrap the step's phases with wall-clock timers (and, with `annotate`, torch profiler ranges of
    the same names, a few more phases and the step itself; with `fine`, those more phases and the
    host's books between a verification's wait and the next launch, timed only); returns a function
    that unwraps them. Timers nest: a phase's time includes the phases inside it."""
    runner, proposer = engine.runner, engine.runner.proposer
    targets = [(engine.scheduler, "schedule"), (engine.scheduler, "resolve"), (runner, "launch"),
               (runner, "collect"), (runner, "_sample"), (runner, "_verify_and_draft")]
    if annotate or fine:
        targets += [(engine, "step"), (engine, "_drain"), (engine.outputs, "process"), (runner, "_verified"),
                    (runner, "_fill_drafts"), (runner, "_sample_deferred"), (runner.target, "forward"),
                    (runner.target, "compute_logits"), (model_runner, "build_step_inputs")]
    if fine:
        targets += [(engine, "_finish"), (engine, "_update"), (engine.scheduler, "advance"),
                    (engine.spec_stats, "observe"), (runner, "_settle_drafts"), (runner, "_to_host")]
        if engine.async_drafting:  # --async-drafting: a step launched ahead and its books
            targets += [(engine, "_step_ahead"), (engine.scheduler, "schedule_ahead"), (runner, "_ahead_inputs"),
                        (runner, "settle_ahead")]
        if runner.target.graphs is not None:
            targets.append((runner.target.graphs, "run"))
        if torch.cuda.is_available():  # the host's waits for the device
            targets.append((torch.cuda.Event, "synchronize"))
    if proposer is not None:
        names = ("propose", "idle", "skip", "_catch_up", "_chain", "draft_on_device", "drafted")
        targets += [(proposer, name) for name in names if hasattr(proposer, name)]
        if runner.rejection_sampler is not None:
            targets += [(runner.rejection_sampler, "verify"), (runner.rejection_sampler, "greedy_on_device")]
        if getattr(proposer, "chain_graphs", None) is not None:
            targets.append((proposer.chain_graphs, "run"))
        if annotate or fine:
            targets += [(proposer, name) for name in ("begin_step", "_store", "_sources") if hasattr(proposer, name)]
        policy = getattr(proposer, "policy", None)
        if fine and policy is not None:  # adaptive k's books and plans
            targets += [(policy, name) for name in ("step_started", "step_finished", "step_skipped", "plan",
                                                    "worth_trying", "observe")]
    saved = []
    for obj, name in targets:
        fn = getattr(obj, name)
        saved.append((obj, name, obj.__dict__.get(name)))

        owner = obj.__name__.rsplit(".", 1)[-1] if isinstance(obj, (types.ModuleType, type)) else type(obj).__name__

        def timed(*a, _fn=fn, _key=f"{owner}.{name}", **kw):
            t = time.perf_counter()
            try:
                if annotate:
                    with torch.profiler.record_function(_key):
                        return _fn(*a, **kw)
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


DEVICE_CATS = ("kernel", "gpu_memcpy", "gpu_memset")


def timeline(path: str) -> dict:
    """A torch profiler trace's summary over its annotated steps: wall and device-busy ms per step, and
    the device's idle time per step by the innermost host range (a phase, or a CUDA runtime call such
    as a synchronize) running meanwhile, and by the phase whose launch ended the gap."""
    with open(path) as f:
        events = json.load(f)["traceEvents"]
    spans = [e for e in events if e.get("ph") == "X" and "dur" in e]
    steps = sorted((e["ts"], e["ts"] + e["dur"]) for e in spans
                   if e.get("cat") == "user_annotation" and e["name"] == "LLMEngine.step")
    if not steps:
        return {}
    t0, t1 = steps[0][0], steps[-1][1]
    device = sorted((e["ts"], e["ts"] + e["dur"]) for e in spans if e.get("cat") in DEVICE_CATS)
    busy = []
    for a, b in device:
        if busy and a <= busy[-1][1]:
            busy[-1][1] = max(busy[-1][1], b)
        else:
            busy.append([a, b])
    gaps, last = [], t0
    for a, b in busy:
        if a > last and last < t1:
            gaps.append((last, min(a, t1), a))
        last = max(last, b)
    if last < t1:
        gaps.append((last, t1, None))
    host = sorted((e["ts"], e["ts"] + e["dur"], e["name"]) for e in spans
                  if e.get("cat") in ("user_annotation", "cuda_runtime", "cuda_driver"))
    launches = {e["args"]["correlation"]: e["ts"] for e in spans
                if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})}
    first_op = {}
    for e in spans:
        if e.get("cat") in DEVICE_CATS and "correlation" in e.get("args", {}):
            first_op.setdefault(e["ts"], e["args"]["correlation"])

    starts = [a for a, _, _ in host]

    def innermost(t: float, names_only: bool = False) -> str:
        # ranges nest: the latest start that still covers t is the innermost
        for i in range(bisect.bisect_right(starts, t) - 1, -1, -1):
            a, b, name = host[i]
            if b >= t and not (names_only and "." not in name):
                return name
        return "(between phases)"

    during, ended_by = collections.Counter(), collections.Counter()
    for g0, g1, nxt in gaps:
        t = g0
        while t < g1:  # sampled every 2 us
            during[innermost(t)] += min(2.0, g1 - t)
            t += 2.0
        corr = first_op.get(nxt) if nxt is not None else None
        ended_by[innermost(launches[corr], names_only=True) if corr in launches else "(end)"] += g1 - g0
    n = len(steps)
    busy_us = sum(min(b, t1) - max(a, t0) for a, b in busy if b > t0 and a < t1)
    return {"steps": n, "wall_ms_per_step": round((t1 - t0) / n / 1000, 3),
            "device_busy_ms_per_step": round(busy_us / n / 1000, 3),
            "device_busy_share": round(busy_us / (t1 - t0), 3),
            "idle_ms_per_step_while_host_in": {k: round(v / n / 1000, 3) for k, v in during.most_common(12)},
            "idle_ms_per_step_ended_by_launch_in": {k: round(v / n / 1000, 3) for k, v in ended_by.most_common(8)}}


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
    ap.add_argument("--eagle", default=None,
                    help="a head directory, or with dummy weights any value (dummy3: a head that fuses target layers)")
    ap.add_argument("--eagle-acceptance", type=float, nargs="+", default=None,
                    help="acceptance per draft position (BENCHMARK-ONLY replay; dummy weights: default 0.8)")
    ap.add_argument("--drafts-on-device", action="store_true",
                    help="CPU: draft through the CUDA path (draft_on_device), eagerly: its host work")
    ap.add_argument("--async-scheduling", action="store_true", help="CPU: async scheduling (the CUDA default)")
    ap.add_argument("--async-drafting", action="store_true",
                    help="async drafting: a drafting step's successor launched before its tokens are known")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--no-adaptive", action="store_true")
    ap.add_argument("--both-policies", action="store_true", help="an adaptive engine and a k-forced one side by side")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--out", default=None, help="a .json path")
    ap.add_argument("--trace", default=None, help="a directory: torch profiler traces of each engine and level")
    ap.add_argument("--trace-steps", type=int, default=40)
    ap.add_argument("--fine", action="store_true", help="time more phases (no profiler)")
    ap.add_argument("--no-cprofile", action="store_true", help="skip the cProfile runs")
    ap.add_argument("--eagle-quantization", choices=["int8", "none"], default=None,
                    help="the head's weights (speculative_config's quantization; default: as trained)")
    args = ap.parse_args()
    method = "eagle3" if args.load_format == "dummy" and args.eagle == "dummy3" else "eagle"
    spec = {"method": method, "model": args.eagle, "num_speculative_tokens": args.k, "adaptive": not args.no_adaptive}
    if args.load_format == "dummy":
        spec.update(load_format="dummy", simulated_acceptance=args.eagle_acceptance or [0.8])
    elif args.eagle_acceptance:
        spec.update(simulated_acceptance=args.eagle_acceptance)
    if args.eagle_quantization:
        spec["quantization"] = args.eagle_quantization
    results = {"args": vars(args), "host_probe_ms": host_probe(), "levels": []}
    if args.both_policies:  # "eagle" adaptive, "eagle_forced" with k = args.k always
        engines = {"none": build(args, None), "eagle": build(args, {**spec, "adaptive": True}),
                   "eagle_forced": build(args, {**spec, "adaptive": False})}
    else:
        engines = {"none": build(args, None), "eagle": build(args, spec)}
    for c in args.concurrency:
        row = {"concurrency": c}
        for name, llm in engines.items():
            decode_steps(llm, c, args, None)  # warm-up: this level's shapes
            row[name] = decode_steps(llm, c, args, None)
        if args.trace:
            os.makedirs(args.trace, exist_ok=True)
            for name, llm in engines.items():
                path = os.path.join(args.trace, f"trace_{name}_c{c}.json")
                row[f"{name}_traced"] = decode_steps(llm, c, args, None, trace=path, steps=args.trace_steps)
                row[f"{name}_timeline"] = timeline(path)
                subprocess.run(["gzip", "-f", path], check=False)
        if args.fine:
            for name, llm in engines.items():
                row[f"{name}_fine"] = decode_steps(llm, c, args, None, fine=True)
        profiles = {} if args.no_cprofile else {name: cProfile.Profile() for name in engines}
        for name, llm in engines.items() if profiles else ():
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
