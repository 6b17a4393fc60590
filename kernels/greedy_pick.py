"""The greedy draft of each row of logits in one launch: out[i] = vocab[argmax(logits[i])] (or the argmax
itself without a vocabulary), written where the caller says (a column of the chain's drafts).

An EAGLE chain step on a GPU (spec_decode/eagle_chain.py) took three kernels for this after its LM
head: torch's argmax (a generic reduction: ~10 us for one row of 8,192 on an H100), the draft
vocabulary's lookup and the copy into the drafts' column; at one request a chain is about a hundred
tiny kernels back to back, so each is time off a drafting step (on an H100 this one takes ~8 us a
chain step where those three took ~14). Here one program reads its row in
chunks of BLOCK and keeps the first index of the largest value, as torch.argmax does (rows without
NaN; exact: values are compared in their own dtype, widened to fp32, which changes no order).
The reference, `ref_greedy_pick`, is the torch ops it replaces.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 4096


@triton.jit(do_not_specialize=["n"])
def _greedy_pick_kernel(x_ptr, vocab_ptr, out_ptr, n, stride_x, stride_out,
                        HAS_VOCAB: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    best_val = tl.full((), float("-inf"), tl.float32)
    best_idx = tl.full((), 0, tl.int64)
    for start in range(0, n, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        v = tl.load(x_ptr + row * stride_x + offs, mask=offs < n, other=float("-inf")).to(tl.float32)
        m = tl.max(v, axis=0)
        # the first index of the chunk's largest value (a later chunk wins only with a larger one)
        i = tl.min(tl.where(v == m, offs, n), axis=0).to(tl.int64)
        better = m > best_val
        best_idx = tl.where(better, i, best_idx)
        best_val = tl.where(better, m, best_val)
    if HAS_VOCAB:
        best_idx = tl.load(vocab_ptr + best_idx)
    tl.store(out_ptr + row * stride_out, best_idx)


def greedy_pick(logits: torch.Tensor, out: torch.Tensor, vocab: torch.Tensor | None = None) -> torch.Tensor:
    """logits [R, V] (rows with unit stride along V), out [R] int64 (any stride: a column of a larger
    tensor), vocab [V] int64 or None -> out, holding vocab[argmax(row)] (or the argmax)."""
    rows, n = logits.shape
    if logits.stride(1) != 1 or out.shape != (rows,) or out.dtype != torch.int64:
        raise ValueError(f"greedy_pick: logits [R, V] with unit stride along V and out int64 [R], got "
                         f"{tuple(logits.shape)} stride {logits.stride()} and {out.dtype} {tuple(out.shape)}")
    if rows:
        _greedy_pick_kernel[(rows,)](logits, vocab if vocab is not None else out, out, n, logits.stride(0),
                                     out.stride(0), HAS_VOCAB=vocab is not None, BLOCK=BLOCK, num_warps=8)
    return out


def ref_greedy_pick(logits: torch.Tensor, out: torch.Tensor, vocab: torch.Tensor | None = None) -> torch.Tensor:
    picked = logits.argmax(dim=-1)
    out.copy_(vocab[picked] if vocab is not None else picked)
    return out
