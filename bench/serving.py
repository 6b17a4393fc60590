"""Serving benchmark: TTFT, TPOT, ITL, steady-state ITL, throughput and failures of `specserve serve`
(or any OpenAI-compatible server) against the offline engine on the same workload.

Prompts are ShareGPT first turns (sent as a chat message) or, with --prompt-tokens N, N random token
ids (no tokenizer, no data set: for `--load-format dummy` models). They go over the WebSocket API
(--protocol ws) or OpenAI streaming HTTP (--protocol sse: /v1/completions, or /v1/chat/completions
for text). Load is U closed-loop users (--concurrency; each sends its next request when its last
one is done: --requests-per-user R each, or a shared queue of --num-prompts) or Poisson arrivals
(--request-rate), spread over --client-procs processes that start together; the report gives each
one's CPU utilisation, so one can see the load generator was not the bottleneck. Every request asks
for exactly --max-tokens tokens (ignore_eos, greedy); runs never share a prompt (no prefix-cache hits
between runs).

    python bench/serving.py --model llama-3.1-8b --server-args "--load-format dummy" --prompt-tokens 1024 \\
        --concurrency 1 16 64 256 --requests-per-user 4 --max-tokens 256 --protocol sse \\
        --client-procs 4 --offline --out bench/results/serving_gpu.json --md bench/results/serving_gpu.md

Without --url it starts `specserve serve --port P <--server-args>` on a free port and stops it
(SIGINT) after the runs. --offline then runs each concurrency's prompts through `LLM.generate` in
a fresh process (engine flags parsed from --server-args as `specserve serve` parses them, with
max_num_seqs = min(its value, U)); offline tok/s = output tokens / wall time of one generate call.

Definitions (as vLLM's benchmark_serving): TTFT = first token-bearing event - send; TPOT = (last
token event - first) / (output tokens - 1); ITL = the gaps between consecutive token-bearing events
of one request; E2E = done - send; run duration = last request end - common start. Steady-state
ITL = the ITL gaps that start inside [the moment the last request of the first wave (each user's
first request) got its first token, the moment the first request of the run finished]: nobody's
prompt is being prefilled then, so it is the decode cadence of a full, steady batch (none when that
window is empty, e.g. with more users than the server's max-num-seqs; none for --request-rate).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import shlex
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from itertools import pairwise
from dataclasses import replace
from pathlib import Path
from urllib.parse import urlsplit

import httpx

from specserve.client import SpecserveError, wait_until_ready

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serving_load import (  # noqa: E402
    LoadJob, Prompt, Result, WorkerResult, call_in_processes, run_job, run_jobs, split_load)

REPO = Path(__file__).resolve().parents[1]
ENV_KEYS = ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "MKL_NUM_THREADS")  # recorded: they change CPU numbers
NUM_WARMUP_PROMPTS = 4


def token_prompts(num: int, length: int, vocab_size: int, seed: int) -> list[list[int]]:
    """`num` prompts of `length` random ids in [10, vocab_size - 10) (clear of special tokens)."""
    rng, ids = random.Random(seed), range(10, vocab_size - 10)
    return [rng.choices(ids, k=length) for _ in range(num)]


def text_prompts(num: int, max_chars: int, seed: int) -> list[str]:
    from prompts import sharegpt_conversations  # reads (or downloads) ShareGPT: text mode only

    pairs = sharegpt_conversations(limit=4000)
    prompts = list(dict.fromkeys(h for h, _ in pairs if 16 <= len(h) <= max_chars))
    random.Random(seed).shuffle(prompts)
    if len(prompts) < num:
        raise SystemExit(f"only {len(prompts)} distinct ShareGPT prompts of at most {max_chars} characters, "
                         f"{num} needed: fewer requests, or --prompt-tokens")
    return prompts[:num]


class ServerProcess:
    """`specserve serve` in a subprocess on a free port."""

    def __init__(self, model: str | None, server_args: list[str], log: Path) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        cmd = [sys.executable, "-m", "specserve.cli", "serve", *([model] if model else []),
               "--port", str(self.port), *server_args]
        self.cmd = cmd
        self.log = open(log, "w")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, cwd=REPO)
        try:  # a GPU start: model load + warm-up
            ready = wait_until_ready(f"http://127.0.0.1:{self.port}", 600, alive=lambda: self.proc.poll() is None,
                                     interval=0.5)
        except TimeoutError:
            ready = False
        if not ready:
            self.stop()
            raise SystemExit(f"the server did not come up; see {log}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(2)  # SIGINT: graceful
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.log.close()


def http_base(url: str) -> str:
    """http://host:port of a ws://host:port/v1/ws or http://host:port[/...] URL."""
    u = urlsplit(url)
    scheme = {"ws": "http", "wss": "https"}.get(u.scheme, u.scheme)
    return f"{scheme}://{u.netloc}"


