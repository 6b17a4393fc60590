"""Weight-only int8 linear layer: y = (x @ w.T) * scale (+ bias), w int8 [N, K], one fp32 scale per
output row (symmetric: scale = the row's largest |weight| / 127).

For the small row counts of a draft head's steps (one to a few dozen rows) a linear layer reads its
weights and little else: int8 rows halve the bytes a bf16 layer reads. The kernel streams a tile of
BLOCK_N weight rows along K, widens each int8 tile to the activations' dtype (exact: |w| <= 127) and
accumulates x @ w.T in fp32 on the tensor cores; the row scales apply once at the end.

A layer with few output rows (N) and a long K gives a GPU too few tiles to keep its memory busy;
split over K (SPLIT_K > 1) each tile's K range is shared by SPLIT_K programs, which write their scaled
fp32 partial sums to a scratch buffer and count themselves done on the tile's counter; the last one
adds the SPLIT_K sums in split order (the result does not depend on which program finishes first)
with the bias, in the same launch (a second kernel for the sums cost a launch, ~2-3 us inside a
CUDA graph, as much as the split saved at one row), and sets the counter back to 0.

One row (a chain step of one request) has a second kernel: a matrix-vector product on the CUDA cores
(`_int8_gemv_kernel`: each program widens a [BLOCK_N, BLOCK_K] weight tile to fp32, multiplies it by
the row and sums along K), which stages no tile for the tensor cores and pads no row to 16. Which of
the two kernels and which tiles a shape gets is timed on first use (`_tuned_config`).

Launched with programmatic dependent launch (kernels/pdl.py), a product's programs are scheduled while
the kernel before it (a norm, the attention, the activation) still runs, and wait for it. Before that
wait they ask the L2 cache for the first lines of their weight rows (`prefetch.global.L2`, no registers
held): the weights' stream from memory starts while the kernel before finishes, where without it every
product's first loads wait a memory latency after the kernel before has ended. No kernel writes the
weights, so their prefetch needs no wait. The lines prefetched are capped at a quarter of the L2 a
launch (`prefetch_lines`), so they are not evicted before they are read. Off unless
SPECSERVE_INT8_PREFETCH=1 (PREFETCH_DEFAULT): on an H100 it gained nothing (BENCHMARKS.md, 2026-12-07 (last)).
"""
from __future__ import annotations

import logging
import os
import time

import torch
import triton
import triton.language as tl
from triton.runtime.errors import OutOfResources

from specserve.kernels.pdl import pdl_args, pdl_enabled, pdl_prologue
from specserve.quant.int8_rows import int8_linear_torch as ref_int8_linear  # noqa: F401 - the oracle


@triton.jit
def _prefetch_weights(w_ptr, rows, k_start, k_end, N, stride_wn, LINES: tl.constexpr):
    """Ask the L2 for the first LINES 128-byte lines of each of this program's weight rows [rows] in
    [k_start, k_end): prefetches, nothing waits for them or holds a register."""
    offs = k_start + tl.arange(0, LINES) * 128
    inside = (rows[:, None] < N) & (offs[None, :] < k_end)
    at = tl.where(inside, rows[:, None].to(tl.int64) * stride_wn + offs[None, :], 0)
    tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l", [w_ptr + at], dtype=tl.int32,
                              is_pure=False, pack=1)


@triton.jit
def _epilogue(acc, offs, out_offs, cols, mask, tile, pid_k, plane, bias_ptr, out_ptr, part_ptr, count_ptr,
              HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr):
    """Write a tile's scaled sums acc [R, BLOCK_N] (+ bias; cols [1, BLOCK_N]) at out_offs. Split over K,
    this program's share goes to scratch plane pid_k (offs: within a plane of `plane` values), and the
    tile's last program to count itself done adds the SPLIT_K shares in split order (the result does not
    depend on which program finishes first), writes the tile and sets the tile's count back to 0 for
    the next launch."""
    if SPLIT_K == 1:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + out_offs, acc.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(part_ptr + pid_k * plane + offs, acc, mask=mask)
        tl.debug_barrier()  # every thread's share stored before the count goes up (released with it)
        if tl.atomic_add(count_ptr + tile, 1, sem="acq_rel", scope="gpu") == SPLIT_K - 1:
            total = tl.zeros_like(acc)
            for split in tl.static_range(SPLIT_K):
                total += tl.load(part_ptr + split * plane + offs, mask=mask, other=0.0, cache_modifier=".cg")
            if HAS_BIAS:
                total += tl.load(bias_ptr + cols, mask=mask, other=0.0).to(tl.float32)
            tl.store(out_ptr + out_offs, total.to(out_ptr.dtype.element_ty), mask=mask)
            tl.store(count_ptr + tile, 0)


