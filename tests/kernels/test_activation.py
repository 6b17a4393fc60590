"""silu_and_mul (Triton) against its reference and the model's SwiGLU module."""
from __future__ import annotations

import pytest
import torch

from specserve.kernels import ref_silu_and_mul, silu_and_mul
from specserve.models.layers.basic import SwiGLU

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
ATOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


def rand(*shape, dtype=torch.float32, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).mul(3).to(dtype).to(DEVICE)


def test_silu_and_mul_matches_the_swiglu_module():
    mlp = SwiGLU(16, 24).to(DEVICE)
    x = rand(5, 16)
    gate_up = mlp.gate_up_proj(x)
    gate, up = gate_up.split(24, dim=-1)
    want = torch.nn.functional.silu(gate) * up  # what SwiGLU computes without the kernel
    torch.testing.assert_close(silu_and_mul(gate_up), want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(mlp.down_proj(silu_and_mul(gate_up)), mlp(x), atol=1e-5, rtol=1e-5)


def test_silu_and_mul_strided_rows_and_empty():
    x = rand(6, 40)[::2]  # row stride 80: a view, as a slice of a bigger activation would be
    torch.testing.assert_close(silu_and_mul(x), ref_silu_and_mul(x), atol=1e-5, rtol=1e-5)
    assert silu_and_mul(rand(0, 8)).shape == (0, 4)


def test_silu_and_mul_bad_input():
    with pytest.raises(ValueError, match="2 \\* intermediate"):
        silu_and_mul(torch.zeros(3, 7))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("num_tokens, intermediate", [(1, 14336), (256, 14336), (300, 1536), (7, 100)])
def test_gpu_silu_and_mul_sweep(dtype, num_tokens, intermediate):
    x = rand(num_tokens, 2 * intermediate, dtype=dtype)
    torch.testing.assert_close(silu_and_mul(x), ref_silu_and_mul(x), atol=ATOL[dtype], rtol=1e-2)
