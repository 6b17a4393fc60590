"""Helpers shared by the benchmarks: timing, and the arguments that say which engine to build."""
from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch


def host_probe() -> float:
    """Milliseconds a fixed piece of pure Python takes (the best of three): this process's host speed,
    which on a shared machine varies between processes and so sets the pace of host-bound steps."""
    best = float("inf")
    for _ in range(3):
        t = time.perf_counter()
        sum(i * i % 7 for i in range(300_000))
        best = min(best, time.perf_counter() - t)
    return round(1000 * best, 2)


def median_seconds(fn: Callable[[], object], iters: int, device: torch.device,
                   before_each: Callable[[], object] | None = None) -> float:
    """Median seconds of `fn` over `iters` calls after 3 warm-up calls, the device synchronized
    around each; `before_each` runs untimed before each call (e.g. a barrier, so the ranks start together)."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            torch.cuda.synchronize()
        if before_each is not None:
            before_each()
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def engine_parser(doc: str) -> argparse.ArgumentParser:
    """A parser with the model and device arguments of a benchmark that builds one engine
    (default: 8B shapes on a GPU)."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--model", default="llama-3.1-8b")
    ap.add_argument("--load-format", default="auto")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--enforce-eager", action="store_true")
    return ap
