"""The weight-only int8 linear kernel against its fp32 oracle (interpreter on the CPU: fp32 and fp16,
whose dots the interpreter computes exactly as numpy does; bf16 on a GPU)."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from tests.kernels.conftest import DEVICE

from specserve.kernels.int8_linear import (CANDIDATES, GEMV_CANDIDATES, MAX_PREFETCH_LINES, WIDE_CANDIDATES, candidates,
                                           int8_linear, int8_linear_config, prefetch_lines, ref_int8_linear)
from specserve.quant.int8_rows import quantize_int8_rows

ATOL = {torch.float32: 1e-4, torch.float16: 2e-2, torch.bfloat16: 1.5e-1}
SPLITS = [c for c in CANDIDATES if c[3] > 1]  # the tilings split over K


def _check(m: int, n: int, k: int, dtype: torch.dtype, bias: bool, seed: int, config: dict | None = None) -> None:
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen)
    q, s = quantize_int8_rows(w)
    x = torch.randn(m, k, generator=gen).to(dtype)
    b = torch.randn(n, generator=gen).to(dtype) if bias else None
    q, s, x = q.to(DEVICE), s.to(DEVICE), x.to(DEVICE)
    b = b.to(DEVICE) if b is not None else None
    out = int8_linear(x, q, s, b, config=config)
    ref = ref_int8_linear(x, q, s, b)
    assert out.dtype == dtype and out.shape == (m, n)
    torch.testing.assert_close(out.float(), ref.float(), atol=ATOL[dtype] * (k / 64) ** 0.5, rtol=1e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("m,n,k,bias", [(1, 96, 64, False), (5, 100, 300, True), (20, 33, 512, False),
                                        (70, 64, 130, True)])
def test_int8_linear_matches_the_oracle(m, n, k, bias, dtype):
    """Row counts below, at and past one tile, ragged N and K (masked tiles), with and without bias
    (the first candidate's tiles, on a GPU too: timing every candidate is the bf16 test's)."""
    _check(m, n, k, dtype, bias, seed=m * n + k, config=int8_linear_config(m))


@pytest.mark.parametrize("candidate", SPLITS)
@pytest.mark.parametrize("m,n,k,bias", [(3, 72, 1000, True), (16, 40, 300, False)])
def test_int8_linear_split_over_k_matches_the_oracle(m, n, k, bias, candidate):
    """Each split-over-K tiling: K ranges that end mid-tile, splits left with no K at all (300 over 8
    splits of 256), the partial sums' reduction with the bias."""
    _check(m, n, k, torch.float32, bias, seed=k + candidate[3], config=int8_linear_config(m, candidate))


@pytest.mark.parametrize("candidate", WIDE_CANDIDATES)
def test_int8_linear_wide_tiles_match_the_oracle(candidate):
    """The 32- and 64-row buckets' wide tiles: ragged N and K, rows past one tile."""
    _check(70, 300, 200, torch.float32, True, seed=sum(candidate), config=int8_linear_config(70, candidate))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("candidate", GEMV_CANDIDATES)
@pytest.mark.parametrize("n,k,bias", [(40, 1000, True), (96, 300, False)])
def test_int8_one_row_kernel_matches_the_oracle(n, k, bias, candidate, dtype):
    """The one-row kernel's tiles: ragged N and K (K ranges that end mid-tile, splits with no K left),
    the partial sums' reduction with the bias."""
    _check(1, n, k, dtype, bias, seed=n + k + sum(candidate), config=int8_linear_config(1, candidate, gemv=True))


def test_one_row_products_time_both_kernels_and_more_rows_the_tensor_cores_alone():
    assert {gemv for _, gemv in candidates(1)} == {False, True}
    assert not any(gemv for _, gemv in candidates(2)) and not any(gemv for _, gemv in candidates(40))
    with pytest.raises(ValueError, match="one row"):
        int8_linear_config(2, GEMV_CANDIDATES[0], gemv=True)


