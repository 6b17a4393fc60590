"""Soak / fault / fuzz run of the server at any size (the CI sizes run in tests/server/test_soak.py and
test_fuzz.py; the load and the checks live in tests/server/soak/, docs/soak.md describes them).

    python bench/soak.py                      # CI sizes, the tiny random model
    python bench/soak.py --full               # 1000 WS + 1000 SSE streams, 2000 fuzz inputs per endpoint
    python bench/soak.py --full --model default --phases streams,kv   # the real default model

Each phase gets its own in-process uvicorn server on 127.0.0.1. Results: bench/results/soak.json and
soak.md (--out-dir). Exits 1 if any phase found a problem.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.server.harness import ServerThread, add_char_tokenizer, engine_factory  # noqa: E402
from tests.server.soak import (  # noqa: E402
    FAULT_SERVER,
    FUZZ_SERVER,
    KV_SERVER,
    STREAMS_SERVER,
    Fuzzer,
    PhaseResult,
    StreamLoad,
    phase_fault,
    phase_kv_exhaustion,
    phase_streams,
    rss_after_gc,
    run_fuzz,
)

PHASES = ("streams", "kv", "fault", "fuzz")
RSS_TARGET = 0.10  # growth after warm-up, full size


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--full", action="store_true", help="full size: 1000 WS + 1000 SSE streams, 2000 fuzz "
                   "inputs per endpoint, 48 KV-exhaustion requests (explicit flags still win)")
    p.add_argument("--model", default=None, help="model directory, or 'default' for the real default model "
                   "(default: a tiny random llama with a character tokenizer)")
    p.add_argument("--phases", default=",".join(PHASES), help=f"comma-separated subset of {','.join(PHASES)}")
    p.add_argument("--ws", type=int, help="WebSocket streams (default 60; --full 1000)")
    p.add_argument("--sse", type=int, help="SSE streams (default 60; --full 1000)")
    p.add_argument("--cancel-frac", type=float, default=0.3, help="share of streams cancelled or disconnected")
    p.add_argument("--min-tokens", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=24, help="output tokens per stream: min..max")
    p.add_argument("--kv-requests", type=int, help="requests of the KV exhaustion phase (default 12; --full 48)")
    p.add_argument("--fuzz-examples", type=int, help="generated inputs per endpoint (default 150; --full 2000)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out-dir", type=Path, default=REPO / "bench" / "results")
    args = p.parse_args(argv)
    full = args.full
    args.ws = args.ws if args.ws is not None else 1000 if full else 60
    args.sse = args.sse if args.sse is not None else 1000 if full else 60
    args.kv_requests = args.kv_requests if args.kv_requests is not None else 48 if full else 12
    args.fuzz_examples = args.fuzz_examples if args.fuzz_examples is not None else 2000 if full else 150
    args.phases = [x.strip() for x in args.phases.split(",") if x.strip()]
    bad = set(args.phases) - set(PHASES)
    if bad:
        p.error(f"unknown phases {sorted(bad)}; choose from {', '.join(PHASES)}")
    return args


def model_dir(arg: str | None, tmp: Path) -> tuple[Path, str]:
    if arg == "default":
        from specserve.models.default_model import ensure_default_model
        return ensure_default_model(), "SmolLM2-135M-Instruct"
    if arg:
        return Path(arg), Path(arg).name
    from tests.conftest import build_tiny_model
    tiny = build_tiny_model("llama", tmp / "tiny-llama")
    return add_char_tokenizer(tiny, tmp / "tiny-chat"), "tiny (random llama, 2 layers, char tokenizer)"


def start(model: Path, config: tuple[dict, dict]) -> ServerThread:
    engine_args, settings = config
    factory = engine_factory(model, in_process=True, dtype="float32", device="cpu", **engine_args)
    return ServerThread(factory, "tiny", **settings)


def with_rss(result: PhaseResult, rss_start: int, check: bool) -> PhaseResult:
    """Record the process's RSS growth over the phase (the server runs in this process)."""
    end = rss_after_gc()
    growth = (end - rss_start) / rss_start if rss_start else 0.0
    result.extra |= {"rss_start_mib": round(rss_start / 2 ** 20, 1), "rss_end_mib": round(end / 2 ** 20, 1),
                     "rss_growth_pct": round(100 * growth, 2)}
    if check and growth > RSS_TARGET:
        result.problems.append(f"RSS grew {100 * growth:.1f}% after warm-up (target < {100 * RSS_TARGET:.0f}%)")
    return result