@triton.jit(do_not_specialize=["M"])  # one compile for any row count of a tile size
def _int8_linear_kernel(
    x_ptr,  # [M, K]
    w_ptr,  # [N, K] int8
    scale_ptr,  # [N] fp32
    bias_ptr,  # [N] (HAS_BIAS)
    out_ptr,  # [M, N]
    part_ptr,  # split over K: [SPLIT_K, M, N] fp32 scratch for the splits' shares
    count_ptr,  # split over K: [tiles] int32, 0 between launches
    M, N, K, K_SPLIT,  # K_SPLIT: the K range of one split, a multiple of BLOCK_K
    stride_xm, stride_wn, stride_om,
    HAS_BIAS: tl.constexpr, INPUT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, PDL: tl.constexpr,
    PREFETCH: tl.constexpr,  # lines of each weight row to prefetch before the PDL wait (0: none)
):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    k_start = pid_k * K_SPLIT
    k_end = tl.minimum(k_start + K_SPLIT, K)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    if PREFETCH > 0:
        _prefetch_weights(w_ptr, cols, k_start, k_end, N, stride_wn, PREFETCH)
    pdl_prologue(PDL)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    ks = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + rows[:, None].to(tl.int64) * stride_xm + (k_start + ks)[None, :]
    w_ptrs = w_ptr + cols[None, :].to(tl.int64) * stride_wn + (k_start + ks)[:, None]  # [BLOCK_K, BLOCK_N]: w.T
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        k_ok = (k0 + ks) < k_end
        x = tl.load(x_ptrs, mask=(rows[:, None] < M) & k_ok[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=k_ok[:, None] & (cols[None, :] < N), other=0)
        acc += tl.dot(x, w.to(x.dtype), input_precision=INPUT_PRECISION)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    acc = acc * tl.load(scale_ptr + cols, mask=cols < N, other=0.0)[None, :]
    row_offs = rows[:, None].to(tl.int64)
    _epilogue(acc, row_offs * N + cols[None, :], row_offs * stride_om + cols[None, :], cols[None, :],
              (rows[:, None] < M) & (cols[None, :] < N), pid_m * tl.num_programs(0) + pid_n, pid_k, M * N,
              bias_ptr, out_ptr, part_ptr, count_ptr, HAS_BIAS, SPLIT_K)


@triton.jit
def _int8_gemv_kernel(
    x_ptr,  # [1, K]
    w_ptr,  # [N, K] int8
    scale_ptr,  # [N] fp32
    bias_ptr,  # [N] (HAS_BIAS)
    out_ptr,  # [1, N]
    part_ptr,  # split over K: [SPLIT_K, 1, N] fp32 scratch for the splits' shares
    count_ptr,  # split over K: [tiles] int32, 0 between launches
    N, K, K_SPLIT,  # K_SPLIT: the K range of one split, a multiple of BLOCK_K
    stride_wn,
    HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, PDL: tl.constexpr,
    PREFETCH: tl.constexpr,  # lines of each weight row to prefetch before the PDL wait (0: none)
):
    """out = (w @ x) * scale (+ bias) for one row x, in fp32 on the CUDA cores."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    k_start = pid_k * K_SPLIT
    k_end = tl.minimum(k_start + K_SPLIT, K)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    if PREFETCH > 0:
        _prefetch_weights(w_ptr, cols, k_start, k_end, N, stride_wn, PREFETCH)
    pdl_prologue(PDL)
    ks = tl.arange(0, BLOCK_K)
    w_ptrs = w_ptr + cols[:, None].to(tl.int64) * stride_wn + (k_start + ks)[None, :]  # [BLOCK_N, BLOCK_K]
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        k_ok = (k0 + ks) < k_end
        x = tl.load(x_ptr + k0 + ks, mask=k_ok, other=0.0).to(tl.float32)
        w = tl.load(w_ptrs, mask=(cols[:, None] < N) & k_ok[None, :], other=0).to(tl.float32)
        acc += tl.sum(w * x[None, :], axis=1)
        w_ptrs += BLOCK_K
    acc = acc * tl.load(scale_ptr + cols, mask=cols < N, other=0.0)
    offs = cols[None, :].to(tl.int64)  # row 0
    _epilogue(acc[None, :], offs, offs, cols[None, :], cols[None, :] < N, pid_n, pid_k, N, bias_ptr, out_ptr,
              part_ptr, count_ptr, HAS_BIAS, SPLIT_K)


# (BLOCK_N, BLOCK_K, num_stages, SPLIT_K, num_warps) tried for every row bucket on a GPU; the first is also
# the fallback. Split over K for layers whose N gives fewer tiles than a GPU has SMs (an 8B head's o and
# down: 4,096 rows)
CANDIDATES = ((32, 128, 3, 1, 4), (32, 512, 5, 1, 4), (64, 256, 4, 1, 4), (128, 256, 3, 1, 4), (32, 256, 4, 1, 4),
              (64, 512, 3, 1, 4), (128, 128, 4, 1, 4), (32, 256, 4, 2, 4), (32, 512, 3, 4, 4), (64, 256, 4, 4, 4),
              (32, 256, 4, 8, 4))
# and for the 32- and 64-row buckets also wide tiles over 8 warps, where the tensor cores' work counts
# too (on an H200 the candidates above took 1.44x cuBLAS's bf16 time at 64 rows; these are not measured
# yet: Int8Linear sends such products to its float weights)
WIDE_CANDIDATES = ((128, 64, 4, 1, 8), (128, 128, 3, 1, 8), (256, 64, 3, 1, 8), (64, 128, 4, 1, 8))
# the one-row kernel's (BLOCK_N, BLOCK_K, num_stages, SPLIT_K, num_warps), timed beside the tensor cores'
# for one row; K-long tiles of a few rows: 16 bytes of each weight row per thread and load
GEMV_CANDIDATES = ((16, 512, 3, 1, 4), (32, 256, 3, 1, 4), (8, 1024, 3, 1, 4), (16, 512, 3, 2, 4),
                   (32, 512, 2, 1, 8), (16, 256, 4, 4, 4))
PREFETCH_ENV = "SPECSERVE_INT8_PREFETCH"
PREFETCH_DEFAULT = "0"  # SPECSERVE_INT8_PREFETCH when unset
MAX_PREFETCH_LINES = 32  # of one weight row a program: 4 KiB
_L2_BYTES: dict[int, int] = {}  # device index -> its L2's bytes, 0 where the prefetch is off
_COUNTS: dict[tuple, torch.Tensor] = {}  # (weight's address, device) -> its split launches' tile counts
_RETIRED: list[torch.Tensor] = []  # count buffers outgrown, kept for the graphs that captured them
_TUNED: dict[tuple, dict] = {}  # (row bucket: 1 for one row, N, K, dtype, bias) -> the fastest config timed on this GPU
logger = logging.getLogger(__name__)


def row_bucket(m: int) -> int:
    """Rows a tile: 16 (the tensor cores' smallest) up to 16 rows, 32 up to 32, then 64."""
    return 16 if m <= 16 else 32 if m <= 32 else 64


Candidate = tuple[int, int, int, int, int]


def candidates(m: int) -> tuple[tuple[Candidate, bool], ...]:
    """The (tiles, one-row kernel?) candidates the first-use timing tries for products of m rows."""
    tensor_cores = CANDIDATES if row_bucket(m) == 16 else CANDIDATES + WIDE_CANDIDATES
    return tuple((c, False) for c in tensor_cores) + tuple((c, True) for c in (GEMV_CANDIDATES if m == 1 else ()))


def int8_linear_config(m: int, candidate: Candidate = CANDIDATES[0], gemv: bool = False) -> dict:
    """A launch's config: the tensor-core kernel's tiles for m rows, or (gemv, one row) the one-row kernel's."""
    block_n, block_k, stages, split_k, warps = candidate
    if gemv:
        if m != 1:
            raise ValueError(f"the one-row kernel takes one row, not {m}")
        return dict(GEMV=True, BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=split_k, num_warps=warps, num_stages=stages)
    return dict(BLOCK_M=row_bucket(m), BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=split_k, num_warps=warps,
                num_stages=stages)


def prefetch_lines(n: int, k_split: int, split: int, l2_bytes: int) -> int:
    """The 128-byte lines of each weight row a program prefetches: a power of 2, at most a split's row
    (k_split bytes) and MAX_PREFETCH_LINES, with all n * split programs' rows together at most a quarter
    of the L2 (what is prefetched should still be there when it is read); 0 for none."""
    lines = min(l2_bytes // 4 // (n * split * 128), triton.cdiv(k_split, 128), MAX_PREFETCH_LINES)
    return 1 << (lines.bit_length() - 1) if lines > 0 else 0


def _l2_bytes(device: torch.device) -> int:
    """The L2's size on `device` where products prefetch weights (PDL on, SPECSERVE_INT8_PREFETCH or
    PREFETCH_DEFAULT not 0), else 0."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    size = _L2_BYTES.get(index)
    if size is None:
        on = pdl_enabled(device) and os.environ.get(PREFETCH_ENV, PREFETCH_DEFAULT) != "0"
        size = _L2_BYTES[index] = torch.cuda.get_device_properties(index).L2_cache_size if on else 0
        if size:
            logger.info("int8 linear kernel: products prefetch their first weight lines on cuda:%d (%s=1; up to %d "
                        "MiB a launch)", index, PREFETCH_ENV, size // 4 >> 20)
    return size


def _launch(x2, weight, scale, bias, out, cfg: dict) -> None:
    m, (n, k) = x2.shape[0], weight.shape
    cfg = dict(cfg)
    gemv = cfg.pop("GEMV", False)
    split = cfg["SPLIT_K"]
    k_split = triton.cdiv(triton.cdiv(k, split), cfg["BLOCK_K"]) * cfg["BLOCK_K"]
    pdl = pdl_args(out.device)
    lines = prefetch_lines(n, k_split, split, _l2_bytes(out.device)) if pdl["PDL"] else 0
    grid = (triton.cdiv(n, cfg["BLOCK_N"]), 1 if gemv else triton.cdiv(m, cfg["BLOCK_M"]), split)
    part, counts = (out, out) if split == 1 else (
        torch.empty((split, m, n), dtype=torch.float32, device=out.device), _split_counts(weight, grid[0] * grid[1]))
    if gemv:
        if m != 1:
            raise ValueError(f"the one-row kernel takes one row, not {m}")
        _int8_gemv_kernel[(grid[0], split)](
            x2, weight, scale, bias if bias is not None else scale, out, part, counts, n, k, k_split,
            weight.stride(0), HAS_BIAS=bias is not None, **cfg, **pdl, PREFETCH=lines)
    else:
        _int8_linear_kernel[grid](
            x2, weight, scale, bias if bias is not None else scale, out, part, counts, m, n, k, k_split,
            x2.stride(0), weight.stride(0), out.stride(0), HAS_BIAS=bias is not None,
            INPUT_PRECISION="ieee" if x2.dtype == torch.float32 else "tf32", **cfg, **pdl, PREFETCH=lines)


def _split_counts(weight: torch.Tensor, tiles: int) -> torch.Tensor:
    """The per-tile counts of split launches over `weight`: zeros, one buffer per weight (a layer's
    launches are ordered on its stream; each launch leaves the counts at 0). Allocated on a layer's
    first split launch (the first-use timing runs before any CUDA graph capture), for the tiles of up
    to 64 rows at the narrowest tiles; a launch with more tiles gets a larger buffer, and the smaller
    one is kept (a captured CUDA graph may still count on it)."""
    key = (weight.data_ptr(), weight.device)
    counts = _COUNTS.get(key)
    if counts is None or counts.numel() < tiles:
        if counts is not None:
            _RETIRED.append(counts)
        size = max(tiles, triton.cdiv(weight.shape[0], 8) * 4)
        counts = _COUNTS[key] = torch.zeros(size, dtype=torch.int32, device=weight.device)
    return counts


def _tuning_key(m: int, n: int, k: int, dtype: torch.dtype, has_bias: bool) -> tuple:
    return 1 if m == 1 else row_bucket(m), n, k, dtype, has_bias


def timed_config(m: int, n: int, k: int, dtype: torch.dtype, has_bias: bool = False) -> dict | None:
    """The tiles the first-use timing chose for this shape class, None before it ran."""
    return _TUNED.get(_tuning_key(m, n, k, dtype, has_bias))


def _agrees(out: torch.Tensor, first: torch.Tensor) -> bool:
    """Two candidates' outputs of one product: equal but for rounding (their sums' orders differ)."""
    return torch.allclose(out.float(), first, rtol=2e-2, atol=2e-2 * float(first.abs().max()) + 1e-6)


def _tuned_config(x2, weight, scale, bias, out) -> dict:
    """The fastest of `candidates(m)` for this shape class, timed on first use (the median of 5 launches,
    each after the L2 cache is overwritten, as a draft step's layers find their weights in memory; a
    few ms a candidate, plus its compile the first time on a machine; Triton caches those on disk).
    While a CUDA graph is being captured nothing can be timed: an untimed class takes the first
    candidate."""
    m, (n, k) = x2.shape[0], weight.shape
    key = _tuning_key(m, n, k, x2.dtype, bias is not None)
    if key in _TUNED:
        return _TUNED[key]
    if torch.cuda.is_current_stream_capturing():
        return int8_linear_config(m)
    if not _TUNED:
        logger.info("int8 linear kernel: timing %d tile candidates per layer shape (a machine's first run compiles "
                    "each, seconds apiece; Triton keeps them on disk)", len(candidates(m)))
    t0, best = time.perf_counter(), None
    flush = torch.empty(2 * torch.cuda.get_device_properties(x2.device).L2_cache_size, dtype=torch.int8,
                        device=x2.device)  # written between launches: each reads its weights from memory
    first = None  # the first candidate's output: every other must agree with it
    for candidate, gemv in candidates(m):
        cfg = int8_linear_config(m, candidate, gemv)
        try:
            _launch(x2, weight, scale, bias, out, cfg)  # compile, warm
        except OutOfResources:  # its tiles need more shared memory than the GPU has (fp32)
            continue
        except Exception as exc:  # noqa: BLE001 - a candidate this Triton cannot compile: time the others
            logger.warning("int8 linear kernel: candidate %s does not compile here (%s: %s); left out", cfg,
                           type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "")
            continue
        if first is None:
            first = out.float().clone()
        elif not _agrees(out, first):
            logger.warning("int8 linear kernel: candidate %s disagrees with %s on a %d x (%d x %d) product; left "
                           "out", cfg, int8_linear_config(m), m, n, k)
            continue
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(5)]
        torch.cuda._sleep(2_000_000)  # the device spins (~1 ms) while the host queues the launches: the
        for start, end in events:     # events then time the kernels, not the host's launches
            flush.fill_(0)
            start.record()
            _launch(x2, weight, scale, bias, out, cfg)
            end.record()
        events[-1][1].synchronize()
        ms = sorted(start.elapsed_time(end) for start, end in events)[len(events) // 2]
        if best is None or ms < best[0]:
            best = (ms, cfg)
    _TUNED[key] = best[1] if best is not None else int8_linear_config(m)
    logger.debug("int8 linear kernel, %d rows x (%d x %d) %s: %s (%.1f s)", key[0], n, k, x2.dtype,
                 _TUNED[key], time.perf_counter() - t0)
    return _TUNED[key]


def int8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None,
                config: dict | None = None) -> torch.Tensor:
    """x [..., K] (bf16 / fp16 / fp32), weight [N, K] int8, scale [N] fp32 -> [..., N] in x's dtype.
    `config`: the tiles (int8_linear_config); default on a GPU the fastest timed for the shape class
    (`_tuned_config`: host syncs on its first call only), elsewhere the first candidate. Capturable
    in a CUDA graph once run for the shape class."""
    if weight.dtype != torch.int8 or weight.dim() != 2 or weight.stride(1) != 1:
        raise ValueError(f"weight must be int8 [N, K] with a contiguous last dim, got {weight.dtype} "
                         f"{tuple(weight.shape)}")
    n, k = weight.shape
    if x.shape[-1] != k:
        raise ValueError(f"x's last dim {x.shape[-1]} does not match the weight's K {k}")
    if scale.shape != (n,) or scale.dtype != torch.float32:
        raise ValueError(f"scale must be fp32 [{n}], got {scale.dtype} {tuple(scale.shape)}")
    if bias is not None and bias.shape != (n,):
        raise ValueError(f"bias must be [{n}], got {tuple(bias.shape)}")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    out = torch.empty((x2.shape[0], n), dtype=x.dtype, device=x.device)
    if x2.shape[0]:
        if config is None:
            config = _tuned_config(x2, weight, scale, bias, out) if x.is_cuda else int8_linear_config(x2.shape[0])
        _launch(x2, weight, scale, bias, out, config)
    return out.view(*lead, n)
