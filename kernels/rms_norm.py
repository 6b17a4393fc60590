"""Fused RMSNorm with optional residual add: one read and one write of the activations.

Same math as `specserve.models.layers.basic.RMSNorm`: with a residual, `x = x + residual` (rounded
to the input dtype) becomes the new residual; the norm is computed in fp32, rounded to the input
dtype, then scaled by `weight`.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from specserve.kernels.pdl import pdl_args, pdl_prologue


@triton.jit
def rms_norm_row(x, w_ptr, cols, mask, hidden, eps):
    """One row's RMSNorm(x) * w in fp32, x loaded in the input dtype (masked columns 0): the norm in fp32,
    rounded to x's dtype, then scaled. The row math of `_rms_norm_kernel` and of `head_input`'s kernel."""
    h = x.to(tl.float32)
    h = h * tl.rsqrt(tl.sum(h * h, 0) / hidden + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    return w.to(tl.float32) * h.to(x.dtype).to(tl.float32)


@triton.jit
def _rms_norm_kernel(
    x_ptr,  # [num_tokens, hidden]
    residual_ptr,  # [num_tokens, hidden] (HAS_RESIDUAL)
    weight_ptr,  # [hidden]
    out_ptr,  # [num_tokens, hidden]
    residual_out_ptr,  # [num_tokens, hidden] (HAS_RESIDUAL)
    hidden, eps,
    stride_xt, stride_rt, stride_ot, stride_rot,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr,
):
    pdl_prologue(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    x = tl.load(x_ptr + row * stride_xt + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        x = (x.to(tl.float32) + tl.load(residual_ptr + row * stride_rt + cols, mask=mask, other=0.0).to(
            tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(residual_out_ptr + row * stride_rot + cols, x, mask=mask)
    out = rms_norm_row(x, weight_ptr, cols, mask, hidden, eps)
    tl.store(out_ptr + row * stride_ot + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(
    x: torch.Tensor,  # [num_tokens, hidden]
    weight: torch.Tensor,  # [hidden]
    eps: float,
    residual: torch.Tensor | None = None,  # [num_tokens, hidden]
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm(x) or, with `residual`, (RMSNorm(x + residual), x + residual). No host syncs."""
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"x must be [num_tokens, hidden] with a contiguous last dim, got {tuple(x.shape)}")
    if weight.shape != (x.shape[1],):
        raise ValueError(f"weight must be [{x.shape[1]}], got {tuple(weight.shape)}")
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype or residual.stride(1) != 1):
        raise ValueError(f"residual must match x ({tuple(x.shape)}, {x.dtype}) with a contiguous last dim")
    num_tokens, hidden = x.shape
    out_dtype = torch.promote_types(x.dtype, weight.dtype)
    out = torch.empty((num_tokens, hidden), dtype=out_dtype, device=x.device)
    residual_out = torch.empty_like(x) if residual is not None else out
    if num_tokens:
        block = triton.next_power_of_2(hidden)
        _rms_norm_kernel[(num_tokens,)](
            x, residual if residual is not None else x, weight, out, residual_out, hidden, eps,
            x.stride(0), residual.stride(0) if residual is not None else 0, out.stride(0), residual_out.stride(0),
            HAS_RESIDUAL=residual is not None, BLOCK=block, num_warps=min(16, max(1, block // 256)),
            **pdl_args(x.device))
    return out if residual is None else (out, residual_out)


def ref_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
                 ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """The oracle: basic.RMSNorm's math, op by op."""
    if residual is not None:
        x = x + residual
        residual = x
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    h = weight * h.to(x.dtype)
    return h if residual is None else (h, residual)
