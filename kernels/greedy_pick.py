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

`linear_greedy_pick` does the same from the head's output and a float LM head (out[i] =
vocab[argmax(hidden[i] @ weight.T)]) without the logits: one program a block of BLOCK_N vocabulary
rows (256 programs for the default model's 8,192 x 576 draft rows) computes its logits, rounds them
to the weights' dtype (what torch's product returns: the same order as the eager path's) and keeps
its first largest, and `greedy_pick` picks the first of those per row (the partial's index read
back through IDX), then looks it up. Traced in a chain on an H100 (k = 4, one request): its product
takes what torch's took (~15.5 us a step), and the pick over 256 partials ~2 us where the pick over
8,192 logits took ~8 us. Its reference, `ref_linear_greedy_pick`, is the torch product and
`ref_greedy_pick`. Rows past SPLIT_ABOVE (an 8B head's 32,768 draft rows) are split over programs
first: one row of 32,768 bf16 logits 4.6 us against torch's argmax's 12.1 us (H100, alone). For
graphs: launched eagerly, as a verification's argmax over 5 x 49,152 logits (5.1 against 16.9 us
of device work), its two launches took ~0.08 ms more host time a drafting step than torch's argmax.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from specserve.kernels.pdl import pdl_args, pdl_prologue

BLOCK = 4096
SPLIT_ABOVE, SPLIT_BLOCK = 2 * BLOCK, 2048  # a draft vocabulary's 8,192 stay one launch
# linear_greedy_pick pays over a few rows (a chain step of a few requests); over more, each block of
# 16 rows reads the weights again and torch's product wins (H100, 8,192 x 576 bf16: 6.5 against 7.2 us
# at 1-4 rows, 10 against 7.7 at 64)
MAX_FUSED_ROWS = 16


@triton.jit
def _first_max(v, offs, n):
    """The largest of the chunk v (fp32) and the first of its indices offs holding it (n: none)."""
    m = tl.max(v, axis=0)
    return m, tl.min(tl.where(v == m, offs, n), axis=0).to(tl.int64)


@triton.jit(do_not_specialize=["n"])
def _greedy_pick_kernel(x_ptr, idx_ptr, vocab_ptr, out_ptr, n, stride_x, stride_out,
                        HAS_IDX: tl.constexpr, HAS_VOCAB: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl_prologue(PDL)
    row = tl.program_id(0).to(tl.int64)
    best_val = tl.full((), float("-inf"), tl.float32)
    best_idx = tl.full((), 0, tl.int64)
    for start in range(0, n, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        v = tl.load(x_ptr + row * stride_x + offs, mask=offs < n, other=float("-inf")).to(tl.float32)
        m, i = _first_max(v, offs, n)
        better = m > best_val  # a later chunk wins only with a larger value: the first index stays
        best_idx = tl.where(better, i, best_idx)
        best_val = tl.where(better, m, best_val)
    if HAS_IDX:  # x holds partial maxima: the index is their partial argmax's
        best_idx = tl.load(idx_ptr + row * stride_x + best_idx)
    if HAS_VOCAB:
        best_idx = tl.load(vocab_ptr + best_idx)
    tl.store(out_ptr + row * stride_out, best_idx)


@triton.jit(do_not_specialize=["n"])
def _chunk_max_kernel(x_ptr, val_ptr, idx_ptr, n, stride_x, num_chunks, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """Program (row, c): the largest value of the row's chunk c and its first index, at [row, c]."""
    pdl_prologue(PDL)
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    offs = chunk * BLOCK + tl.arange(0, BLOCK)
    v = tl.load(x_ptr + row * stride_x + offs, mask=offs < n, other=float("-inf")).to(tl.float32)
    m, i = _first_max(v, offs, n)
    tl.store(val_ptr + row * num_chunks + chunk, m)
    tl.store(idx_ptr + row * num_chunks + chunk, i)


def greedy_pick(logits: torch.Tensor, out: torch.Tensor, vocab: torch.Tensor | None = None) -> torch.Tensor:
    """logits [R, V] (rows with unit stride along V), out [R] int64 (any stride: a column of a larger
    tensor), vocab [V] int64 or None -> out, holding vocab[argmax(row)] (or the argmax). Rows longer
    than SPLIT_ABOVE (a large draft vocabulary) are split over programs of
    SPLIT_BLOCK values each, then their maxima picked: two launches, where one program a row would
    read it alone."""
    rows, n = logits.shape
    if logits.stride(1) != 1 or out.shape != (rows,) or out.dtype != torch.int64:
        raise ValueError(f"greedy_pick: logits [R, V] with unit stride along V and out int64 [R], got "
                         f"{tuple(logits.shape)} stride {logits.stride()} and {out.dtype} {tuple(out.shape)}")
    if rows and n > SPLIT_ABOVE:
        num_chunks = triton.cdiv(n, SPLIT_BLOCK)
        val, idx = _partials(rows, num_chunks, logits.device)
        _chunk_max_kernel[(rows, num_chunks)](logits, val, idx, n, logits.stride(0), num_chunks, BLOCK=SPLIT_BLOCK,
                                              num_warps=4, **pdl_args(logits.device))
        _launch_pick(val, idx, out, vocab)
    elif rows:
        _launch_pick(logits, None, out, vocab)
    return out


def _partials(rows: int, num: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Buffers for each row's partial maxima [rows, num] fp32 and their first indices [rows, num] int64."""
    return (torch.empty(rows, num, dtype=torch.float32, device=device),
            torch.empty(rows, num, dtype=torch.int64, device=device))


def _launch_pick(x: torch.Tensor, idx: torch.Tensor | None, out: torch.Tensor, vocab: torch.Tensor | None) -> None:
    rows, n = x.shape
    _greedy_pick_kernel[(rows,)](x, idx if idx is not None else out, vocab if vocab is not None else out, out, n,
                                 x.stride(0), out.stride(0), HAS_IDX=idx is not None, HAS_VOCAB=vocab is not None,
                                 BLOCK=BLOCK, num_warps=8, **pdl_args(x.device))


@triton.jit(do_not_specialize=["rows", "n"])
def _linear_max_kernel(h_ptr, w_ptr, val_ptr, idx_ptr, rows, n, k, stride_h, stride_w, num_blocks,
                       IEEE: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       PDL: tl.constexpr):
    """Program (b, p): rows p * BLOCK_R.. of hidden against weight rows b * BLOCK_N..: each row's
    largest logit there and the first index holding it, at [row, b] of val / idx."""
    pdl_prologue(PDL)
    pid_n = tl.program_id(0)
    r = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    c = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_R, BLOCK_N), tl.float32)
    for start in range(0, k, BLOCK_K):
        kk = start + tl.arange(0, BLOCK_K)
        a = tl.load(h_ptr + r[:, None].to(tl.int64) * stride_h + kk[None, :],
                    mask=(r[:, None] < rows) & (kk[None, :] < k), other=0.0)
        b = tl.load(w_ptr + c[:, None].to(tl.int64) * stride_w + kk[None, :],
                    mask=(c[:, None] < n) & (kk[None, :] < k), other=0.0)
        # in fp32: half-precision values are exact in TF32, so its products are theirs (and the
        # interpreter's bf16 products are wrong); fp32 weights take fp32 products, as torch's (no TF32)
        a, b = a.to(tl.float32), tl.trans(b.to(tl.float32))
        if IEEE:
            acc = tl.dot(a, b, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc, input_precision="tf32")
    v = acc.to(w_ptr.dtype.element_ty).to(tl.float32)  # rounded as torch's product rounds its output
    v = tl.where(c[None, :] < n, v, float("-inf"))
    m = tl.max(v, axis=1)
    i = tl.min(tl.where(v == m[:, None], c[None, :], n), axis=1)
    keep = r < rows
    tl.store(val_ptr + r * num_blocks + pid_n, m, mask=keep)
    tl.store(idx_ptr + r * num_blocks + pid_n, i.to(tl.int64), mask=keep)


def linear_greedy_pick(hidden: torch.Tensor, weight: torch.Tensor, out: torch.Tensor,
                       vocab: torch.Tensor | None = None, block_n: int = 32, block_k: int = 64,
                       num_warps: int = 4) -> torch.Tensor:
    """hidden [R, K], weight [V, K] (same float dtype, unit stride along K), out [R] int64 (any
    stride), vocab [V] int64 or None -> out, holding vocab[argmax(hidden[i] @ weight.T)] (or the
    argmax) with the logits rounded to the weights' dtype. Two launches, no logits in memory."""
    rows, k = hidden.shape
    n = weight.shape[0]
    if hidden.dtype != weight.dtype or hidden.dtype not in (torch.float32, torch.bfloat16, torch.float16) \
            or weight.shape[1] != k or hidden.stride(1) != 1 or weight.stride(1) != 1 \
            or out.shape != (rows,) or out.dtype != torch.int64:
        raise ValueError(f"linear_greedy_pick: hidden [R, K] and weight [V, K] of one float dtype with unit stride "
                         f"along K, out int64 [R]; got {hidden.dtype} {tuple(hidden.shape)} stride {hidden.stride()}, "
                         f"{weight.dtype} {tuple(weight.shape)} stride {weight.stride()}, "
                         f"{out.dtype} {tuple(out.shape)}")
    if not rows:
        return out
    block_r = 16 if rows <= 16 else 32 if rows <= 32 else 64
    num_blocks = triton.cdiv(n, block_n)
    val, idx = _partials(rows, num_blocks, hidden.device)
    _linear_max_kernel[(num_blocks, triton.cdiv(rows, block_r))](
        hidden, weight, val, idx, rows, n, k, hidden.stride(0), weight.stride(0), num_blocks,
        IEEE=weight.dtype == torch.float32, BLOCK_R=block_r, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=num_warps,
        **pdl_args(hidden.device))
    _launch_pick(val, idx, out, vocab)
    return out


def ref_greedy_pick(logits: torch.Tensor, out: torch.Tensor, vocab: torch.Tensor | None = None) -> torch.Tensor:
    picked = logits.argmax(dim=-1)
    out.copy_(vocab[picked] if vocab is not None else picked)
    return out


def ref_linear_greedy_pick(hidden: torch.Tensor, weight: torch.Tensor, out: torch.Tensor,
                           vocab: torch.Tensor | None = None) -> torch.Tensor:
    return ref_greedy_pick(torch.nn.functional.linear(hidden, weight), out, vocab)
