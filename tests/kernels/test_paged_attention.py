"""paged_attention (Triton) against ref_paged_attention (plain PyTorch loop) on ragged mixed batches."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from specserve.kernels import KernelConfig, paged_attention, ref_paged_attention, select_configs

ATTN_ARGS = ("query", "kv_cache", "query_start_loc", "seq_lens", "block_tables", "scale", "max_query_len",
             "max_seq_len")


def run_both(batch: dict, **overrides) -> tuple[torch.Tensor, torch.Tensor]:
    args = [batch[k] for k in ATTN_ARGS]
    out = torch.full_like(batch["query"], float("nan"))  # poisoned: every row must be written
    paged_attention(*args, out=out, **overrides)
    return out, ref_paged_attention(*args)


# --- small cases: run everywhere (Triton interpreter on the CPU) ---------------------------------

def test_mixed_decode_verify_prefill_batch(paged_batch, close):
    # decode, 1+2 verify, decode at context 1, prefill chunk after a 32-token prefix, fresh prefill
    batch = paged_batch([1, 3, 1, 20, 5], [21, 19, 1, 52, 5], num_heads=4, num_kv_heads=2, head_dim=32,
                        block_size=16, dtype=torch.float32)
    close(*run_both(batch))


def test_split_k_partitions_merge_exactly(paged_batch, close):
    batch = paged_batch([1, 1, 2], [70, 1, 33], num_heads=4, num_kv_heads=1, head_dim=32, block_size=16,
                        dtype=torch.float32, seed=1)
    close(*run_both(batch, num_splits=4))


def test_gqa_group_of_three_and_odd_head_dim(paged_batch, close):
    # SmolLM2-135M has 9 query heads on 3 kv heads; head_dim 48 exercises the padded head-dim path
    batch = paged_batch([2, 9], [9, 30], num_heads=6, num_kv_heads=2, head_dim=48, block_size=8,
                        dtype=torch.float32, seed=2)
    close(*run_both(batch))


def test_float16_inputs(paged_batch, close):
    # bf16 runs in the GPU sweeps only: the Triton 3.9 interpreter computes bf16 tl.dot wrongly
    batch = paged_batch([1, 4], [40, 23], num_heads=8, num_kv_heads=2, head_dim=64, block_size=16,
                        dtype=torch.float16, seed=3)
    close(*run_both(batch))


def test_padded_requests_and_tokens_are_ignored(paged_batch, close):
    # CUDA-graph padding: trailing requests with no query and no context, tokens past query_start_loc[-1]
    batch = paged_batch([1, 2, 0, 0], [17, 6, 0, 0], num_heads=2, num_kv_heads=2, head_dim=32,
                        block_size=16, dtype=torch.float32, seed=4)
    batch["query"] = torch.cat([batch["query"], torch.randn_like(batch["query"][:2])])
    out, ref = run_both(batch)
    close(out[:3], ref[:3])


def run_windowed(batch: dict, window: int, **overrides) -> tuple[torch.Tensor, torch.Tensor]:
    args = [batch[k] for k in ATTN_ARGS]
    out = torch.full_like(batch["query"], float("nan"))
    paged_attention(*args, out=out, sliding_window=window, **overrides)
    return out, ref_paged_attention(*args, sliding_window=window)


@pytest.mark.parametrize("window, splits", [(1, None), (7, None), (24, 4), (60, None)])
def test_sliding_window_matches_reference(paged_batch, close, window, splits):
    # a decode and a verify deep in their contexts (the tiles before the window are skipped), a prefill
    # chunk whose rows' windows start in different tiles, a fresh prefill longer than most windows
    batch = paged_batch([1, 3, 20, 40], [100, 70, 52, 40], num_heads=4, num_kv_heads=2, head_dim=32,
                        block_size=16, dtype=torch.float32, seed=8)
    out, ref = run_windowed(batch, window, **({"num_splits": splits} if splits else {}))
    close(out, ref)
    full = ref_paged_attention(*[batch[k] for k in ATTN_ARGS])
    assert not torch.allclose(ref[:1], full[:1])  # the decode at position 99 sees only its window


def test_sliding_window_wider_than_context_is_full_attention(paged_batch, close):
    batch = paged_batch([1, 6], [30, 6], num_heads=2, num_kv_heads=1, head_dim=32, block_size=8,
                        dtype=torch.float32, seed=9)
    out, ref = run_windowed(batch, 30)
    close(out, ref)
    close(out, ref_paged_attention(*[batch[k] for k in ATTN_ARGS]))


def test_ref_matches_sdpa_for_one_prefill(paged_batch):
    batch = paged_batch([6], [6], num_heads=4, num_kv_heads=2, head_dim=32, block_size=4,
                        dtype=torch.float32, seed=5)
    ref = ref_paged_attention(*[batch[k] for k in ATTN_ARGS])
    pos = torch.arange(6, device=batch["query"].device)
    blocks = batch["block_tables"][0].long()[pos // 4]
    k = batch["kv_cache"][0, blocks, pos % 4].transpose(0, 1)  # [kvh, S, d]
    v = batch["kv_cache"][1, blocks, pos % 4].transpose(0, 1)
    sdpa = F.scaled_dot_product_attention(batch["query"].transpose(0, 1), k, v, is_causal=True,
                                          scale=batch["scale"], enable_gqa=True).transpose(0, 1)
    torch.testing.assert_close(ref, sdpa, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("change, message", [
    (dict(query=torch.zeros(3, 4)), "query must be"),
    (dict(kv_cache=torch.zeros(2, 4, 16, 3, 32)), "multiple of num_kv_heads"),
    (dict(kv_cache=torch.zeros(2, 4, 16, 2, 64)), "head_dim mismatch"),
    (dict(seq_lens=torch.zeros(2, dtype=torch.int64)), "seq_lens must be int32"),
    (dict(query_start_loc=torch.zeros(2, dtype=torch.int32)), "query_start_loc must be"),
    (dict(block_tables=torch.zeros(3, 2, dtype=torch.int32)), "block_tables must be"),
    (dict(out=torch.zeros(3, 4, 32, dtype=torch.float16)), "out must match"),
    (dict(num_splits=3), "power of two"),
    (dict(sliding_window=0), "sliding_window must be"),
])
def test_bad_inputs_raise_clear_errors(change, message):
    args = dict(query=torch.zeros(3, 4, 32), kv_cache=torch.zeros(2, 4, 16, 2, 32),
                query_start_loc=torch.tensor([0, 1, 3], dtype=torch.int32),
                seq_lens=torch.tensor([5, 9], dtype=torch.int32),
                block_tables=torch.zeros(2, 2, dtype=torch.int32), scale=0.1, max_query_len=2, max_seq_len=9)
    args.update(change)
    with pytest.raises(ValueError, match=message):
        paged_attention(**args)


def test_split_choice_depends_on_occupancy_only():
    # few programs and a long context split; a full GPU or a short context does not
    assert select_configs(1, 1, 8, 4, 128, 2, 1, 32768, 132)[2] > 1
    assert select_configs(64, 64, 8, 4, 128, 2, 1, 4096, 132)[2] == 1
    assert select_configs(1, 1, 8, 4, 128, 2, 1, 200, 132)[2] == 1


# --- GPU sweeps ---------------------------------------------------------------------------------

MIXED_Q = [1, 1, 5, 5, 1, 300, 77, 1]  # decodes, k=4 verifies, chunk after a prefix, fresh prefill
MIXED_S = [1, 700, 5, 1234, 2000, 1000, 77, 129]


@pytest.mark.gpu
@pytest.mark.parametrize("qpk", [1, 3, 4, 8])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("block_size", [16, 32])
def test_gpu_mixed_batch_bf16(paged_batch, close, qpk, head_dim, block_size):
    batch = paged_batch(MIXED_Q, MIXED_S, num_heads=2 * qpk, num_kv_heads=2, head_dim=head_dim,
                        block_size=block_size, dtype=torch.bfloat16, seed=qpk * head_dim + block_size)
    close(*run_both(batch))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_gpu_mixed_batch_other_dtypes(paged_batch, close, dtype, head_dim):
    batch = paged_batch(MIXED_Q, MIXED_S, num_heads=8, num_kv_heads=2, head_dim=head_dim, block_size=16,
                        dtype=dtype, seed=head_dim)
    close(*run_both(batch))


@pytest.mark.gpu
@pytest.mark.parametrize("q_lens, seq_lens", [([1], [32768]), ([5, 5], [20000, 3001]), ([1, 1, 1], [9000, 17, 4097])])
def test_gpu_long_context_split_k(paged_batch, close, q_lens, seq_lens):
    batch = paged_batch(q_lens, seq_lens, num_heads=32, num_kv_heads=8, head_dim=128, block_size=16,
                        dtype=torch.bfloat16, seed=len(q_lens))
    torch.cuda.synchronize()
    assert select_configs(len(q_lens), len(q_lens), 8, 4, 128, 2, max(q_lens), max(seq_lens),
                          torch.cuda.get_device_properties(0).multi_processor_count)[2] > 1
    close(*run_both(batch))


@pytest.mark.gpu
@pytest.mark.parametrize("window", [1, 100, 512, 4096])
@pytest.mark.parametrize("qpk, head_dim", [(1, 128), (4, 256)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_sliding_window(paged_batch, close, window, qpk, head_dim, dtype):
    # (4, 256): Gemma 3 270M's 4 query heads on one kv head of 256 dims, window 512
    batch = paged_batch(MIXED_Q, MIXED_S, num_heads=2 * qpk, num_kv_heads=2, head_dim=head_dim, block_size=16,
                        dtype=dtype, seed=window + qpk)
    close(*run_windowed(batch, window))


@pytest.mark.gpu
def test_gpu_sliding_window_split_k_decode(paged_batch, close):
    batch = paged_batch([1, 1, 5], [32768, 9000, 4100], num_heads=8, num_kv_heads=2, head_dim=256, block_size=16,
                        dtype=torch.bfloat16, seed=12)
    close(*run_windowed(batch, 4096, num_splits=8))


@pytest.mark.gpu
def test_gpu_decode_batch_64(paged_batch, close):
    seq_lens = torch.randint(1, 4097, (64,), generator=torch.Generator().manual_seed(0)).tolist()
    batch = paged_batch([1] * 64, seq_lens, num_heads=32, num_kv_heads=8, head_dim=128, block_size=16,
                        dtype=torch.bfloat16)
    close(*run_both(batch))


@pytest.mark.gpu
@pytest.mark.parametrize("short, long, splits", [
    (KernelConfig(16, 16, 4, 2), KernelConfig(64, 16, 4, 2), 2),
    (KernelConfig(32, 128, 8, 4), KernelConfig(128, 128, 8, 2), 8),
    (KernelConfig(64, 32, 2, 1), KernelConfig(64, 64, 4, 3), 16),
])
def test_gpu_config_overrides_stay_exact(paged_batch, close, short, long, splits):
    batch = paged_batch(MIXED_Q, MIXED_S, num_heads=32, num_kv_heads=8, head_dim=128, block_size=16,
                        dtype=torch.bfloat16, seed=splits)
    close(*run_both(batch, short_config=short, long_config=long, num_splits=splits))


@pytest.mark.gpu
@pytest.mark.parametrize("q_len", [1, 5])
def test_gpu_cuda_graph_replays_new_contents(paged_batch, close, q_len):
    num_reqs, num_blocks_per_req = 8, 64
    shape = dict(num_heads=32, num_kv_heads=8, head_dim=128, block_size=16, dtype=torch.bfloat16)
    first = paged_batch([q_len] * num_reqs, [500] * num_reqs, seed=10,
                        spare_blocks=num_blocks_per_req * num_reqs, **shape)
    static = {k: v.clone() if torch.is_tensor(v) else v for k, v in first.items()}
    max_seq_len = num_blocks_per_req * 16
    width = static["block_tables"].shape[1]
    static["block_tables"] = torch.zeros(num_reqs, num_blocks_per_req, dtype=torch.int32, device="cuda")
    static["block_tables"][:, :width] = first["block_tables"]
    out = torch.empty_like(static["query"])
    args = lambda: [static[k] for k in ATTN_ARGS[:6]] + [q_len, max_seq_len]  # noqa: E731
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        paged_attention(*args(), out=out)  # compile outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        paged_attention(*args(), out=out)
    # new step: other lengths (one request padded to nothing), other blocks, other query
    seq_lens = [1000, 1, 17, 333, 64 * 16, 5, 900, 0]
    q_lens = [q_len if s else 0 for s in seq_lens]
    q_lens = [min(q, s) for q, s in zip(q_lens, seq_lens)]
    new = paged_batch(q_lens, [max(s, 1) for s in seq_lens], seed=11, **shape)
    assert new["kv_cache"].shape[1] <= static["kv_cache"].shape[1]
    static["kv_cache"].zero_()[:, :new["kv_cache"].shape[1]] = new["kv_cache"]
    static["seq_lens"].copy_(torch.tensor(seq_lens, dtype=torch.int32))
    static["query_start_loc"].copy_(new["query_start_loc"])
    static["block_tables"][:] = new["block_tables"][:, :num_blocks_per_req]
    static["query"][:new["query"].shape[0]] = new["query"]
    graph.replay()
    num_valid = sum(q_lens)
    ref = ref_paged_attention(*[static[k] for k in ATTN_ARGS])
    close(out[:num_valid], ref[:num_valid])


@pytest.mark.gpu
def test_gpu_cache_over_2_31_elements_uses_64bit_offsets(paged_batch, close):
    # 4 GiB bf16 cache: block ids near the end address past 2**31 elements
    batch = paged_batch([1, 5, 40], [3000, 700, 100], num_heads=32, num_kv_heads=8, head_dim=128,
                        block_size=16, dtype=torch.bfloat16, seed=7)
    small = batch["kv_cache"]
    num_blocks = (1 << 31) // (small[0, 0].numel()) + 64
    big = torch.empty((2, num_blocks) + tuple(small.shape[2:]), dtype=small.dtype, device=small.device)
    shift = num_blocks - small.shape[1]
    big[:, shift:] = small
    batch["kv_cache"] = big
    batch["block_tables"] = batch["block_tables"] + shift
    assert big.numel() >= 2**31
    close(*run_both(batch))
    del big
