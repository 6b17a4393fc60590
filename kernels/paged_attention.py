"""Paged attention over a flat, ragged batch of decodes, speculative verifications and prefill chunks.

Request `i` owns query tokens `query_start_loc[i]:query_start_loc[i+1]`, the LAST `query_len` tokens
of its `seq_lens[i]`-long context; its keys/values live in the paged cache
`kv_cache[2, num_blocks, block_size, num_kv_heads, head_dim]` at the blocks of `block_tables[i]`.
Attention is causal inside the query (query token j sees keys `0 .. seq_len - query_len + j`). With a
`sliding_window` W (a layer's constant, e.g. Gemma 3's local layers) the token at position p sees only
keys `p - W + 1 .. p`; the cache still holds every key, those outside the window are masked, and the
KV tiles entirely before every row's window are never read.

One program owns a tile of `BLOCK_M` rows = `BLOCK_Q` query tokens x the `QPK` query heads that share
one kv head (GQA), so each K/V tile is read once for all those heads, and walks the KV tiles with an
fp32 online softmax. Two launches cover a mixed batch without host syncs:

* short launch: one program per (request, kv head, split) for requests with `query_len <= BLOCK_Q`
  (decodes, verifications). With few programs and long contexts the KV range is split over
  `NUM_SPLITS` programs (flash-decoding) and `_paged_attention_reduce_kernel` merges the parts.
* long launch (only when `max_query_len` exceeds the short tile): query tiles of the longer requests;
  a program finds its request by a binary search over `query_start_loc`.

Grid sizes depend only on python ints (`num_tokens`, `num_reqs`, `max_query_len`, `max_seq_len`), so a
captured CUDA graph replays correctly with new tensor contents, provided `max_query_len` still bounds
every query length.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from specserve.kernels.attention_config import MAX_SPLITS, MIN_TOKENS_PER_SPLIT, KernelConfig, select_configs
from specserve.kernels.pdl import pdl_args, pdl_prologue

LOG2E = 1.4426950408889634
M_INIT = tl.constexpr(-1.0e30)  # finite "minus infinity" for the running max: exp2(M_INIT - M_INIT) stays 1, never NaN


@triton.jit
def _attend_tile(acc, l_i, m_i, q, cache_ptr, bt_row_ptr, kv_head, tile, seq_len, row_pos, window, scale_log2,
                 stride_ckv, stride_cb, stride_cs, stride_ch,
                 BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr, HEAD_DIM: tl.constexpr,
                 HEAD_DIM_PAD: tl.constexpr, MASKED: tl.constexpr, SLIDING: tl.constexpr,
                 INPUT_PRECISION: tl.constexpr):
    """One KV tile of the online softmax; MASKED tiles check causality, the context end and (SLIDING)
    the window's start."""
    offs_n = tile * TILE_N + tl.arange(0, TILE_N)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    if MASKED:
        n_valid = offs_n < seq_len
        blk = tl.load(bt_row_ptr + offs_n // BLOCK_SIZE, mask=n_valid, other=0)
    else:
        blk = tl.load(bt_row_ptr + offs_n // BLOCK_SIZE)
    blk = blk.to(tl.int64)  # caches can pass 2**31 elements (int32 offsets measured no faster on H200)
    kv_off = blk * stride_cb + (offs_n % BLOCK_SIZE) * stride_cs + kv_head * stride_ch
    kv_ptrs = cache_ptr + kv_off[:, None] + offs_d[None, :]  # [TILE_N, HEAD_DIM_PAD]
    if MASKED:
        kv_mask = n_valid[:, None] & (offs_d[None, :] < HEAD_DIM)
        k = tl.load(kv_ptrs, mask=kv_mask, other=0.0)
        v = tl.load(kv_ptrs + stride_ckv, mask=kv_mask, other=0.0)
    elif HEAD_DIM != HEAD_DIM_PAD:
        d_mask = (offs_d < HEAD_DIM)[None, :]
        k = tl.load(kv_ptrs, mask=d_mask, other=0.0)
        v = tl.load(kv_ptrs + stride_ckv, mask=d_mask, other=0.0)
    else:
        k = tl.load(kv_ptrs)
        v = tl.load(kv_ptrs + stride_ckv)
    s = tl.dot(q, tl.trans(k), input_precision=INPUT_PRECISION) * scale_log2  # [BLOCK_M, TILE_N]
    if MASKED:
        visible = offs_n[None, :] <= row_pos[:, None]
        if SLIDING:
            visible = visible & (offs_n[None, :] > row_pos[:, None] - window)
        s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=INPUT_PRECISION)
    return acc, l_i, m_new


# num_reqs and the block table's row stride change with every batch: not specialised on (Triton
# compiles a variant per value class of an int argument: 1, a multiple of 16, other)
@triton.jit(do_not_specialize=["num_reqs", "stride_bt"])
def _paged_attention_kernel(
    q_ptr,  # [num_tokens, num_heads, head_dim]
    cache_ptr,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    out_ptr,  # [num_tokens, num_heads, head_dim]
    part_acc_ptr,  # [num_tokens, num_heads, NUM_SPLITS, head_dim] fp32, unnormalised (NUM_SPLITS > 1)
    part_m_ptr,  # [num_tokens, num_heads, NUM_SPLITS] fp32 running max (log2 units) (NUM_SPLITS > 1)
    part_l_ptr,  # [num_tokens, num_heads, NUM_SPLITS] fp32 softmax denominator (NUM_SPLITS > 1)
    query_start_loc_ptr,  # [num_reqs + 1] int32
    seq_lens_ptr,  # [num_reqs] int32
    block_tables_ptr,  # [num_reqs, max_blocks_per_req] int32
    num_reqs, num_heads, scale_log2,
    window,  # sliding window in tokens (SLIDING only)
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_ckv, stride_cb, stride_cs, stride_ch, stride_bt,
    QPK: tl.constexpr, QPK_PAD: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr,
    TILE_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    NUM_SPLITS: tl.constexpr, PER_REQUEST: tl.constexpr, SKIP_Q_LEN: tl.constexpr, SLIDING: tl.constexpr,
    INPUT_PRECISION: tl.constexpr, PDL: tl.constexpr,
):
    pdl_prologue(PDL)
    pid = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    if PER_REQUEST:
        # short launch: the whole query of request `pid` fits in one tile, longer ones are not ours
        req = pid
        q_start = tl.load(query_start_loc_ptr + req)
        q_len = tl.load(query_start_loc_ptr + req + 1) - q_start
        q_block = 0
        if (q_len == 0) | (q_len > BLOCK_Q):
            return
    else:
        # long launch: request i owns q tiles [start_i, start_i + cdiv(q_len_i, BLOCK_Q)) with
        # start_i = query_start_loc[i] // BLOCK_Q + i; find the last i with start_i <= pid
        lo = tl.zeros([], dtype=tl.int32)
        hi = tl.zeros([], dtype=tl.int32) + num_reqs
        while lo < hi:
            mid = (lo + hi) // 2
            start = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
            go_right = start <= pid
            lo = tl.where(go_right, mid + 1, lo)
            hi = tl.where(go_right, hi, mid)
        req = lo - 1
        q_start = tl.load(query_start_loc_ptr + req)
        q_len = tl.load(query_start_loc_ptr + req + 1) - q_start
        q_block = pid - (q_start // BLOCK_Q + req)
        if (q_block * BLOCK_Q >= q_len) | (q_len <= SKIP_Q_LEN):
            return
    seq_len = tl.load(seq_lens_ptr + req)
    ctx_len = seq_len - q_len

    rows = tl.arange(0, BLOCK_M)
    row_q = q_block * BLOCK_Q + rows // QPK_PAD  # query index inside the request
    row_head = kv_head * QPK + rows % QPK_PAD
    row_valid = (row_q < q_len) & (rows % QPK_PAD < QPK) & (rows // QPK_PAD < BLOCK_Q)
    row_pos = ctx_len + row_q  # absolute position of each row's token
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    d_valid = offs_d < HEAD_DIM
    row_token = q_start + row_q
    q = tl.load(q_ptr + row_token[:, None] * stride_qt + row_head[:, None] * stride_qh + offs_d[None, :],
                mask=row_valid[:, None] & d_valid[None, :], other=0.0)

    # keys [0, kv_end) are needed; tiles below num_full are seen by every row (causally) and need no
    # masks. With a window, keys start at tile_start (the first row's window) and tiles before win_full
    # are outside the last row's window: [tile_start, win_full) are masked, [win_full, num_full) are not.
    first_pos = ctx_len + q_block * BLOCK_Q
    kv_end = tl.minimum(seq_len, first_pos + BLOCK_Q)
    num_tiles = tl.cdiv(kv_end, TILE_N)
    num_full = (first_pos + 1) // TILE_N
    tile_start = 0
    win_full = 0
    if SLIDING:
        tile_start = tl.maximum(first_pos - window + 1, 0) // TILE_N
        win_full = tl.cdiv(tl.maximum(kv_end - window, 0), TILE_N)
    tiles_per_split = tl.cdiv(num_tiles - tile_start, NUM_SPLITS)
    tile_lo = tile_start + split * tiles_per_split
    tile_hi = tl.minimum(tile_lo + tiles_per_split, num_tiles)
    bt_row_ptr = block_tables_ptr + req.to(tl.int64) * stride_bt

    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    m_i = tl.zeros([BLOCK_M], dtype=tl.float32) + M_INIT
    if SLIDING:
        for tile in range(tile_lo, tl.minimum(tile_hi, tl.minimum(win_full, num_full))):
            acc, l_i, m_i = _attend_tile(acc, l_i, m_i, q, cache_ptr, bt_row_ptr, kv_head, tile, seq_len,
                                         row_pos, window, scale_log2, stride_ckv, stride_cb, stride_cs,
                                         stride_ch, BLOCK_SIZE, TILE_N, HEAD_DIM, HEAD_DIM_PAD, True, True,
                                         INPUT_PRECISION)
    for tile in range(tl.maximum(tile_lo, win_full), tl.minimum(tile_hi, num_full)):
        acc, l_i, m_i = _attend_tile(acc, l_i, m_i, q, cache_ptr, bt_row_ptr, kv_head, tile, seq_len,
                                     row_pos, window, scale_log2, stride_ckv, stride_cb, stride_cs, stride_ch,
                                     BLOCK_SIZE, TILE_N, HEAD_DIM, HEAD_DIM_PAD, False, SLIDING, INPUT_PRECISION)
    for tile in range(tl.maximum(tile_lo, num_full), tile_hi):
        acc, l_i, m_i = _attend_tile(acc, l_i, m_i, q, cache_ptr, bt_row_ptr, kv_head, tile, seq_len,
                                     row_pos, window, scale_log2, stride_ckv, stride_cb, stride_cs, stride_ch,
                                     BLOCK_SIZE, TILE_N, HEAD_DIM, HEAD_DIM_PAD, True, SLIDING, INPUT_PRECISION)

    out_mask = row_valid[:, None] & d_valid[None, :]
    if NUM_SPLITS == 1:
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        out_ptrs = out_ptr + row_token[:, None] * stride_ot + row_head[:, None] * stride_oh + offs_d[None, :]
        tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        part = (row_token.to(tl.int64) * num_heads + row_head) * NUM_SPLITS + split
        tl.store(part_acc_ptr + part[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=out_mask)
        tl.store(part_m_ptr + part, m_i, mask=row_valid)
        tl.store(part_l_ptr + part, l_i, mask=row_valid)


@triton.jit
def _paged_attention_reduce_kernel(
    out_ptr,  # [num_tokens, num_heads, head_dim]
    part_acc_ptr,  # [num_tokens, num_heads, NUM_SPLITS, head_dim] fp32
    part_m_ptr,  # [num_tokens, num_heads, NUM_SPLITS] fp32
    part_l_ptr,  # [num_tokens, num_heads, NUM_SPLITS] fp32
    query_start_loc_ptr,  # [num_reqs + 1] int32
    num_heads, stride_ot, stride_oh,
    BLOCK_Q: tl.constexpr, NUM_SPLITS: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    PDL: tl.constexpr,
):
    """Merge the split-K partial softmax states of the short launch's requests."""
    pdl_prologue(PDL)
    req = tl.program_id(0)
    head = tl.program_id(1)
    q_start = tl.load(query_start_loc_ptr + req)
    q_len = tl.load(query_start_loc_ptr + req + 1) - q_start
    if q_len > BLOCK_Q:
        return
    offs_s = tl.arange(0, NUM_SPLITS)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    d_valid = offs_d < HEAD_DIM
    for i in range(q_len):
        token = (q_start + i).to(tl.int64)
        part = (token * num_heads + head) * NUM_SPLITS + offs_s  # [NUM_SPLITS]
        m = tl.load(part_m_ptr + part)
        l_part = tl.load(part_l_ptr + part)
        weight = tl.exp2(m - tl.max(m, 0))
        denom = tl.sum(l_part * weight, 0)
        acc = tl.load(part_acc_ptr + part[:, None] * HEAD_DIM + offs_d[None, :], mask=d_valid[None, :],
                      other=0.0)
        out = tl.sum(acc * weight[:, None], 0) / tl.where(denom == 0.0, 1.0, denom)
        tl.store(out_ptr + token * stride_ot + head * stride_oh + offs_d, out.to(out_ptr.dtype.element_ty),
                 mask=d_valid)


def _check_inputs(query: torch.Tensor, kv_cache: torch.Tensor, query_start_loc: torch.Tensor,
                  seq_lens: torch.Tensor, block_tables: torch.Tensor, out: torch.Tensor | None) -> None:
    if query.dim() != 3:
        raise ValueError(f"query must be [num_tokens, num_heads, head_dim], got shape {tuple(query.shape)}")
    if kv_cache.dim() != 5 or kv_cache.shape[0] != 2:
        raise ValueError("kv_cache must be [2, num_blocks, block_size, num_kv_heads, head_dim], "
                         f"got shape {tuple(kv_cache.shape)}")
    num_heads, head_dim = query.shape[1], query.shape[2]
    num_kv_heads = kv_cache.shape[3]
    if kv_cache.shape[4] != head_dim:
        raise ValueError(f"head_dim mismatch: query has {head_dim}, kv_cache has {kv_cache.shape[4]}")
    if num_heads % num_kv_heads != 0:
        raise ValueError(f"num_heads {num_heads} must be a multiple of num_kv_heads {num_kv_heads}")
    if query.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"query dtype {query.dtype} not supported (float16, bfloat16, float32)")
    if kv_cache.dtype != query.dtype:
        raise ValueError(f"kv_cache dtype {kv_cache.dtype} must equal query dtype {query.dtype}")
    if query.stride(2) != 1 or kv_cache.stride(4) != 1:
        raise ValueError("query and kv_cache must be contiguous in head_dim (stride 1)")
    for name, t in (("query_start_loc", query_start_loc), ("seq_lens", seq_lens), ("block_tables", block_tables)):
        if t.dtype != torch.int32:
            raise ValueError(f"{name} must be int32, got {t.dtype}")
        if t.device != query.device:
            raise ValueError(f"{name} is on {t.device}, query on {query.device}")
    if kv_cache.device != query.device:
        raise ValueError(f"kv_cache is on {kv_cache.device}, query on {query.device}")
    num_reqs = seq_lens.shape[0]
    if seq_lens.dim() != 1 or query_start_loc.shape != (num_reqs + 1,):
        raise ValueError(f"query_start_loc must be [num_reqs + 1] = [{num_reqs + 1}] for seq_lens "
                         f"[{num_reqs}], got {tuple(query_start_loc.shape)}")
    if block_tables.dim() != 2 or block_tables.shape[0] != num_reqs or block_tables.stride(1) != 1:
        raise ValueError(f"block_tables must be [num_reqs={num_reqs}, max_blocks] with a contiguous last "
                         f"dim, got shape {tuple(block_tables.shape)}")
    if out is not None:
        if out.shape != query.shape or out.dtype != query.dtype or out.device != query.device:
            raise ValueError(f"out must match query ({tuple(query.shape)}, {query.dtype}), "
                             f"got {tuple(out.shape)}, {out.dtype}")
        if out.stride(2) != 1:
            raise ValueError("out must be contiguous in head_dim (stride 1)")


def paged_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    query_start_loc: torch.Tensor,  # [num_reqs + 1] int32
    seq_lens: torch.Tensor,  # [num_reqs] int32, context length including this step's tokens
    block_tables: torch.Tensor,  # [num_reqs, max_blocks_per_req] int32
    scale: float,
    max_query_len: int,
    max_seq_len: int,
    out: torch.Tensor | None = None,  # [num_tokens, num_heads, head_dim]
    *,
    sliding_window: int | None = None,
    short_config: KernelConfig | None = None,
    long_config: KernelConfig | None = None,
    num_splits: int | None = None,
) -> torch.Tensor:
    """Causal paged attention for a mixed ragged batch; returns `out` ([num_tokens, num_heads, head_dim]).

    `max_query_len` must be >= every request's query length and `max_seq_len` should bound the
    context lengths (it only picks the split-K factor). No host syncs: safe to capture in a CUDA graph.
    Rows of tokens past `query_start_loc[-1]` (graph padding) are left unwritten.
    `sliding_window` W: each token attends to the last W positions only (itself included); None = all.
    `short_config`, `long_config` and `num_splits` override the tuned launch choices (benchmarks, tests).
    """
    _check_inputs(query, kv_cache, query_start_loc, seq_lens, block_tables, out)
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be >= 1 (or None for full attention), got {sliding_window}")
    if out is None:
        out = torch.empty_like(query)
    num_tokens, num_heads, head_dim = query.shape
    num_reqs = seq_lens.shape[0]
    block_size, num_kv_heads = kv_cache.shape[2], kv_cache.shape[3]
    if num_tokens == 0 or num_reqs == 0:
        return out
    qpk = num_heads // num_kv_heads
    if sliding_window is not None:  # a short query reads at most window + query_len keys
        max_seq_len = min(max_seq_len, sliding_window + max_query_len)
    short, long, splits = select_configs(
        num_tokens, num_reqs, num_kv_heads, qpk, head_dim, query.element_size(), max_query_len,
        max_seq_len, _num_sms(query.device))
    short = short_config or short
    long = long_config or long
    splits = num_splits if num_splits is not None else splits
    if splits < 1 or splits & (splits - 1):
        raise ValueError(f"num_splits must be a power of two >= 1, got {splits}")

    qpk_pad = triton.next_power_of_2(qpk)
    head_dim_pad = triton.next_power_of_2(head_dim)
    precision = "ieee" if query.dtype == torch.float32 else "tf32"
    common = dict(QPK=qpk, QPK_PAD=qpk_pad, BLOCK_SIZE=block_size, HEAD_DIM=head_dim,
                  HEAD_DIM_PAD=head_dim_pad, SLIDING=sliding_window is not None, INPUT_PRECISION=precision,
                  **pdl_args(query.device))
    strides = (query.stride(0), query.stride(1), out.stride(0), out.stride(1), kv_cache.stride(0),
               kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3), block_tables.stride(0))
    scale_log2 = float(scale) * LOG2E
    window = sliding_window or 0

    # short launch: requests whose whole query fits in one tile of short.block_m rows
    short_q = max(1, short.block_m // qpk_pad)
    if splits > 1:
        part_acc = torch.empty((num_tokens, num_heads, splits, head_dim), dtype=torch.float32,
                               device=query.device)
        part_ml = torch.empty((2, num_tokens, num_heads, splits), dtype=torch.float32, device=query.device)
        part_m, part_l = part_ml[0], part_ml[1]
    else:
        part_acc = part_m = part_l = out  # unused
    _paged_attention_kernel[(num_reqs, num_kv_heads, splits)](
        query, kv_cache, out, part_acc, part_m, part_l, query_start_loc, seq_lens, block_tables,
        num_reqs, num_heads, scale_log2, window, *strides,
        BLOCK_Q=short_q, BLOCK_M=max(16, short_q * qpk_pad), TILE_N=short.tile_n, NUM_SPLITS=splits,
        PER_REQUEST=True, SKIP_Q_LEN=0, num_warps=short.num_warps, num_stages=short.num_stages, **common)
    if splits > 1:
        _paged_attention_reduce_kernel[(num_reqs, num_heads)](
            out, part_acc, part_m, part_l, query_start_loc, num_heads, out.stride(0), out.stride(1),
            BLOCK_Q=short_q, NUM_SPLITS=splits, HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad,
            num_warps=4 if head_dim_pad * splits >= 2048 else 1, **pdl_args(out.device))

    # long launch: query tiles of the requests the short launch skipped
    if max_query_len > short_q:
        long_q = max(1, long.block_m // qpk_pad)
        _paged_attention_kernel[(num_tokens // long_q + num_reqs, num_kv_heads, 1)](
            query, kv_cache, out, out, out, out, query_start_loc, seq_lens, block_tables,
            num_reqs, num_heads, scale_log2, window, *strides,
            BLOCK_Q=long_q, BLOCK_M=max(16, long_q * qpk_pad), TILE_N=long.tile_n, NUM_SPLITS=1,
            PER_REQUEST=False, SKIP_Q_LEN=short_q, num_warps=long.num_warps, num_stages=long.num_stages,
            **common)
    return out


def warm_up_paged_attention(num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                            block_size: int, max_model_len: int, device: torch.device,
                            sliding_windows: tuple[int | None, ...] = (None,)) -> int:
    """Launch, on a one-request batch, every kernel variant `paged_attention` can pick for heads of
    this shape: each short tile (by query length), each KV split a context of up to `max_model_len`
    tokens can get, the long launch, with and without each sliding window. Triton compiles a variant
    on its first launch (about a second); one first met while serving stalls that step. Returns the
    number of launches (variants met before cost nothing: Triton's cache)."""
    qpk_pad = triton.next_power_of_2(num_heads // num_kv_heads)
    # the shortest query lengths of each short tile (16 / 32 / 64 rows), and one past each (long launch)
    rows = (16, 32, 64)
    q_lens = sorted({max(1, r // qpk_pad) for r in rows} | {max(1, r // qpk_pad) + 1 for r in rows})
    max_splits = min(MAX_SPLITS, 1 << (max(1, max_model_len // MIN_TOKENS_PER_SPLIT).bit_length() - 1))
    seq_len = max(max(q_lens), min(max_model_len, max_splits * MIN_TOKENS_PER_SPLIT))
    num_blocks = -(-seq_len // block_size)
    kv = torch.zeros(2, num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype, device=device)
    tables = torch.arange(num_blocks, dtype=torch.int32, device=device)[None]
    lens = torch.tensor([seq_len], dtype=torch.int32, device=device)
    launches = 0
    for window in sliding_windows:
        for q_len in q_lens:
            query = torch.zeros(q_len, num_heads, head_dim, dtype=dtype, device=device)
            starts = torch.tensor([0, q_len], dtype=torch.int32, device=device)
            splits = 1
            while splits <= max_splits:
                paged_attention(query, kv, starts, lens, tables, 1.0, q_len, seq_len, sliding_window=window,
                                num_splits=splits)
                launches += 1
                splits *= 2
    return launches


_SM_COUNT: dict[int, int] = {}


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 4  # the Triton interpreter: any small number exercises the split path
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SM_COUNT:
        _SM_COUNT[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SM_COUNT[index]


def ref_paged_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    query_start_loc: torch.Tensor,  # [num_reqs + 1] int32
    seq_lens: torch.Tensor,  # [num_reqs] int32
    block_tables: torch.Tensor,  # [num_reqs, max_blocks_per_req] int32
    scale: float,
    max_query_len: int | None = None,
    max_seq_len: int | None = None,
    *,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """The oracle: a plain loop over requests, fp32 math, output in query's dtype."""
    block_size, num_kv_heads = kv_cache.shape[2], kv_cache.shape[3]
    qpk = query.shape[1] // num_kv_heads
    out = torch.zeros_like(query)
    starts, lens = query_start_loc.tolist(), seq_lens.tolist()
    for i, seq_len in enumerate(lens):
        q_lo, q_hi = starts[i], starts[i + 1]
        if q_hi == q_lo:
            continue
        pos = torch.arange(seq_len, device=query.device)
        blocks = block_tables[i].long()[pos // block_size]
        k = kv_cache[0, blocks, pos % block_size].float().repeat_interleave(qpk, dim=1)  # [S, H, D]
        v = kv_cache[1, blocks, pos % block_size].float().repeat_interleave(qpk, dim=1)
        q = query[q_lo:q_hi].float()  # [Q, H, D]
        scores = torch.einsum("qhd,shd->hqs", q, k) * scale
        q_pos = seq_len - (q_hi - q_lo) + torch.arange(q_hi - q_lo, device=query.device)
        hidden = pos[None, None, :] > q_pos[None, :, None]
        if sliding_window is not None:
            hidden |= pos[None, None, :] <= q_pos[None, :, None] - sliding_window
        scores = scores.masked_fill(hidden, float("-inf"))
        out[q_lo:q_hi] = torch.einsum("hqs,shd->qhd", scores.softmax(-1), v).to(query.dtype)
    return out


__all__ = ["KernelConfig", "paged_attention", "ref_paged_attention"]
