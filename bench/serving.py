"""Serving benchmark over the WebSocket API: TTFT, TPOT, ITL, throughput, failures.

Load comes from ShareGPT prompts (first human turn of each conversation, sent as a chat message),
at fixed concurrency (N simulated users, one socket each, each sending its next request when the
last one is done) or at a Poisson arrival rate (one multiplexed socket). Every request asks for
exactly --max-tokens output tokens (ignore_eos) so runs are comparable.

    python bench/serving.py --concurrency 1 8 32 --num-prompts 16 32 64 --max-tokens 64 \
        --out bench/results/serving_cpu.json --md bench/results/serving_cpu.md

Without --url it starts `specserve serve` (the default model, configs/cpu-default.yaml unless
--server-args says otherwise) in a subprocess on a free port and stops it at the end.
Definitions (as vLLM's benchmark_serving): TTFT = first token-bearing delta - send; TPOT =
(last token - first token) / (output tokens - 1); ITL = gaps between token-bearing deltas;
E2E = done - send.
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
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from prompts import sharegpt_conversations

from specserve.client import AsyncClient, OutputTextDelta, ResponseDone, SpecserveError

REPO = Path(__file__).resolve().parents[1]
ENV_KEYS = ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "MKL_NUM_THREADS")  # recorded: they change CPU numbers


@dataclass
class Result:
    ok: bool = False
    status: str = ""
    error: str = ""
    input_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int = 0
    ttft: float | None = None
    e2e: float | None = None
    itl: list[float] = field(default_factory=list)
    tpot: float | None = None


async def one_request(client: AsyncClient, prompt: str, max_tokens: int) -> Result:
    r = Result()
    t0 = time.perf_counter()
    last = None
    try:
        stream = await client.create(messages=[{"role": "user", "content": prompt}],
                                     max_output_tokens=max_tokens,
                                     temperature=0.0, ignore_eos=True)
        async for event in stream:
            now = time.perf_counter()
            if isinstance(event, OutputTextDelta) and event.token_ids:
                if last is None:
                    r.ttft = now - t0
                else:
                    r.itl.append(now - last)
                last = now
            elif isinstance(event, ResponseDone):
                done = event.response
                r.e2e = now - t0
                r.status = done.status
                r.input_tokens, r.output_tokens = done.usage.input_tokens, done.usage.output_tokens
                r.cached_tokens = done.usage.cached_tokens
                r.ok = done.status in ("completed", "incomplete") and r.output_tokens == max_tokens
                if not r.ok:
                    r.error = f"status {done.status}, {r.output_tokens} tokens"
    except SpecserveError as e:
        r.error = f"{e.code}: {e.message}"
    if r.ok and r.output_tokens > 1 and r.ttft is not None:
        r.tpot = (last - t0 - r.ttft) / (r.output_tokens - 1)
    return r


async def run_concurrency(url: str, prompts: list[str], concurrency: int, max_tokens: int,
                          api_key: str | None) -> tuple[list[Result], float]:
    queue: asyncio.Queue[str] = asyncio.Queue()
    for p in prompts:
        queue.put_nowait(p)
    results: list[Result] = []

    async def user() -> None:
        async with AsyncClient(url, api_key=api_key, read_timeout=600) as client:
            while not queue.empty():
                results.append(await one_request(client, queue.get_nowait(), max_tokens))

    t0 = time.perf_counter()
    await asyncio.gather(*(user() for _ in range(concurrency)))
    return results, time.perf_counter() - t0


async def run_rate(url: str, prompts: list[str], rate: float, max_tokens: int, api_key: str | None,
                   seed: int) -> tuple[list[Result], float]:
    rng = random.Random(seed)
    async with AsyncClient(url, api_key=api_key, read_timeout=600) as client:
        t0 = time.perf_counter()
        tasks = []
        for p in prompts:
            tasks.append(asyncio.create_task(one_request(client, p, max_tokens)))
            await asyncio.sleep(rng.expovariate(rate))
        results = await asyncio.gather(*tasks)
        return list(results), time.perf_counter() - t0


def _stats(values: list[float], scale: float = 1000.0) -> dict:
    if not values:
        return {"mean": None, "p50": None, "p99": None}
    v = sorted(values)
    p99 = v[min(len(v) - 1, int(round(0.99 * (len(v) - 1))))]
    return {"mean": statistics.fmean(v) * scale, "p50": statistics.median(v) * scale, "p99": p99 * scale}


def summarize(results: list[Result], duration: float) -> dict:
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.input_tokens for r in ok)
    return {
        "requests": len(results), "completed": len(ok), "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if r.error})[:5],
        "duration_s": duration,
        "request_throughput": len(ok) / duration,
        "output_throughput": out_tokens / duration,
        "total_token_throughput": (in_tokens + out_tokens) / duration,
        "mean_input_tokens": in_tokens / len(ok) if ok else None,
        "prefix_cached_tokens": sum(r.cached_tokens for r in ok),
        "ttft_ms": _stats([r.ttft for r in ok if r.ttft is not None]),
        "tpot_ms": _stats([r.tpot for r in ok if r.tpot is not None]),
        "itl_ms": _stats([g for r in ok for g in r.itl]),
        "e2e_ms": _stats([r.e2e for r in ok if r.e2e is not None]),
    }


def load_prompts(num: int, max_chars: int, seed: int) -> list[str]:
    pairs = sharegpt_conversations(limit=4000)
    prompts = [h for h, _ in pairs if 16 <= len(h) <= max_chars]
    random.Random(seed).shuffle(prompts)
    if len(prompts) < num:
        raise SystemExit(f"only {len(prompts)} ShareGPT prompts of at most {max_chars} characters")
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
        self.url = f"ws://127.0.0.1:{self.port}/v1/ws"
        deadline = time.monotonic() + 600
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{self.port}/health", timeout=5).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise SystemExit(f"the server did not come up; see {log}")
            time.sleep(0.5)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(2)  # SIGINT: graceful
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.log.close()


def _ms(v: float | None) -> str:
    return "–" if v is None else f"{v:.0f}"


def hardware() -> dict:
    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "python": platform.python_version(),
            "platform": platform.platform()}


def markdown(report: dict) -> str:
    rows = [("| load | requests | failed | req/s | out tok/s | TTFT mean / p50 / p99 (ms) "
             "| TPOT mean / p50 / p99 (ms) | ITL mean / p50 / p99 (ms) | p99/p50 ITL |"),
            "|---|---|---|---|---|---|---|---|---|"]

    def trio(s: dict) -> str:
        return " / ".join("–" if s[k] is None else f"{s[k]:.0f}" for k in ("mean", "p50", "p99"))

    for run in report["runs"]:
        r, itl = run["result"], run["result"]["itl_ms"]
        ratio = f"{itl['p99'] / itl['p50']:.2f}" if itl["p50"] else "–"
        rows.append(f"| {run['load']} | {r['requests']} | {r['failed']} | {r['request_throughput']:.2f} | "
                    f"{r['output_throughput']:.1f} | {trio(r['ttft_ms'])} | {trio(r['tpot_ms'])} | "
                    f"{trio(itl)} | {ratio} |")
    hw = report["hardware"]
    return "\n".join([
        f"## Serving benchmark ({report['model']}, WebSocket API)", "",
        f"Command: `{report['command']}`", "",
        (f"Server: `{report['server_command']}`" if report.get("server_command")
         else f"Server: {report['url']}"), "",
        f"Hardware: {hw['cpu']}, {hw['cores']} cores; load average before/after: "
        f"{report['loadavg_before']} / {report['loadavg_after']}", "",
        (f"Workload: ShareGPT first turns (chat template applied), {report['max_tokens']} output tokens "
         "per request (ignore_eos), greedy."), "", *rows, ""])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", default=None, help="target a running server (ws://host:port/v1/ws)")
    p.add_argument("--api-key", default=os.environ.get("SPECSERVE_API_KEY"))
    p.add_argument("--model", default=None, help="model for the server this script starts (default model)")
    p.add_argument("--server-args", default="--config configs/cpu-default.yaml",
                   help="flags for the server this script starts")
    p.add_argument("--concurrency", type=int, nargs="*", default=[], help="fixed-concurrency runs")
    p.add_argument("--request-rate", type=float, nargs="*", default=[], help="Poisson-arrival runs (req/s)")
    p.add_argument("--num-prompts", type=int, nargs="+", default=[32],
                   help="requests per run (one value, or one per run in the order given)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--max-prompt-chars", type=int, default=2000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=None, help="JSON results")
    p.add_argument("--md", type=Path, default=None, help="markdown table")
    args = p.parse_args(argv)
    loads = [("concurrency", c) for c in args.concurrency] + [("rate", r) for r in args.request_rate]
    if not loads:
        p.error("give --concurrency and/or --request-rate")
    nums = args.num_prompts if len(args.num_prompts) == len(loads) else [args.num_prompts[0]] * len(loads)
    prompts_all = load_prompts(max(nums) + 1, args.max_prompt_chars, args.seed)

    server = None
    if args.url is None:
        log = Path(tempfile.mkstemp(prefix="specserve-serving-", suffix=".log")[1])
        print(f"server log: {log}", flush=True)
        server = ServerProcess(args.model, shlex.split(args.server_args), log)
    url = args.url or server.url
    env = {k: os.environ[k] for k in ENV_KEYS if k in os.environ}
    prefix = "".join(f"{k}={shlex.quote(v)} " for k, v in env.items())
    words = [sys.argv[0], *(argv or sys.argv[1:])]
    report = {"command": prefix + "python " + " ".join(shlex.quote(a) for a in words),
              "env": env,
              "server_command": (" ".join(server.cmd[2:]).replace("specserve.cli", "specserve", 1)
                                 if server else None),
              "url": url, "model": args.model or "SmolLM2-135M-Instruct", "max_tokens": args.max_tokens,
              "hardware": hardware(), "loadavg_before": [round(x, 2) for x in os.getloadavg()], "runs": []}
    try:
        asyncio.run(run_concurrency(url, prompts_all[-1:], 1, 8, args.api_key))  # warm-up
        for (kind, value), num in zip(loads, nums):
            prompts = prompts_all[:num]
            if kind == "concurrency":
                results, duration = asyncio.run(
                    run_concurrency(url, prompts, value, args.max_tokens, args.api_key))
            else:
                results, duration = asyncio.run(
                    run_rate(url, prompts, value, args.max_tokens, args.api_key, args.seed))
            summary = summarize(results, duration)
            label = f"concurrency {value}" if kind == "concurrency" else f"rate {value}/s"
            report["runs"].append({"load": label, kind: value, "result": summary,
                                   "requests": [asdict(r) | {"itl": None} for r in results]})
            s = summary
            print(f"{label}: {s['completed']}/{s['requests']} ok, {s['request_throughput']:.2f} req/s, "
                  f"{s['output_throughput']:.1f} tok/s, TTFT p50 {_ms(s['ttft_ms']['p50'])} ms, "
                  f"ITL p50/p99 {_ms(s['itl_ms']['p50'])}/{_ms(s['itl_ms']['p99'])} ms", flush=True)
    finally:
        if server is not None:
            server.stop()
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
