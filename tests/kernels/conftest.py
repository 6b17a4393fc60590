"""Kernel tests: real GPU when there is one, else the Triton interpreter on tiny cases.

TRITON_INTERPRET must be set before `@triton.jit` decorates our kernels, i.e. before
`specserve.kernels` is first imported (the editable install maps kernels/ to it; on the bare GPU
machine bench/gpu_suite.sh links specserve/kernels -> ../kernels). Nothing else imports the kernels
on a machine without CUDA; if something did, these tests stop with the reason instead of compiling
for a GPU that is not there.
"""
from __future__ import annotations

import math
import os
import sys

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    if "specserve.kernels" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
        raise pytest.UsageError("specserve.kernels was imported before tests/kernels/conftest.py could set "
                                "TRITON_INTERPRET=1: run with TRITON_INTERPRET=1, or run tests/kernels alone")
    os.environ["TRITON_INTERPRET"] = "1"

DEVICE = torch.device("cuda" if HAS_CUDA else "cpu")


def pytest_runtest_setup(item: pytest.Item) -> None:
    if item.get_closest_marker("gpu") is not None and not HAS_CUDA:
        pytest.skip("needs a CUDA GPU")


def build_paged_batch(q_lens: list[int], seq_lens: list[int], num_heads: int, num_kv_heads: int,
                      head_dim: int, block_size: int, dtype: torch.dtype, seed: int = 0,
                      device: torch.device = DEVICE, spare_blocks: int = 3) -> dict:
    """Random query + paged cache for a ragged batch; block ids shuffled, unused table entries invalid."""
    gen = torch.Generator().manual_seed(seed)
    blocks_per_req = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(blocks_per_req) + spare_blocks
    perm = torch.randperm(num_blocks, generator=gen).to(torch.int32)
    max_blocks = max(blocks_per_req) + 2
    # entries past a request's context point outside the cache: the kernel must never read them
    block_tables = torch.full((len(seq_lens), max_blocks), num_blocks + 10_000, dtype=torch.int32)
    used = 0
    for i, n in enumerate(blocks_per_req):
        block_tables[i, :n] = perm[used:used + n]
        used += n
    num_tokens = sum(q_lens)
    query = torch.randn(num_tokens, num_heads, head_dim, generator=gen).to(dtype)
    kv_cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(dtype)
    query_start_loc = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0).tolist()), dtype=torch.int32)
    return dict(query=query.to(device), kv_cache=kv_cache.to(device),
                query_start_loc=query_start_loc.to(device),
                seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
                block_tables=block_tables.to(device), scale=1.0 / math.sqrt(head_dim),
                max_query_len=max(q_lens), max_seq_len=max(seq_lens))


# ||out - ref|| / ||ref|| bounds: fp32 uses ieee dots; 16-bit inputs round P to 16 bits before P @ V
REL_TOL = {torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 1.5e-2}


def assert_close(out: torch.Tensor, ref: torch.Tensor) -> None:
    assert out.shape == ref.shape and out.dtype == ref.dtype
    assert not out.isnan().any(), "output has NaN (unwritten or bad rows)"
    err = ((out.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30)).item()
    assert err < REL_TOL[out.dtype], f"relative error {err:.3g} >= {REL_TOL[out.dtype]}"


@pytest.fixture
def paged_batch():
    return build_paged_batch


@pytest.fixture
def close():
    return assert_close