def run_streams(model: Path, args) -> PhaseResult:
    server = start(model, STREAMS_SERVER)
    try:
        load = StreamLoad(num_ws=args.ws, num_sse=args.sse, cancel_frac=args.cancel_frac,
                          min_tokens=args.min_tokens, max_tokens=args.max_tokens, seed=args.seed)
        warm = StreamLoad(num_ws=max(10, args.ws // 10), num_sse=max(10, args.sse // 10),
                          min_tokens=args.min_tokens, max_tokens=args.max_tokens, seed=args.seed + 1)
        warmup = asyncio.run(phase_streams(server, warm))
        rss = rss_after_gc()
        result = asyncio.run(phase_streams(server, load))
        result.problems = [f"warm-up: {p}" for p in warmup.problems] + result.problems
        return with_rss(result, rss, check=args.full)
    finally:
        server.stop()


def run_kv(model: Path, args) -> PhaseResult:
    server = start(model, KV_SERVER)
    try:
        rss = rss_after_gc()
        return with_rss(asyncio.run(phase_kv_exhaustion(server, num_requests=args.kv_requests, seed=args.seed)),
                        rss, check=False)
    finally:
        server.stop()


def run_fault(model: Path, args) -> PhaseResult:
    server = start(model, FAULT_SERVER)
    try:
        return asyncio.run(phase_fault(server, seed=args.seed))
    finally:
        server.stop()


def run_fuzzing(model: Path, args) -> PhaseResult:
    server = start(model, FUZZ_SERVER)
    fuzzer = Fuzzer(server)
    result = PhaseResult("fuzz")
    t0 = time.perf_counter()
    try:
        rss = rss_after_gc()
        for target in ("ws", "completions", "chat"):
            t1 = time.perf_counter()
            run_fuzz(fuzzer, target, args.fuzz_examples, derandomize=True)
            problems = fuzzer.take_problems()
            print(f"  fuzz {target}: {fuzzer.num_inputs[target]} inputs, {len(problems)} problems, "
                  f"{time.perf_counter() - t1:.0f}s", flush=True)
            result.counts[f"{target}:inputs"] = fuzzer.num_inputs[target]
            result.counts[f"{target}:problems"] = len(problems)
            result.problems += [f"{target}: {p}" for p in problems]
        result.extra["num_canaries"] = fuzzer.num_canaries
        result.seconds = time.perf_counter() - t0
        return with_rss(result, rss, check=False)
    finally:
        fuzzer.close()
        server.stop()


RUNNERS = {"streams": run_streams, "kv": run_kv, "fault": run_fault, "fuzz": run_fuzzing}


def markdown(report: dict) -> str:
    lines = ["# Server soak / fault / fuzz", "",
             f"{report['date']}, model: {report['model']}, {report['machine']}; "
             f"`{report['command']}` ({report['seconds']:.0f} s)", "",
             "| phase | seconds | outcomes / inputs | problems | notes |", "|---|---|---|---|---|"]
    for ph in report["phases"]:
        counts = ", ".join(f"{k} {v}" for k, v in sorted(ph["counts"].items()))
        notes = ", ".join(f"{k} {v}" for k, v in ph["extra"].items())
        lines.append(f"| {ph['name']} | {ph['seconds']:.1f} | {counts} | {len(ph['problems'])} | {notes} |")
    for ph in report["phases"]:
        if ph["problems"]:
            lines += ["", f"## {ph['name']}: problems", ""]
            lines += [f"- `{p[:400]}`" for p in ph["problems"][:60]]
            if len(ph["problems"]) > 60:
                lines.append(f"- ... and {len(ph['problems']) - 60} more (soak.json)")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        model, model_name = model_dir(args.model, Path(tmp))
        phases = []
        for name in args.phases:
            print(f"phase {name} ...", flush=True)
            result = RUNNERS[name](model, args)
            phases.append(result.as_dict())
            print(f"phase {name}: {result.seconds:.1f}s, {len(result.problems)} problems; {result.counts}; "
                  f"{result.extra}", flush=True)
            for p in result.problems[:10]:
                print(f"  - {p[:300]}", flush=True)
    report = {"date": time.strftime("%Y-%m-%d %H:%M"), "model": model_name,
              "machine": f"{platform.machine()} {platform.processor() or platform.platform()}",
              "command": "python bench/soak.py " + " ".join(sys.argv[1:] if argv is None else argv),
              "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
              "seconds": time.perf_counter() - t0, "phases": phases}
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "soak.json").write_text(json.dumps(report, indent=1) + "\n")
    (args.out_dir / "soak.md").write_text(markdown(report))
    print(f"wrote {args.out_dir / 'soak.json'} and soak.md ({report['seconds']:.0f}s)")
    return 1 if any(ph["problems"] for ph in phases) else 0


if __name__ == "__main__":
    sys.exit(main())
