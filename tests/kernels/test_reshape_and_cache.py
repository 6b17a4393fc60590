"""reshape_and_cache (Triton) against ref_reshape_and_cache (plain PyTorch)."""
from __future__ import annotations

import pytest
import torch

from specserve.kernels import ref_reshape_and_cache, reshape_and_cache

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def make_case(num_tokens: int, num_kv_heads: int, head_dim: int, block_size: int, num_blocks: int,
              dtype: torch.dtype, fused: bool, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    if fused:  # key/value as strided views of one fused qkv projection, as the model produces them
        qkv = torch.randn(num_tokens, 3 * num_kv_heads * head_dim, generator=gen).to(dtype).to(DEVICE)
        key = qkv[:, num_kv_heads * head_dim:2 * num_kv_heads * head_dim].view(num_tokens, num_kv_heads, head_dim)
        value = qkv[:, 2 * num_kv_heads * head_dim:].view(num_tokens, num_kv_heads, head_dim)
    else:
        key = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).to(dtype).to(DEVICE)
        value = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).to(dtype).to(DEVICE)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[::3] = -1  # padded rows of a CUDA-graph batch
    cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(dtype).to(DEVICE)
    return key, value, cache, slots.to(DEVICE)


@pytest.mark.parametrize("num_kv_heads, head_dim, fused", [(2, 16, False), (3, 24, True)])
def test_writes_exactly_the_mapped_slots(num_kv_heads, head_dim, fused):
    key, value, cache, slots = make_case(7, num_kv_heads, head_dim, 4, 5, torch.float32, fused)
    expected = cache.clone()
    ref_reshape_and_cache(key, value, expected, slots)
    reshape_and_cache(key, value, cache, slots)
    assert torch.equal(cache, expected)


def test_bad_inputs_raise_clear_errors():
    key = torch.zeros(3, 2, 16)
    cache = torch.zeros(2, 4, 4, 2, 16)
    with pytest.raises(ValueError, match="slot_mapping must be int64"):
        reshape_and_cache(key, key, cache, torch.zeros(3, dtype=torch.int32))
    with pytest.raises(ValueError, match="kv_cache must be"):
        reshape_and_cache(key, key, torch.zeros(2, 4, 4, 1, 16), torch.zeros(3, dtype=torch.int64))
    with pytest.raises(ValueError, match="dtype"):
        reshape_and_cache(key.half(), key.half(), cache, torch.zeros(3, dtype=torch.int64))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("num_kv_heads, head_dim", [(8, 128), (3, 64), (2, 80)])
def test_gpu_sweep(dtype, block_size, num_kv_heads, head_dim):
    key, value, cache, slots = make_case(1000, num_kv_heads, head_dim, block_size, 100, dtype, fused=True)
    expected = cache.clone()
    ref_reshape_and_cache(key, value, expected, slots)
    reshape_and_cache(key, value, cache, slots)
    assert torch.equal(cache, expected)
