"""Timing helper shared by the benchmarks."""
from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch


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
