"""What a target forward over N tokens costs, relative to a one-token decode step: the cost side
of adaptive k (specserve/spec_decode/adaptive.py).

Two sources:
- analytic: `1 + N / compute_bound_tokens` (read the weights once, plus compute per token; the
  ridge point `compute_bound_tokens` is where both take equally long). The default on CUDA, and
  whenever `compute_bound_tokens` is given (then k is a pure function of the inputs).
- measured: on the CPU, by default, a short profile at start-up times forwards of 1 to 65 tokens
  and interpolates. CPUs are full of cliffs no ridge point describes: on the 2-core
  AVX2 machine here a 2-token fp32 forward costs 1.5 one-token forwards (BLAS GEMV -> GEMM) while
  5 tokens cost 1.8, and bf16 (no native bf16 math) adds half a step per token.
"""
from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from specserve.engine.executor import ModelExecutor

logger = logging.getLogger(__name__)

PROFILE_SIZES = (1, 2, 3, 5, 9, 17, 33, 65)  # past 65: the last slope (compute bound by then)


class StepCosts:
    def __init__(self, compute_bound_tokens: int, table: list[tuple[int, float]] | None = None) -> None:
        """table: (num_tokens, cost relative to 1 token), ascending, from `profile_forward`."""
        self.compute_bound_tokens = compute_bound_tokens
        self.table = table

    def __call__(self, num_tokens: int) -> float:
        if not self.table:
            return 1.0 + num_tokens / self.compute_bound_tokens
        points = self.table
        if num_tokens <= points[0][0]:
            return points[0][1]
        for (n0, c0), (n1, c1) in zip(points, points[1:]):
            if num_tokens <= n1:
                return c0 + (c1 - c0) * (num_tokens - n0) / (n1 - n0)
        (n0, c0), (n1, c1) = points[-2], points[-1]  # past the table: the last slope
        return c1 + (c1 - c0) / (n1 - n0) * (num_tokens - n1)


@torch.inference_mode()
def profile_forward(executor: ModelExecutor, sizes: tuple[int, ...] = PROFILE_SIZES, reps: int = 3
                    ) -> dict[int, float]:
    """Seconds per forward (with logits for every token, as verification needs) of 1 request of N
    tokens, for N in `sizes`: the best of `reps` at every size. One slow forward must not set a cost:
    the slope from 17 to 33 tokens decides whether drafts pay at 16 requests, and timed once a 33-token
    forward put it at up to 2.3x against ~1.45x in 5 of 24 profiles on a 2-core CPU (BENCHMARKS.md).
    Writes KV into the first blocks: call it before serving any request."""
    device, block_size = executor.device, executor.block_size

    def once(n: int) -> float:
        ids = torch.zeros(n, dtype=torch.long, device=device)
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        executor.compute_logits(executor.forward_tokens(ids, [n], [n], [list(range(-(-n // block_size)))]))
        if device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - t0

    once(sizes[0])  # warm-up
    return {n: min(once(n) for _ in range(reps)) for n in sizes}


def measured_costs(times: dict[int, float], compute_bound_tokens: int) -> StepCosts:
    """A cost table from `profile_forward` times (made non-decreasing: noise must not make more
    tokens look cheaper)."""
    base = times[min(times)]
    table, last = [], 0.0
    for n in sorted(times):
        last = max(last, times[n] / base)
        table.append((n, last))
    logger.info("speculative step costs (tokens: x one-token forward): %s",
                ", ".join(f"{n}: {c:.2f}" for n, c in table))
    return StepCosts(compute_bound_tokens, table)