def served_model(base: str, api_key: str | None) -> str | None:
    """The first model of GET /v1/models (None if the server does not answer it)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
    try:
        r = httpx.get(f"{base}/v1/models", headers=headers, timeout=10)
        return r.json()["data"][0]["id"] if r.status_code == 200 else None
    except (httpx.HTTPError, ValueError, KeyError, IndexError):
        return None


def _stats(values: list[float], scale: float = 1000.0) -> dict:
    if not values:
        return {"mean": None, "p50": None, "p99": None, "p99_over_p50": None, "count": 0}
    v = sorted(values)
    p50, p99 = statistics.median(v), v[min(len(v) - 1, int(round(0.99 * (len(v) - 1))))]
    return {"mean": statistics.fmean(v) * scale, "p50": p50 * scale, "p99": p99 * scale,
            "p99_over_p50": p99 / p50 if p50 else None, "count": len(v)}


def steady_window(results: list[Result]) -> tuple[float, float] | None:
    """[last first token of the first wave, first request end], or None if empty or open loop."""
    firsts = [r.token_times[0] for r in results if r.wave == 0 and r.token_times]
    ends = [r.end for r in results if r.ok]
    if not firsts or not ends or max(firsts) >= min(ends):
        return None
    return max(firsts), min(ends)


def summarize(workers: list[WorkerResult]) -> dict:
    results = [r for w in workers for r in w.results]
    ok = [r for r in results if r.ok]
    duration = max(r.end for r in results) - min(w.start for w in workers)
    out_tokens, in_tokens = sum(r.output_tokens for r in ok), sum(r.input_tokens for r in ok)
    window = steady_window(results)
    steady = [] if window is None else [b - a for r in ok for a, b in pairwise(r.token_times)
                                        if window[0] <= a <= window[1]]
    return {
        "requests": len(results), "completed": len(ok), "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if r.error})[:5],
        "duration_s": duration,
        "request_throughput": len(ok) / duration,
        "output_throughput": out_tokens / duration,
        "total_token_throughput": (in_tokens + out_tokens) / duration,
        "mean_input_tokens": in_tokens / len(ok) if ok else None,
        "prefix_cached_tokens": sum(r.cached_tokens for r in ok),
        "tokens_per_event": out_tokens / max(1, sum(len(r.token_times) for r in ok)),
        "ttft_ms": _stats([r.ttft for r in ok]),
        "tpot_ms": _stats([r.tpot for r in ok if r.tpot is not None]),
        "itl_ms": _stats([b - a for r in ok for a, b in pairwise(r.token_times)]),
        "steady_itl_ms": _stats(steady),
        "steady_window_s": None if window is None else window[1] - window[0],
        "e2e_ms": _stats([r.end - r.send for r in ok]),
        "client_procs": [{"users": w.users, "requests": len(w.results), "cpu_s": w.cpu_s, "wall_s": w.wall_s,
                          "cpu_util": w.cpu_s / w.wall_s} for w in workers],
    }


def offline_run(model: str | None, server_args: list[str], users: int, prompts: list[Prompt],
                warmup: list[Prompt], max_tokens: int) -> dict:
    """The offline engine on `prompts` at `users` concurrency. Run it in a fresh process: one engine
    holds the device at a time, and the parent never imports torch."""
    from specserve import LLM, SamplingParams
    from specserve.cli import build_parser
    from specserve.engine_args import engine_kwargs
    from specserve.server.cli import resolve_serve_args

    args = resolve_serve_args(build_parser().parse_args(["serve", *([model] if model else []), *server_args]))
    kwargs = engine_kwargs(args)
    kwargs["max_num_seqs"] = min(kwargs["max_num_seqs"], users)
    llm = LLM(args.model, **kwargs)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)

    def generate(batch: list[Prompt]) -> list:
        if isinstance(batch[0], str):
            return llm.chat([[{"role": "user", "content": p}] for p in batch], params)
        return llm.generate([{"prompt_token_ids": p} for p in batch], params)

    generate(warmup)
    t0 = time.perf_counter()
    outs = generate(prompts)
    wall = time.perf_counter() - t0
    counts = [len(o.outputs[0].token_ids) for o in outs]
    return {"users": users, "max_num_seqs": kwargs["max_num_seqs"], "requests": len(prompts),
            "completed": sum(c == max_tokens for c in counts), "output_tokens": sum(counts), "wall_s": wall,
            "output_throughput": sum(counts) / wall, "request_throughput": len(prompts) / wall}


def hardware() -> dict:
    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    try:
        gpus = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=20).stdout.strip().splitlines()
    except (OSError, subprocess.SubprocessError):
        gpus = []
    return {"cpu": cpu, "cores": os.cpu_count(), "gpus": gpus, "python": platform.python_version(),
            "platform": platform.platform()}


def _ms(v: float | None) -> str:
    return "–" if v is None else f"{v:.1f}" if v < 100 else f"{v:.0f}"


def _pair(s: dict) -> str:
    return f"{_ms(s['p50'])} / {_ms(s['p99'])}"


def summary_line(run: dict) -> str:
    s = run["result"]
    cpu = max(c["cpu_util"] for c in s["client_procs"])
    return (f"{run['load']} ({run['protocol']}): {s['completed']}/{s['requests']} ok, "
            f"{s['request_throughput']:.2f} req/s, {s['output_throughput']:.1f} tok/s, "
            f"TTFT p50 {_ms(s['ttft_ms']['p50'])} ms, ITL p50/p99 {_pair(s['itl_ms'])} ms, "
            f"steady ITL p50/p99 {_pair(s['steady_itl_ms'])} ms, client CPU max {cpu:.1%} "
            f"({len(s['client_procs'])} procs)")


def markdown(report: dict) -> str:
    rows = ["| users | protocol | requests | failed | out tok/s | × offline | TTFT p50 / p99 (ms) | TPOT p50 (ms) "
            "| ITL p50 / p99 (ms) | steady ITL p50 / p99 (ms) | client CPU max |",
            "|---|---|---|---|---|---|---|---|---|---|---|"]
    offline = {o["users"]: o for o in report["offline"]}
    for run in report["runs"]:
        r = run["result"]
        base = offline.get(run.get("concurrency"))
        ratio = f"{r['output_throughput'] / base['output_throughput']:.2f}" if base else "–"
        cpu = max(c["cpu_util"] for c in r["client_procs"])
        rows.append(f"| {run['load']} | {run['protocol']} | {r['requests']} | {r['failed']} | "
                    f"{r['output_throughput']:.1f} | {ratio} | {_pair(r['ttft_ms'])} | {_ms(r['tpot_ms']['p50'])} | "
                    f"{_pair(r['itl_ms'])} | {_pair(r['steady_itl_ms'])} | {cpu:.1%} |")
    hw = report["hardware"]
    offline_rows = [f"- {o['users']} users (max_num_seqs {o['max_num_seqs']}): {o['output_throughput']:.1f} tok/s, "
                    f"{o['completed']}/{o['requests']} complete, {o['wall_s']:.2f} s" for o in report["offline"]]
    return "\n".join([
        f"## Serving benchmark ({report['model']})", "",
        f"Command: `{report['command']}`", "",
        (f"Server: `{report['server_command']}`" if report.get("server_command")
         else f"Server: {report['url']}"), "",
        f"Hardware: {hw['cpu']}, {hw['cores']} cores{''.join(', ' + g for g in hw['gpus'])}; load average "
        f"before/after: {report['loadavg_before']} / {report['loadavg_after']}", "",
        f"Workload: {report['workload']}, {report['max_tokens']} output tokens per request (ignore_eos), "
        f"greedy; {report['client_procs']} client process(es).", "", *rows, "",
        *(["Offline engine (same prompts, one `generate` call):", "", *offline_rows, ""] if offline_rows else [])])


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", default=None,
                   help="target a running server: ws://host:port/v1/ws (ws) or http://host:port (sse)")
    p.add_argument("--protocol", choices=["ws", "sse"], default="ws")
    p.add_argument("--api-key", default=os.environ.get("SPECSERVE_API_KEY"))
    p.add_argument("--model", default=None, help="model for the server this script starts (default model)")
    p.add_argument("--server-args", default="--config configs/cpu-default.yaml",
                   help="flags for the server this script starts (and for --offline)")
    p.add_argument("--concurrency", type=int, nargs="*", default=[], help="closed-loop runs of this many users")
    p.add_argument("--requests-per-user", type=int, default=None,
                   help="each user sends this many requests (default: the users share --num-prompts)")
    p.add_argument("--request-rate", type=float, nargs="*", default=[], help="Poisson-arrival runs (req/s)")
    p.add_argument("--num-prompts", type=int, nargs="+", default=[32],
                   help="requests per run (one value, or one per run in the order given)")
    p.add_argument("--client-procs", type=int, default=1, help="client processes the users are spread over")
    p.add_argument("--prompt-tokens", type=int, default=None, help="prompts of this many random token ids")
    p.add_argument("--vocab-size", type=int, default=128256, help="token ids stay below this (Llama-3.1-8B's)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--max-prompt-chars", type=int, default=2000)
    p.add_argument("--offline", action="store_true", help="also run each concurrency's prompts offline")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-warmup-request", action="store_true",
                   help="skip the one short request sent before the runs (to measure the first wave after start-up)")
    p.add_argument("--out", type=Path, default=None, help="JSON results")
    p.add_argument("--md", type=Path, default=None, help="markdown table")
    args = p.parse_args(argv)
    args.loads = [("concurrency", c) for c in args.concurrency] + [("rate", r) for r in args.request_rate]
    if not args.loads:
        p.error("give --concurrency and/or --request-rate")
    if args.vocab_size <= 20 or (args.prompt_tokens is not None and args.prompt_tokens < 1):
        p.error("--prompt-tokens must be at least 1 and --vocab-size above 20")
    if min(args.concurrency + [args.client_procs, args.requests_per_user or 1]) < 1:
        p.error("--concurrency, --client-procs and --requests-per-user must be at least 1")
    nums = args.num_prompts if len(args.num_prompts) == len(args.loads) else [args.num_prompts[0]] * len(args.loads)
    args.nums = [v * args.requests_per_user if kind == "concurrency" and args.requests_per_user else n
                 for (kind, v), n in zip(args.loads, nums)]
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    total = NUM_WARMUP_PROMPTS + sum(args.nums)
    prompts_all = (token_prompts(total, args.prompt_tokens, args.vocab_size, args.seed) if args.prompt_tokens
                   else text_prompts(total, args.max_prompt_chars, args.seed))
    warmup, at, run_prompts = prompts_all[:NUM_WARMUP_PROMPTS], NUM_WARMUP_PROMPTS, []
    for n in args.nums:  # disjoint: no run hits the prefix cache of another
        run_prompts.append(prompts_all[at:at + n])
        at += n
    server_args = shlex.split(args.server_args)

    server = None
    if args.url is None:
        log = Path(tempfile.mkstemp(prefix="specserve-serving-", suffix=".log")[1])
        print(f"server log: {log}", flush=True)
        server = ServerProcess(args.model, server_args, log)
        port = f"127.0.0.1:{server.port}"
        url = f"ws://{port}/v1/ws" if args.protocol == "ws" else f"http://{port}"
    else:
        url = args.url
    model = served_model(http_base(url), args.api_key)
    if args.protocol == "sse" and model is None:
        raise SystemExit(f"GET {http_base(url)}/v1/models gave no model")
    env = {k: os.environ[k] for k in ENV_KEYS if k in os.environ}
    prefix = "".join(f"{k}={shlex.quote(v)} " for k, v in env.items())
    words = [sys.argv[0], *(argv or sys.argv[1:])]
    workload = (f"{args.prompt_tokens} random token ids per prompt (vocab {args.vocab_size})" if args.prompt_tokens
                else "ShareGPT first turns (chat template applied)")
    report = {"command": prefix + "python " + " ".join(shlex.quote(a) for a in words), "env": env,
              "server_command": (" ".join(server.cmd[2:]).replace("specserve.cli", "specserve", 1)
                                 if server else None),
              "url": url, "protocol": args.protocol, "model": model or args.model or "SmolLM2-135M-Instruct",
              "workload": workload, "max_tokens": args.max_tokens, "client_procs": args.client_procs,
              "hardware": hardware(), "loadavg_before": [round(x, 2) for x in os.getloadavg()],
              "runs": [], "offline": []}
    base = LoadJob(protocol=args.protocol, url=url, model=model, api_key=args.api_key, prompts=warmup[:1],
                   max_tokens=8, seed=args.seed)
    try:
        if not args.no_warmup_request:  # off: the first run measures the first users after start-up
            asyncio.run(run_job(base))
        for (kind, value), prompts in zip(args.loads, run_prompts):
            closed = kind == "concurrency"
            job = replace(base, prompts=prompts, max_tokens=args.max_tokens, users=value if closed else 1,
                          rate=None if closed else value, requests_per_user=args.requests_per_user if closed else None)
            workers = run_jobs(split_load(job, args.client_procs))
            run = {"load": f"{value}" if closed else f"rate {value}/s", kind: value, "protocol": args.protocol,
                   "requests_per_user": job.requests_per_user, "result": summarize(workers),
                   "requests": [r.row() for w in workers for r in w.results]}
            report["runs"].append(run)
            print(summary_line(run), flush=True)
    except (SpecserveError, RuntimeError) as e:  # the warm-up's, or a client process's
        raise SystemExit(f"the served runs failed: {e}") from None
    finally:
        if server is not None:
            server.stop()
    if args.offline:
        for (kind, value), prompts in zip(args.loads, run_prompts):
            if kind == "concurrency":
                (o,) = call_in_processes([(offline_run, (args.model, server_args, value, prompts, warmup,
                                                         args.max_tokens))])
                report["offline"].append(o)
                print(f"offline, {value} users: {o['output_throughput']:.1f} tok/s "
                      f"({o['completed']}/{o['requests']} complete, {o['wall_s']:.2f} s)", flush=True)
    report["loadavg_after"] = [round(x, 2) for x in os.getloadavg()]
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1))
    if args.md:
        args.md.write_text(markdown(report))
    print(markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
