"""Prefix-cache benchmark: a shared-system-prompt workload with the cache on and off, in one run.

Workload: `--groups` groups x `--per-group` requests, all arriving at once. A group shares a system
prompt of S tokens (ShareGPT reply text) and every request appends its own question (ShareGPT human
turns) up to `--prompt-len` tokens; outputs are `--max-tokens` long (ignore_eos). The first request
of a group computes the system prompt and the others reuse its blocks, even within the same step
(blocks are registered when scheduled), so the hit rate is (R - 1) / R * S / L; S is rounded down to
whole blocks. With R = 8 and L = 112: S = 0 / 32 / 64 / 96 -> 0 / 25 / 50 / 75 %
(the defaults, L = 56 and S = 0 / 16 / 32 / 48, give the same rates at half the compute; one group,
because bf16 runs at ~10-20 tokens/s on a 2-core CPU without native bf16).

Per point and mode: mean TTFT (RequestOutput.metrics), total throughput ((prompt + output tokens) /
wall time of the run), both also in this process's CPU seconds (robust to other jobs on a shared
machine), the measured hit rate (cached prompt tokens / prompt tokens, per request), and the host time
spent in the scheduler (where all prefix-cache bookkeeping runs). The two engines run
alternately, point by point, on the same model; the cache is reset between runs. Each point runs
`--repeats` (off, on) pairs, the 0 % point `--zero-repeats` (it checks that caching costs nothing
when nothing hits, a difference of a few percent), and reports medians.

    python bench/prefix_cache.py --out bench/results/prefix_cache_cpu.json --md bench/results/prefix_cache_cpu.md
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from prompts import sharegpt_conversations

from specserve import LLM, SamplingParams


class TokenStream:
    """Consecutive, never reused slices of one long token stream built from texts."""

    def __init__(self, tokenizer, texts: list[str]) -> None:
        self.ids = [t for text in texts for t in tokenizer.encode(text, add_special_tokens=False)]
        self.pos = 0

    def take(self, n: int) -> list[int]:
        if self.pos + n > len(self.ids):
            raise ValueError("not enough prompt text for this workload; lower --groups / --prompt-len")
        out = self.ids[self.pos:self.pos + n]
        self.pos += n
        return out


def build_workload(tokenizer, hit_rates: list[float], groups: int, per_group: int, prompt_len: int,
                   block_size: int) -> dict[float, tuple[int, list[list[int]]]]:
    """hit rate -> (system prompt tokens, prompts), every system prompt and question unique."""
    pairs = sharegpt_conversations(limit=3000)
    systems = TokenStream(tokenizer, [reply for _, reply in pairs])
    questions = TokenStream(tokenizer, [human for human, _ in pairs])
    out = {}
    for h in hit_rates:
        share = h * per_group / (per_group - 1) if per_group > 1 else 0.0
        sys_len = int(share * prompt_len) // block_size * block_size
        if sys_len >= prompt_len:
            raise ValueError(f"hit rate {h} needs a system prompt as long as the whole prompt")
        prompts = []
        for _ in range(groups):
            system = systems.take(sys_len)
            prompts += [system + questions.take(prompt_len - sys_len) for _ in range(per_group)]
        out[h] = (sys_len, prompts)
    return out


def run(llm: LLM, prompts: list[list[int]], max_tokens: int) -> dict:
    engine = llm.engine
    sched_time = [0.0]
    scheduler = engine.scheduler
    schedule, advance, resolve = scheduler.schedule, scheduler.advance, scheduler.resolve

    def timed(fn):
        def wrapper(*args):
            t0 = time.perf_counter()
            try:
                return fn(*args)
            finally:
                sched_time[0] += time.perf_counter() - t0
        return wrapper

    marks: list[tuple[float, float]] = []  # (monotonic, process CPU time) at the end of each step
    step = engine.step

    def marked_step(*args, **kwargs):
        out = step(*args, **kwargs)
        marks.append((time.monotonic(), time.process_time()))
        return out

    scheduler.schedule, scheduler.advance, scheduler.resolve = timed(schedule), timed(advance), timed(resolve)
    engine.step = marked_step
    before = engine.stats()
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    t0, cpu0 = time.perf_counter(), time.process_time()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    del scheduler.schedule, scheduler.advance, scheduler.resolve  # back to the class's methods
    del engine.step
    after = engine.stats()
    ttfts = [o.metrics.time_to_first_token for o in outs]
    # CPU seconds this process spent until each request's first token: what the wall-clock TTFT
    # would be on an idle machine, robust to other jobs sharing the cores
    ttft_cpu = [next(c for w, c in marks if w >= o.metrics.first_token_time) - cpu0 for o in outs]
    num_prompt = sum(len(p) for p in prompts)
    num_output = sum(len(o.outputs[0].token_ids) for o in outs)
    return {
        "mean_ttft_s": statistics.fmean(ttfts), "p50_ttft_s": statistics.median(ttfts),
        "max_ttft_s": max(ttfts), "mean_ttft_cpu_s": statistics.fmean(ttft_cpu), "wall_s": wall,
        "cpu_s": cpu, "total_tokens_per_s": (num_prompt + num_output) / wall,
        "output_tokens_per_s": num_output / wall, "total_tokens_per_cpu_s": (num_prompt + num_output) / cpu,
        "num_prompt_tokens": num_prompt, "num_output_tokens": num_output,
        "hit_rate": sum(o.num_cached_tokens for o in outs) / num_prompt,
        "prefix_cache_queries": after["prefix_cache_queries"] - before["prefix_cache_queries"],
        "prefix_cache_hits": after["prefix_cache_hits"] - before["prefix_cache_hits"],
        "num_cow_copies": after["num_cow_copies"] - before["num_cow_copies"],
        "num_evictions": after["num_evictions"] - before["num_evictions"],
        "num_preemptions": after["num_preemptions"] - before["num_preemptions"],
        "scheduler_s": sched_time[0], "tokens": [o.outputs[0].token_ids for o in outs],
    }


def summarize(runs: list[dict]) -> dict:
    """The median of every metric over the repeated runs of one point and mode."""
    return {k: statistics.median(r[k] for r in runs) for k in runs[0]} | {"num_runs": len(runs)}


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def markdown(result: dict, command: str) -> str:
    c, host = result["config"], result["host"]
    lines = [
        f"# Prefix cache, CPU ({c['model']}, {c['dtype']})", "",
        (f"Workload: {c['groups']} group(s) x {c['per_group']} requests, all at once; prompts of "
         f"{c['prompt_len']} tokens = a shared system prompt + a unique question (ShareGPT text); "
         f"{c['max_tokens']} output tokens each (greedy, ignore_eos); block size {c['block_size']}. "
         f"Host: {host['cpu']} ({host['num_cpus']} cores, torch {host['torch']}), load average "
         f"{host['loadavg_start']} at start, {host['loadavg_end']} at the end (other jobs shared the "
         "machine)."), "",
        ("Medians over the (off, on) pairs of each point. Wall clock: mean TTFT and total tok/s = "
         "(prompt + output tokens) / wall time. CPU: the same in this process's CPU seconds (what the "
         "wall clock would show on an idle machine; robust to the other jobs). Scheduler = host seconds "
         "in schedule() + advance() + resolve(), where all prefix-cache bookkeeping runs. Same output = "
         "greedy tokens identical with the cache on and off."), "",
        ("| target hit | system prompt | measured hit | pairs | TTFT off / on (s) | off/on "
         "| CPU TTFT off / on (s) | off/on | tok/s off / on | on/off | tok/CPU-s off / on | on/off "
         "| scheduler s off / on | same output |"),
        "|" + "---|" * 14,
    ]
    for p in result["points"]:
        off, on = p["off"], p["on"]
        lines.append(
            f"| {p['target_hit_rate']:.0%} | {p['system_prompt_tokens']} | {on['hit_rate']:.1%} "
            f"| {on['num_runs']} | {off['mean_ttft_s']:.2f} / {on['mean_ttft_s']:.2f} "
            f"| {off['mean_ttft_s'] / on['mean_ttft_s']:.2f}x "
            f"| {off['mean_ttft_cpu_s']:.2f} / {on['mean_ttft_cpu_s']:.2f} "
            f"| {off['mean_ttft_cpu_s'] / on['mean_ttft_cpu_s']:.2f}x "
            f"| {off['total_tokens_per_s']:.1f} / {on['total_tokens_per_s']:.1f} "
            f"| {on['total_tokens_per_s'] / off['total_tokens_per_s']:.3f} "
            f"| {off['total_tokens_per_cpu_s']:.1f} / {on['total_tokens_per_cpu_s']:.1f} "
            f"| {on['total_tokens_per_cpu_s'] / off['total_tokens_per_cpu_s']:.3f} "
            f"| {off['scheduler_s']:.3f} / {on['scheduler_s']:.3f} | {p['same_output']} |")
    by_rate = {p["target_hit_rate"]: p for p in result["points"]}
    if 0.75 in by_rate and 0.0 in by_rate:
        top, zero = by_rate[0.75], by_rate[0.0]
        lines += ["", (f"Targets: TTFT at 75 % at least 3x lower with caching: "
                       f"{top['off']['mean_ttft_s'] / top['on']['mean_ttft_s']:.2f}x wall clock, "
                       f"{top['off']['mean_ttft_cpu_s'] / top['on']['mean_ttft_cpu_s']:.2f}x CPU; throughput "
                       f"at 0 % within 3 % of caching off: on/off "
                       f"{zero['on']['total_tokens_per_s'] / zero['off']['total_tokens_per_s']:.3f} wall clock, "
                       f"{zero['on']['total_tokens_per_cpu_s'] / zero['off']['total_tokens_per_cpu_s']:.3f} CPU.")]
    for p in result["points"]:
        if "control" in p:
            off, ctl = p["off"], p["control"]
            lines += ["", (f"A/A control at {p['target_hit_rate']:.0%}: a second engine with caching off, same "
                           f"runs interleaved: tok/s {ctl['total_tokens_per_s']:.1f} "
                           f"({ctl['total_tokens_per_s'] / off['total_tokens_per_s']:.3f} of off), tok/CPU-s "
                           f"{ctl['total_tokens_per_cpu_s']:.1f} "
                           f"({ctl['total_tokens_per_cpu_s'] / off['total_tokens_per_cpu_s']:.3f} of off): "
                           "differences of this size are measurement noise.")]
    lines += ["", f"Total run time: {result['total_s']:.0f} s.", "", "Command:", "", f"    {command}", ""]
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct")
    ap.add_argument("--dtype", default="bfloat16",
                    help="bfloat16 (the default model's own dtype), or auto / float32 / float16")
    ap.add_argument("--groups", type=int, default=1)
    ap.add_argument("--per-group", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=56)
    ap.add_argument("--max-tokens", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=1, help="(off, on) pairs per point, order alternating")
    ap.add_argument("--zero-repeats", type=int, default=2, help="pairs at the 0%% point (the overhead check)")
    ap.add_argument("--hit-rates", type=float, nargs="+", default=[0.0, 0.25, 0.5, 0.75])
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    ap.add_argument("--no-control", dest="control", action="store_false",
                    help="skip the second caching-off engine at the 0%% point (the A/A noise floor)")
    ap.add_argument("--kv-cache-memory", type=int, default=128 << 20)
    ap.add_argument("--out", default=None)
    ap.add_argument("--md", default=None)
    args = ap.parse_args()
    command = "python " + " ".join([sys.argv[0]] + sys.argv[1:])
    if args.threads:
        torch.set_num_threads(args.threads)
    t_start = time.perf_counter()
    loadavg_start = os.getloadavg()

    engine_args = {"dtype": args.dtype, "device": "cpu", "block_size": args.block_size,
                       "kv_cache_memory": args.kv_cache_memory}
    # "control": a second caching-off engine, run at the 0 % point only (an A/A test: the noise floor)
    modes = ("off", "on", "control") if args.control else ("off", "on")
    llms = {mode: LLM(args.model, enable_prefix_caching=(mode == "on"), **engine_args) for mode in modes}
    tokenizer = llms["on"].tokenizer
    workload = build_workload(tokenizer, args.hit_rates, args.groups, args.per_group, args.prompt_len,
                              args.block_size)
    for llm in llms.values():  # warm-up: first-call overheads out of the measurement
        llm.generate({"prompt_token_ids": list(range(1000, 1040))}, SamplingParams(max_tokens=2))
        llm.engine.kv_manager.reset_prefix_cache()

    points, num_pairs = [], 0
    for h in args.hit_rates:
        sys_len, prompts = workload[h]
        point_modes = modes if h == 0 else ("off", "on")
        runs: dict[str, list[dict]] = {mode: [] for mode in point_modes}
        same = True
        for _ in range(args.zero_repeats if h == 0 else args.repeats):
            order = point_modes if num_pairs % 2 == 0 else point_modes[::-1]  # drift favours none
            num_pairs += 1
            tokens = {}
            for mode in order:
                res = run(llms[mode], prompts, args.max_tokens)
                tokens[mode] = res.pop("tokens")
                runs[mode].append(res)
                llms[mode].engine.kv_manager.reset_prefix_cache()
            same &= tokens["on"] == tokens["off"]
        point = {"target_hit_rate": h, "system_prompt_tokens": sys_len, "same_output": same,
                 **{mode: summarize(r) for mode, r in runs.items()}, "runs": runs}
        points.append(point)
        off, on = point["off"], point["on"]
        print(f"hit {h:.0%}: measured {on['hit_rate']:.1%}  TTFT off {off['mean_ttft_s']:.2f}s "
              f"on {on['mean_ttft_s']:.2f}s  tok/s off {off['total_tokens_per_s']:.1f} "
              f"on {on['total_tokens_per_s']:.1f}  same output: {same}", flush=True)

    loaded = llms["on"].engine.loaded
    result = {
        "config": {"model": args.model or "SmolLM2-135M-Instruct (default)", "dtype": str(loaded.dtype),
                   "groups": args.groups, "per_group": args.per_group, "prompt_len": args.prompt_len,
                   "max_tokens": args.max_tokens, "block_size": args.block_size, "repeats": args.repeats,
                   "zero_repeats": args.zero_repeats,
                   "num_kv_blocks": llms["on"].engine.stats()["num_blocks"]},
        "host": {"cpu": cpu_name(), "num_cpus": os.cpu_count(),
                 "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
                 "loadavg_start": [round(x, 1) for x in loadavg_start],
                 "loadavg_end": [round(x, 1) for x in os.getloadavg()]},
        "points": points, "total_s": time.perf_counter() - t_start, "command": command,
    }
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    if args.md:
        Path(args.md).write_text(markdown(result, command))
    print(markdown(result, command))
    return 0


if __name__ == "__main__":
    sys.exit(main())
