"""Fused neox-style rotary embedding of queries and keys (one program per token, all heads).

Same rotation as `specserve.models.layers.basic.RotaryEmbedding`: `cos`/`sin` tables are
`[max_positions, head_dim]` with both halves equal, and x -> x * cos + rotate_half(x) * sin, where
rotate_half(x) = cat(-x2, x1). The kernel computes in fp32 and rounds once.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from specserve.kernels.pdl import pdl_args, pdl_prologue


@triton.jit
def _rotate_heads(x_ptr, out_ptr, stride_xt, stride_xh, stride_ot, stride_oh, token, cos, sin,
                  num_heads, HALF: tl.constexpr, HEADS_PAD: tl.constexpr, HALF_PAD: tl.constexpr):
    heads = tl.arange(0, HEADS_PAD)[:, None]
    cols = tl.arange(0, HALF_PAD)[None, :]
    mask = (heads < num_heads) & (cols < HALF)
    src = x_ptr + token * stride_xt + heads * stride_xh + cols
    x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
    dst = out_ptr + token * stride_ot + heads * stride_oh + cols
    tl.store(dst, (x1 * cos - x2 * sin).to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(dst + HALF, (x2 * cos + x1 * sin).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_embedding_kernel(
    positions_ptr,  # [num_tokens] int64
    q_ptr, k_ptr,  # [num_tokens, num_heads | num_kv_heads, head_dim]
    q_out_ptr, k_out_ptr,  # same shapes, may alias q/k (in place)
    cos_ptr, sin_ptr,  # [max_positions, head_dim] fp32
    num_heads, num_kv_heads,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_qot, stride_qoh, stride_kot, stride_koh, stride_cos,
    HALF: tl.constexpr, HALF_PAD: tl.constexpr, Q_HEADS_PAD: tl.constexpr, K_HEADS_PAD: tl.constexpr, PDL: tl.constexpr,
):
    pdl_prologue(PDL)
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + token)
    cols = tl.arange(0, HALF_PAD)[None, :]
    cos = tl.load(cos_ptr + pos * stride_cos + cols, mask=cols < HALF, other=0.0)
    sin = tl.load(sin_ptr + pos * stride_cos + cols, mask=cols < HALF, other=0.0)
    _rotate_heads(q_ptr, q_out_ptr, stride_qt, stride_qh, stride_qot, stride_qoh, token, cos, sin,
                  num_heads, HALF, Q_HEADS_PAD, HALF_PAD)
    _rotate_heads(k_ptr, k_out_ptr, stride_kt, stride_kh, stride_kot, stride_koh, token, cos, sin,
                  num_kv_heads, HALF, K_HEADS_PAD, HALF_PAD)


def rotary_embedding(
    positions: torch.Tensor,  # [num_tokens] int64
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    cos: torch.Tensor,  # [max_positions, head_dim] fp32
    sin: torch.Tensor,  # [max_positions, head_dim] fp32
    inplace: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate query and key by their positions; returns (query, key) (the inputs when `inplace`)."""
    if query.dim() != 3 or key.dim() != 3 or query.shape[0] != key.shape[0] or query.shape[2] != key.shape[2]:
        raise ValueError(f"query [T, H, D] and key [T, KVH, D] do not match: {tuple(query.shape)}, {tuple(key.shape)}")
    head_dim = query.shape[2]
    if head_dim % 2 or cos.shape != sin.shape or cos.dim() != 2 or cos.shape[1] != head_dim:
        raise ValueError(f"cos/sin must be [max_positions, {head_dim}] (even head_dim), got {tuple(cos.shape)}")
    if cos.stride() != sin.stride() or cos.stride(1) != 1 or query.stride(2) != 1 or key.stride(2) != 1:
        raise ValueError("query, key, cos and sin must be contiguous in their last dim (cos and sin alike)")
    if positions.dtype != torch.int64 or positions.shape != (query.shape[0],):
        raise ValueError(f"positions must be int64 [{query.shape[0]}], got {positions.dtype} {tuple(positions.shape)}")
    q_out = query if inplace else torch.empty_like(query)
    k_out = key if inplace else torch.empty_like(key)
    if query.shape[0]:
        half = head_dim // 2
        _rotary_embedding_kernel[(query.shape[0],)](
            positions, query, key, q_out, k_out, cos, sin, query.shape[1], key.shape[1],
            query.stride(0), query.stride(1), key.stride(0), key.stride(1), q_out.stride(0), q_out.stride(1),
            k_out.stride(0), k_out.stride(1), cos.stride(0),
            HALF=half, HALF_PAD=triton.next_power_of_2(half), Q_HEADS_PAD=triton.next_power_of_2(query.shape[1]),
            K_HEADS_PAD=triton.next_power_of_2(key.shape[1]), num_warps=4, **pdl_args(query.device))
    return q_out, k_out


def ref_rotary_embedding(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor, cos: torch.Tensor,
                         sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The oracle, in fp32: x * cos + rotate_half(x) * sin."""
    c, s = cos[positions][:, None, :], sin[positions][:, None, :]

    def rotate(x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        half = x.shape[-1] // 2
        return (xf * c + torch.cat((-xf[..., half:], xf[..., :half]), dim=-1) * s).to(x.dtype)

    return rotate(query), rotate(key)