def test_a_candidate_agrees_with_the_first_up_to_rounding_only():
    """The first-use timing leaves out a candidate whose output is not the first candidate's up to rounding."""
    from specserve.kernels.int8_linear import _agrees

    x = torch.randn(3, 700, generator=torch.Generator().manual_seed(0))
    q, s = quantize_int8_rows(torch.randn(50, 700, generator=torch.Generator().manual_seed(1)))
    first = int8_linear(x, q, s, config=int8_linear_config(3)).float()
    for candidate in (CANDIDATES[3], CANDIDATES[-1]):  # other tiles, a split over K
        assert _agrees(int8_linear(x.half(), q, s, config=int8_linear_config(3, candidate)), first)
    assert _agrees(int8_linear(x[:1], q, s, config=int8_linear_config(1, GEMV_CANDIDATES[3], True)), first[:1])
    wrong = first.clone()
    wrong[1, 7] += 0.1 * first.abs().max()
    assert not _agrees(wrong, first)
    assert not _agrees(torch.zeros_like(first), first)


def test_a_split_launch_sets_its_tile_counts_back_to_zero():
    """Split over K, a tile's last program adds the shares and sets the tile's count back: the next
    launch over the same weights (a CUDA graph's replay too) starts from zeros and gives the same values."""
    from specserve.kernels.int8_linear import _COUNTS, _RETIRED

    q, s = quantize_int8_rows(torch.randn(72, 1000, generator=torch.Generator().manual_seed(2)))
    q, s = q.to(DEVICE), s.to(DEVICE)
    x = torch.randn(3, 1000, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    config = int8_linear_config(3, SPLITS[0])
    first = int8_linear(x, q, s, config=config)
    counts = _COUNTS[(q.data_ptr(), q.device)]
    assert not counts.any()
    assert torch.equal(int8_linear(x, q, s, config=config), first) and not counts.any()
    # more rows, more tiles than the buffer holds: a larger one, the first kept for graphs that captured it
    many = torch.randn(1000, 1000, generator=torch.Generator().manual_seed(4)).to(DEVICE)  # 16 x 3 tiles > 36
    out = int8_linear(many, q, s, config=int8_linear_config(1000, SPLITS[0]))
    torch.testing.assert_close(out, ref_int8_linear(many, q, s), atol=1e-3, rtol=1e-3)
    assert any(c is counts for c in _RETIRED) and _COUNTS[(q.data_ptr(), q.device)].numel() > counts.numel()


def test_prefetched_lines_fit_a_quarter_of_the_l2_and_a_split_of_a_row():
    l2 = 50 * 2**20  # an H100's / H200's L2
    assert prefetch_lines(4096, 2048, 2, l2) == 8  # an 8B head's o, split in 2: 8 MiB of its 16 MiB
    assert prefetch_lines(32768, 4096, 1, l2) == 2  # its draft LM head: 8 MiB of 128 MiB
    assert prefetch_lines(576, 576, 1, l2) == 4  # a small layer: 4 of its rows' 5 lines (a power of 2)
    assert prefetch_lines(64, 1 << 20, 1, l2) == MAX_PREFETCH_LINES
    assert prefetch_lines(1 << 20, 4096, 1, l2) == 0  # more rows than a line each fits: none
    for n, k_split, split in ((4096, 2048, 2), (6144, 4096, 1), (4096, 3584, 4), (1000, 512, 8)):
        lines = prefetch_lines(n, k_split, split, l2)
        assert lines & (lines - 1) == 0 and n * split * lines * 128 <= l2 // 4 and (lines - 1) * 128 < k_split


_SM90_PTX = textwrap.dedent("""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from specserve.kernels.int8_linear import _int8_gemv_kernel, _int8_linear_kernel

    common = dict(w_ptr="*i8", scale_ptr="*fp32", bias_ptr="*fp32", part_ptr="*fp32", count_ptr="*i32",
                  N="i32", K="i32", K_SPLIT="i32", stride_wn="i32")
    kernels = {_int8_linear_kernel: dict(x_ptr="*bf16", out_ptr="*bf16", M="i32", stride_xm="i32", stride_om="i32"),
               _int8_gemv_kernel: dict(x_ptr="*bf16", out_ptr="*bf16")}
    tiles = {_int8_linear_kernel: dict(INPUT_PRECISION="tf32", BLOCK_M=16, BLOCK_N=32, BLOCK_K=256),
             _int8_gemv_kernel: dict(BLOCK_N=16, BLOCK_K=512)}
    for kernel, own in kernels.items():
        for prefetch in (8, 0):
            constants = dict(tiles[kernel], HAS_BIAS=False, SPLIT_K=2, PDL=True, PREFETCH=prefetch)
            types = {**common, **own}
            signature = {name: "constexpr" if name in constants else types[name] for name in kernel.arg_names}
            at = {(kernel.arg_names.index(name),): value for name, value in constants.items()}
            src = ASTSource(kernel, signature, constexprs=at)
            ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4)).asm["ptx"]
            print(kernel.__name__, prefetch, ptx.find("prefetch.global.L2"), ptx.find("griddepcontrol.wait"))
""")


def test_products_prefetch_their_weights_before_the_pdl_wait_in_hopper_code():
    """Compiled for sm_90 (no GPU needed: Triton's own compiler, in a process without the interpreter),
    both kernels with PREFETCH ask the L2 for weight lines before `griddepcontrol.wait`, and without it
    do not."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-c", _SM90_PTX], capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    rows = [line.split() for line in run.stdout.splitlines()]
    assert [(name, prefetch) for name, prefetch, *_ in rows] == [(name, prefetch) for name in (
        "_int8_linear_kernel", "_int8_gemv_kernel") for prefetch in ("8", "0")]
    for name, prefetch, at, wait in rows:
        assert int(wait) >= 0 and ((0 <= int(at) < int(wait)) if prefetch != "0" else int(at) == -1), (name, prefetch)


def test_quantize_int8_rows_round_trips_within_half_a_step():
    w = torch.randn(17, 40)
    w[3] = 0.0  # an all-zero row: scale 1, zeros
    q, s = quantize_int8_rows(w)
    assert q.dtype == torch.int8 and s.dtype == torch.float32 and s[3] == 1 and not q[3].any()
    assert int(q.abs().max()) == 127
    assert ((q.float() * s[:, None] - w).abs() <= s[:, None] / 2 + 1e-7).all()


def test_int8_linear_keeps_leading_dims_and_refuses_bad_weights():
    q, s = quantize_int8_rows(torch.randn(8, 16))
    x = torch.randn(2, 3, 16)
    out = int8_linear(x.to(DEVICE), q.to(DEVICE), s.to(DEVICE))
    assert out.shape == (2, 3, 8)
    torch.testing.assert_close(out.cpu(), ref_int8_linear(x, q, s), atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="weight must be int8"):
        int8_linear(x, q.float(), s)
    with pytest.raises(ValueError, match="does not match"):
        int8_linear(torch.randn(2, 15), q, s)
    with pytest.raises(ValueError, match="scale must be fp32"):
        int8_linear(x, q, s.half())


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 5, 16, 17, 64, 200])
@pytest.mark.parametrize("n,k", [(6144, 4096), (4096, 14336), (32768, 4096), (1000, 576)])
def test_gpu_int8_linear_bf16(m, n, k):
    """Up to 16 rows (what Int8Linear sends the kernel) the tiles the first-use timing picks, every
    candidate compiled and timed; more rows the first candidate's (each candidate's compile takes
    seconds: timing three row buckets ran past a test run's time)."""
    _check(m, n, k, torch.bfloat16, bias=False, seed=m + n, config=None if m <= 16 else int8_linear_config(m))


@pytest.mark.gpu
@pytest.mark.parametrize("candidate", GEMV_CANDIDATES)
@pytest.mark.parametrize("n,k", [(4096, 4096), (4096, 14336), (1000, 576)])
def test_gpu_int8_one_row_kernel_bf16(n, k, candidate):
    """Each of the one-row kernel's tiles compiled and run (the first-use timing leaves out a candidate
    that does not compile: this test does not)."""
    _check(1, n, k, torch.bfloat16, bias=False, seed=n + sum(candidate), config=int8_linear_config(1, candidate, True))


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 5])
def test_gpu_split_launches_give_the_same_bits_every_time(m):
    """Split over K, the shares are added in split order whichever program ends last: repeated launches
    give identical bits, and each equals the oracle up to rounding."""
    for candidate in SPLITS:
        config = int8_linear_config(m, candidate)
        _check(m, 6144, 4096, torch.bfloat16, bias=True, seed=m, config=config)
        gen = torch.Generator().manual_seed(m)
        q, s = quantize_int8_rows(torch.randn(4096, 4096, generator=gen))
        q, s = q.to(DEVICE), s.to(DEVICE)
        x = torch.randn(m, 4096, generator=gen).to(DEVICE, torch.bfloat16)
        first = int8_linear(x, q, s, config=config)
        assert all(torch.equal(int8_linear(x, q, s, config=config), first) for _ in range(20))


