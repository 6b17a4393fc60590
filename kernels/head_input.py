"""An EAGLE head's fc input in one launch: row t = [RMSNorm_e(embed[input_ids[t]]), RMSNorm_h(hidden[t])].

The head's forward (spec_decode/eagle_head.py) took four or five kernels for this before its fc layer
(the embedding gather, two RMSNorms, the cat, and zeros without hidden states), several times a
drafting step. Here one program a token gathers its embedding row and normalizes it into columns
[0, h) of the output, and its hidden state into [h, 2h) (zeros without hidden states: the norm of
zeros). Each half's math is `_rms_norm_kernel`'s (`rms_norm_row`), with the same BLOCK and num_warps, so
the output equals that kernel's on the two halves bit for bit. The reference, `ref_head_input`, is
the torch ops the head runs on a CPU.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from specserve.kernels.checked import FirstUseChecked
from specserve.kernels.pdl import pdl_args, pdl_prologue
from specserve.kernels.rms_norm import ref_rms_norm, rms_norm, rms_norm_row


@triton.jit
def _norm_row(x_ptr, w_ptr, out_ptr, hidden, eps, BLOCK: tl.constexpr):
    """One row at x_ptr -> RMSNorm(x) * w at out_ptr (`rms_norm_row`)."""
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    out = rms_norm_row(tl.load(x_ptr + cols, mask=mask, other=0.0), w_ptr, cols, mask, hidden, eps)
    tl.store(out_ptr + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _head_input_kernel(
    ids_ptr,  # [num_tokens] (any stride: a column of the chain's drafts)
    embed_ptr,  # [vocab, hidden]
    hidden_ptr,  # [num_tokens, hidden] (HAS_HIDDEN)
    embed_norm_ptr,  # [hidden]
    hidden_norm_ptr,  # [hidden]
    out_ptr,  # [num_tokens, 2 * hidden]
    hidden, eps,
    stride_i, stride_e, stride_ht, stride_ot,
    HAS_HIDDEN: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr,
):
    pdl_prologue(PDL)
    row = tl.program_id(0).to(tl.int64)
    token = tl.load(ids_ptr + row * stride_i).to(tl.int64)
    out_row = out_ptr + row * stride_ot
    _norm_row(embed_ptr + token * stride_e, embed_norm_ptr, out_row, hidden, eps, BLOCK)
    if HAS_HIDDEN:
        _norm_row(hidden_ptr + row * stride_ht, hidden_norm_ptr, out_row + hidden, hidden, eps, BLOCK)
    else:
        cols = tl.arange(0, BLOCK)
        tl.store(out_row + hidden + cols, tl.zeros((BLOCK,), out_ptr.dtype.element_ty), mask=cols < hidden)


def head_input(
    input_ids: torch.Tensor,  # [num_tokens] int64 or int32 (any stride), each in [0, vocab)
    embed_weight: torch.Tensor,  # [vocab, hidden]
    hidden_states: torch.Tensor | None,  # [num_tokens, hidden], rows of any stride; None = zeros
    embed_norm_weight: torch.Tensor,  # [hidden]
    hidden_norm_weight: torch.Tensor,  # [hidden]
    eps: float,
) -> torch.Tensor:
    """[num_tokens, 2 * hidden]: cat(RMSNorm(embed_weight[input_ids], embed_norm_weight),
    RMSNorm(hidden_states, hidden_norm_weight)), in the dtype `rms_norm` gives each half. Token ids are
    not checked against the vocabulary (that would sync with the host). No host syncs."""
    if input_ids.dim() != 1 or input_ids.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"input_ids must be [num_tokens] int64 or int32, got {input_ids.dtype} "
                         f"{tuple(input_ids.shape)}")
    if embed_weight.dim() != 2 or embed_weight.stride(1) != 1:
        raise ValueError(f"embed_weight must be [vocab, hidden] with a contiguous last dim, got "
                         f"{tuple(embed_weight.shape)} stride {embed_weight.stride()}")
    num_tokens, hidden = input_ids.shape[0], embed_weight.shape[1]
    if hidden_states is not None and (hidden_states.shape != (num_tokens, hidden) or hidden_states.stride(1) != 1):
        raise ValueError(f"hidden_states must be [{num_tokens}, {hidden}] with a contiguous last dim, got "
                         f"{tuple(hidden_states.shape)} stride {hidden_states.stride()}")
    for name, w in (("embed_norm_weight", embed_norm_weight), ("hidden_norm_weight", hidden_norm_weight)):
        if w.shape != (hidden,):
            raise ValueError(f"{name} must be [{hidden}], got {tuple(w.shape)}")
    out_dtype = torch.promote_types(embed_weight.dtype, embed_norm_weight.dtype)
    hidden_dtype = hidden_states.dtype if hidden_states is not None else embed_weight.dtype
    if torch.promote_types(hidden_dtype, hidden_norm_weight.dtype) != out_dtype:
        raise ValueError(f"the two halves' dtypes differ: {out_dtype} from embed_weight {embed_weight.dtype} and "
                         f"embed_norm_weight {embed_norm_weight.dtype}, "
                         f"{torch.promote_types(hidden_dtype, hidden_norm_weight.dtype)} from hidden_states "
                         f"{hidden_dtype} and hidden_norm_weight {hidden_norm_weight.dtype}")
    out = torch.empty((num_tokens, 2 * hidden), dtype=out_dtype, device=embed_weight.device)
    if num_tokens:
        block = triton.next_power_of_2(hidden)
        has_hidden = hidden_states is not None
        _head_input_kernel[(num_tokens,)](
            input_ids, embed_weight, hidden_states if has_hidden else embed_weight, embed_norm_weight,
            hidden_norm_weight, out, hidden, eps,
            input_ids.stride(0), embed_weight.stride(0), hidden_states.stride(0) if has_hidden else 0, out.stride(0),
            HAS_HIDDEN=has_hidden, BLOCK=block, num_warps=min(16, max(1, block // 256)),  # as rms_norm's
            **pdl_args(out.device))
    return out


def _gather_norm_cat(norm, input_ids: torch.Tensor, embed_weight: torch.Tensor, hidden_states: torch.Tensor | None,
                     embed_norm_weight: torch.Tensor, hidden_norm_weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The head's input op by op: the embedding gather, `norm` on each half (zeros without hidden states), the cat."""
    e = torch.nn.functional.embedding(input_ids, embed_weight)
    if hidden_states is None:
        hidden_states = torch.zeros_like(e)
    return torch.cat([norm(e, embed_norm_weight, eps), norm(hidden_states, hidden_norm_weight, eps)], dim=-1)


def ref_head_input(*args, **kwargs) -> torch.Tensor:
    """The oracle (`head_input`'s arguments): the head's torch ops, `ref_rms_norm` on each half."""
    return _gather_norm_cat(ref_rms_norm, *args, **kwargs)


def _unfused(*args, **kwargs) -> torch.Tensor:
    """The head's CUDA ops before this kernel (`head_input`'s arguments): the gather, two `rms_norm` launches,
    the cat."""
    return _gather_norm_cat(rms_norm, *args, **kwargs)


def _close(got: torch.Tensor, want: torch.Tensor) -> bool:
    return got.shape == want.shape and got.dtype == want.dtype and \
        torch.allclose(got.float(), want.float(), rtol=1e-2, atol=1e-3)


# what the head's forward calls: the kernel, checked against the unfused ops on its first call (kernels/checked.py)
checked_head_input = FirstUseChecked("head_input", head_input, _unfused, _close)
