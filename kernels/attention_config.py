"""Launch choices for the paged attention kernels: tile shapes, warps, pipeline depth, split-K factor.

Everything here is a pure function of python ints, so the choice is the same at CUDA-graph capture
and at replay. Choices come from the sweeps of `bench/kernel_bench.py --sweep` on an H200
(bench/results/kernels_gpu.md).
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import triton

MIN_TOKENS_PER_SPLIT = 256  # below this a split's fixed cost (q load, partial store, reduce) dominates
MAX_SPLITS = 64
PROGRAMS_PER_SM = 2  # split the KV range until the short launch has about this many programs per SM


@dataclass(frozen=True, slots=True)
class KernelConfig:
    block_m: int  # rows per program = query tokens x query heads of one kv head (>= 16 for tl.dot)
    tile_n: int  # KV positions per inner-loop step
    num_warps: int
    num_stages: int


@lru_cache(maxsize=1024)
def select_configs(num_tokens: int, num_reqs: int, num_kv_heads: int, qpk: int, head_dim: int,
                   elem_size: int, max_query_len: int, max_seq_len: int,
                   num_sms: int) -> tuple[KernelConfig, KernelConfig, int]:
    """Return (short launch config, long launch config, num_splits for the short launch)."""
    qpk_pad = triton.next_power_of_2(qpk)
    wide = elem_size >= 4 or head_dim > 128  # fp32 / large heads: halve tiles to fit shared memory
    short_rows = min(64, max(16, triton.next_power_of_2(max(1, max_query_len)) * qpk_pad))
    if wide:
        short = KernelConfig(block_m=short_rows, tile_n=32, num_warps=4, num_stages=2)
        long = KernelConfig(block_m=64, tile_n=32, num_warps=4, num_stages=2)
        return short, long, _num_splits(num_reqs * num_kv_heads, max_seq_len, num_sms)
    if short_rows == 16:  # decode: bandwidth-bound, 2 warps keep enough loads in flight
        short = KernelConfig(block_m=16, tile_n=64, num_warps=2, num_stages=3)
    elif short_rows == 32:  # verification of ~1+4 tokens: longer tiles amortise the softmax
        short = KernelConfig(block_m=32, tile_n=128, num_warps=4, num_stages=2)
    else:
        short = KernelConfig(block_m=short_rows, tile_n=64, num_warps=4, num_stages=2)
    long = KernelConfig(block_m=128, tile_n=64, num_warps=4, num_stages=3)
    return short, long, _num_splits(num_reqs * num_kv_heads, max_seq_len, num_sms)


def _num_splits(programs: int, max_seq_len: int, num_sms: int) -> int:
    """Split the KV range (flash-decoding) until the short launch fills the GPU, but keep splits long."""
    target = PROGRAMS_PER_SM * num_sms
    if programs >= target:
        return 1
    by_len = max(1, max_seq_len // MIN_TOKENS_PER_SPLIT)
    return max(1, min(MAX_SPLITS, triton.next_power_of_2(-(-target // programs)), _pow2_floor(by_len)))


def _pow2_floor(n: int) -> int:
    return 1 << (max(1, n).bit_length() - 1)