@pytest.mark.gpu
def test_gpu_products_prefetching_their_weights_give_the_same_bits(monkeypatch):
    """With PDL on (SPECSERVE_PDL=1, Hopper) and SPECSERVE_INT8_PREFETCH=1 a product prefetches its weight
    lines before the wait; the outputs are those of the same tiles without the prefetch, after a norm
    launched with PDL too."""
    import importlib

    from specserve.kernels import pdl
    # the module, not the package's `int8_linear` (the function of the same name)
    kernel = importlib.import_module("specserve.kernels.int8_linear")
    from specserve.kernels.rms_norm import rms_norm

    monkeypatch.setattr(pdl, "_BY_DEVICE", {})
    monkeypatch.setattr(kernel, "_L2_BYTES", {})
    monkeypatch.setenv(pdl.ENV, "1")
    monkeypatch.setenv(kernel.PREFETCH_ENV, "1")
    if not pdl.pdl_enabled(DEVICE):
        pytest.skip("no PDL before Hopper: nothing is prefetched")
    assert kernel._l2_bytes(DEVICE) > 0
    gen = torch.Generator().manual_seed(5)
    q, s = quantize_int8_rows(torch.randn(6144, 4096, generator=gen))
    q, s = q.to(DEVICE), s.to(DEVICE)
    x = torch.randn(5, 4096, generator=gen).to(DEVICE, torch.bfloat16)
    gain = torch.ones(4096, device=DEVICE, dtype=torch.bfloat16)
    configs = [int8_linear_config(5, c) for c in (CANDIDATES[0], SPLITS[0])]
    configs += [int8_linear_config(1, c, gemv=True) for c in (GEMV_CANDIDATES[0], GEMV_CANDIDATES[3])]
    for config in configs:
        rows = x[:1] if config.get("GEMV") else x
        monkeypatch.setitem(kernel._L2_BYTES, DEVICE.index or 0, 50 * 2**20)
        got = [int8_linear(rms_norm(rows, gain, 1e-5), q, s, config=config) for _ in range(3)]
        monkeypatch.setitem(kernel._L2_BYTES, DEVICE.index or 0, 0)
        want = int8_linear(rms_norm(rows, gain, 1e-5), q, s, config=config)
        assert all(torch.equal(g, want) for g in got), config


def test_int8_layer_reads_int8_rows_up_to_its_row_limit_and_the_float_weights_past_it():
    """Int8Linear: up to INT8_MAX_ROWS rows the int8 product (its PyTorch math off CUDA), past them the
    float weights it keeps (where the kernel is slower)."""
    from specserve.quant.int8_linear import INT8_MAX_ROWS, Int8Linear

    gen = torch.Generator().manual_seed(3)
    w, b = torch.randn(24, 40, generator=gen), torch.randn(24, generator=gen)
    layer = Int8Linear(w, b)
    q, s = quantize_int8_rows(w)
    small = torch.randn(INT8_MAX_ROWS, 40, generator=gen)
    large = torch.randn(INT8_MAX_ROWS + 1, 40, generator=gen)
    assert torch.equal(layer(small), ref_int8_linear(small, q, s, b))
    assert torch.equal(layer(large), torch.nn.functional.linear(large, w, b))
    assert not torch.allclose(layer(small), torch.nn.functional.linear(small, w, b), atol=1e-5, rtol=0)
