"""Weight-only int8 linear layer: y = (x @ w.T) * scale (+ bias), w int8 [N, K], one fp32 scale per
output row (symmetric: scale = the row's largest |weight| / 127).

For the small row counts of a draft head's steps (one to a few dozen rows) a linear layer reads its
weights and little else: int8 rows halve the bytes a bf16 layer reads. The kernel streams a tile of
BLOCK_N weight rows along K, widens each int8 tile to the activations' dtype (exact: |w| <= 127) and
accumulates x @ w.T in fp32 on the tensor cores; the row scales apply once at the end.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.runtime.errors import OutOfResources

from specserve.quant.int8_rows import int8_linear_torch as ref_int8_linear  # noqa: F401 - the oracle


@triton.jit(do_not_specialize=["M"])  # one compile for any row count of a tile size
def _int8_linear_kernel(
    x_ptr,  # [M, K]
    w_ptr,  # [N, K] int8
    scale_ptr,  # [N] fp32
    bias_ptr,  # [N] (HAS_BIAS)
    out_ptr,  # [M, N]
    M, N, K,
    stride_xm, stride_wn, stride_om,
    HAS_BIAS: tl.constexpr, INPUT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + rows[:, None].to(tl.int64) * stride_xm + ks[None, :]
    w_ptrs = w_ptr + cols[None, :].to(tl.int64) * stride_wn + ks[:, None]  # [BLOCK_K, BLOCK_N]: w.T's tile
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = (k0 + ks) < K
        x = tl.load(x_ptrs, mask=(rows[:, None] < M) & k_ok[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=k_ok[:, None] & (cols[None, :] < N), other=0)
        acc += tl.dot(x, w.to(x.dtype), input_precision=INPUT_PRECISION)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    acc = acc * tl.load(scale_ptr + cols, mask=cols < N, other=0.0)[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    out_ptrs = out_ptr + rows[:, None].to(tl.int64) * stride_om + cols[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=(rows[:, None] < M) & (cols[None, :] < N))


# (BLOCK_N, BLOCK_K, num_stages) tried per row bucket on a GPU; the first is also the fallback
CANDIDATES = ((32, 128, 3), (32, 512, 5), (64, 256, 4), (128, 256, 3), (32, 256, 4), (64, 512, 3), (128, 128, 4))
_TUNED: dict[tuple, dict] = {}  # (row bucket, N, K, dtype, bias) -> the fastest config timed on this GPU


def row_bucket(m: int) -> int:
    """Rows a tile: 16 (the tensor cores' smallest) up to 16 rows, 32 up to 32, then 64."""
    return 16 if m <= 16 else 32 if m <= 32 else 64


def int8_linear_config(m: int, candidate: tuple[int, int, int] = CANDIDATES[0]) -> dict:
    block_n, block_k, stages = candidate
    return dict(BLOCK_M=row_bucket(m), BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4, num_stages=stages)


def _launch(x2, weight, scale, bias, out, cfg: dict) -> None:
    m, (n, k) = x2.shape[0], weight.shape
    grid = (triton.cdiv(n, cfg["BLOCK_N"]), triton.cdiv(m, cfg["BLOCK_M"]))
    _int8_linear_kernel[grid](
        x2, weight, scale, bias if bias is not None else scale, out, m, n, k,
        x2.stride(0), weight.stride(0), out.stride(0), HAS_BIAS=bias is not None,
        INPUT_PRECISION="ieee" if x2.dtype == torch.float32 else "tf32", **cfg)


def _tuning_key(m: int, n: int, k: int, dtype: torch.dtype, has_bias: bool) -> tuple:
    return row_bucket(m), n, k, dtype, has_bias


def timed_config(m: int, n: int, k: int, dtype: torch.dtype, has_bias: bool = False) -> dict | None:
    """The tiles the first-use timing chose for this shape class, None before it ran."""
    return _TUNED.get(_tuning_key(m, n, k, dtype, has_bias))


def _tuned_config(x2, weight, scale, bias, out) -> dict:
    """The fastest of CANDIDATES for this shape class, timed on first use (a few ms a candidate,
    plus its compile the first time on a machine; Triton caches those on disk). While a CUDA graph
    is being captured nothing can be timed: an untimed class takes the first candidate."""
    m, (n, k) = x2.shape[0], weight.shape
    key = _tuning_key(m, n, k, x2.dtype, bias is not None)
    if key in _TUNED:
        return _TUNED[key]
    if torch.cuda.is_current_stream_capturing():
        return int8_linear_config(m)
    best = None
    for candidate in CANDIDATES:
        cfg = int8_linear_config(m, candidate)
        try:
            _launch(x2, weight, scale, bias, out, cfg)  # compile, warm
        except OutOfResources:  # its tiles need more shared memory than the GPU has (fp32)
            continue
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(2_000_000)  # the device spins (~1 ms) while the host queues the launches: the
        start.record()                # events then time the kernels back to back, not the host's launches
        for _ in range(10):
            _launch(x2, weight, scale, bias, out, cfg)
        end.record()
        end.synchronize()
        if best is None or start.elapsed_time(end) < best[0]:
            best = (start.elapsed_time(end), cfg)
    _TUNED[key] = best[1] if best is not None else int8_linear_config(m)
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
