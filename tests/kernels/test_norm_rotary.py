"""rms_norm and rotary_embedding (Triton) against their references and the model's torch modules."""
from __future__ import annotations

import pytest
import torch

from specserve.kernels import ref_rms_norm, ref_rotary_embedding, rms_norm, rotary_embedding
from specserve.models.layers.basic import RMSNorm, RotaryEmbedding

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
# bf16 outputs may differ from the op-by-op reference by one rounding step
ATOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


def rand(*shape, dtype=torch.float32, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype).to(DEVICE)


@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_matches_model_module(with_residual):
    x, res = rand(5, 48), rand(5, 48, seed=1)
    module = RMSNorm(48, 1e-6).to(DEVICE)
    module.weight.data = rand(48, seed=2)
    args = (x, res) if with_residual else (x,)
    got = rms_norm(x, module.weight, 1e-6, *args[1:])
    want = module(*args)
    for g, w in zip(got if with_residual else [got], want if with_residual else [want]):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)


def test_rotary_matches_model_module_in_place():
    rope = RotaryEmbedding(32, 64, 10000.0, None).to(DEVICE)
    q, k = rand(4, 3, 32), rand(4, 1, 32, seed=1)
    positions = torch.tensor([0, 7, 63, 5], device=DEVICE)
    want_q, want_k = rope(positions, q, k)
    got_q, got_k = rotary_embedding(positions, q, k, rope.cos, rope.sin, inplace=True)
    assert got_q.data_ptr() == q.data_ptr()
    torch.testing.assert_close(got_q, want_q, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_k, want_k, atol=1e-5, rtol=1e-5)


def test_bad_inputs_raise_clear_errors():
    with pytest.raises(ValueError, match="weight must be"):
        rms_norm(torch.zeros(2, 8), torch.zeros(4), 1e-6)
    with pytest.raises(ValueError, match="positions must be int64"):
        rotary_embedding(torch.zeros(2, dtype=torch.int32), torch.zeros(2, 2, 8), torch.zeros(2, 1, 8),
                         torch.zeros(4, 8), torch.zeros(4, 8))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("num_tokens, hidden", [(1, 4096), (300, 576), (64, 2048)])
def test_gpu_rms_norm_sweep(dtype, num_tokens, hidden):
    x, res, w = rand(num_tokens, hidden, dtype=dtype), rand(num_tokens, hidden, dtype=dtype, seed=1), \
        rand(hidden, dtype=dtype, seed=2)
    torch.testing.assert_close(rms_norm(x, w, 1e-5), ref_rms_norm(x, w, 1e-5), atol=ATOL[dtype], rtol=1e-2)
    (out, new_res), (ref_out, ref_res) = rms_norm(x, w, 1e-5, res), ref_rms_norm(x, w, 1e-5, res)
    assert torch.equal(new_res, ref_res)
    torch.testing.assert_close(out, ref_out, atol=ATOL[dtype], rtol=1e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("num_heads, num_kv_heads, head_dim", [(32, 8, 128), (9, 3, 64)])
def test_gpu_rotary_sweep(dtype, num_heads, num_kv_heads, head_dim):
    rope = RotaryEmbedding(head_dim, 8192, 500000.0, None).to(DEVICE)
    qkv = rand(257, (num_heads + 2 * num_kv_heads) * head_dim, dtype=dtype)  # q/k as views of fused qkv
    q = qkv[:, :num_heads * head_dim].view(257, num_heads, head_dim)
    k = qkv[:, num_heads * head_dim:(num_heads + num_kv_heads) * head_dim].view(257, num_kv_heads, head_dim)
    positions = torch.randint(0, 8192, (257,), device=DEVICE)
    got = rotary_embedding(positions, q, k, rope.cos, rope.sin)
    want = ref_rotary_embedding(positions, q, k, rope.cos, rope.sin)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=ATOL[dtype], rtol=1e-2)
