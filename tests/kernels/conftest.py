"""Kernel tests: real GPU when there is one, else the Triton interpreter on tiny cases.

TRITON_INTERPRET must be set before `@triton.jit` decorates our kernels, i.e. before
`specserve.kernels` is first imported; if another test directory imported it earlier, drop those
modules so they are decorated again in interpreter mode.
"""
from __future__ import annotations

import importlib.util
import math
import os
import pathlib
import sys
import types

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ["TRITON_INTERPRET"] = "1"
    for _name in [m for m in sys.modules if m.startswith("specserve.kernels")]:
        del sys.modules[_name]

try:
    import specserve.kernels  # noqa: F401
except ImportError:
    # not installed, or the engine's dependencies are missing (the bare GPU machine): load only what
    # these tests need, mapping kernels/ to specserve.kernels by hand
    _root = pathlib.Path(__file__).resolve().parents[2]
    for _name in [m for m in sys.modules if m == "specserve" or m.startswith("specserve.")]:
        del sys.modules[_name]
    _pkg = types.ModuleType("specserve")
    _pkg.__path__ = [str(_root / "specserve")]
    sys.modules["specserve"] = _pkg
    _spec = importlib.util.spec_from_file_location(
        "specserve.kernels", _root / "kernels" / "__init__.py",
        submodule_search_locations=[str(_root / "kernels")])
    _module = importlib.util.module_from_spec(_spec)
    sys.modules["specserve.kernels"] = _module
    _spec.loader.exec_module(_module)

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
