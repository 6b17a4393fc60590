"""Fused SwiGLU activation: `silu(gate) * up` from the fused gate/up projection's output in one pass.

The projection writes [num_tokens, 2 * intermediate] (gate | up); separate `silu` and `mul` ops read
the strided halves without vectorisation and write an intermediate, about 3x the memory traffic of
this kernel (measured: ~0.7 of ~9.7 ms of a batch-256 Llama-3.1-8B decode step). Same math as
`specserve.models.layers.basic.SwiGLU`: silu in fp32, rounded to the input dtype, times `up` rounded
to the input dtype.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from specserve.kernels.pdl import pdl_args, pdl_prologue


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, intermediate, stride_xt, stride_ot, BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl_prologue(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < intermediate
    gate = tl.load(x_ptr + row * stride_xt + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_xt + intermediate + cols, mask=mask, other=0.0)
    act = (gate / (1.0 + tl.exp(-gate))).to(x_ptr.dtype.element_ty)
    out = act.to(tl.float32) * up.to(tl.float32)
    tl.store(out_ptr + row * stride_ot + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x: [num_tokens, 2 * intermediate] (gate | up) -> silu(gate) * up [num_tokens, intermediate]."""
    if x.dim() != 2 or x.shape[1] % 2 or x.stride(1) != 1:
        raise ValueError(f"x must be [num_tokens, 2 * intermediate] with a contiguous last dim, got {tuple(x.shape)}")
    num_tokens, intermediate = x.shape[0], x.shape[1] // 2
    out = torch.empty((num_tokens, intermediate), dtype=x.dtype, device=x.device)
    if num_tokens:
        block = min(1024, triton.next_power_of_2(intermediate))
        _silu_and_mul_kernel[(num_tokens, triton.cdiv(intermediate, block))](
            x, out, intermediate, x.stride(0), out.stride(0), BLOCK=block, num_warps=4, **pdl_args(x.device))
    return out


def ref_silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """The oracle: SwiGLU's activation, op by op."""
    gate, up = x.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up
