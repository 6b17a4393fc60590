"""TritonAttentionBackend.forward against the torch reference backend on one mixed step."""
from __future__ import annotations

import pytest
import torch

from specserve.models.layers.attention import AttentionMetadata
from specserve.models.layers.torch_attn import TorchAttentionBackend


def make_step(q_lens: list[int], seq_lens: list[int], num_heads: int, num_kv_heads: int, head_dim: int,
              block_size: int, dtype: torch.dtype, device: torch.device, seed: int = 0):
    """A step's metadata, new q/k/v and a cache already holding each request's earlier context."""
    gen = torch.Generator().manual_seed(seed)
    blocks_per_req = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(blocks_per_req) + 2
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    block_tables = torch.zeros(len(seq_lens), max(blocks_per_req), dtype=torch.int32)
    slots = []
    for i, (q_len, seq_len) in enumerate(zip(q_lens, seq_lens)):
        table = [perm.pop() for _ in range(blocks_per_req[i])]
        block_tables[i, :len(table)] = torch.tensor(table, dtype=torch.int32)
        slots += [table[p // block_size] * block_size + p % block_size for p in range(seq_len - q_len, seq_len)]
    num_tokens = sum(q_lens)
    rand = lambda *shape: torch.randn(*shape, generator=gen).to(dtype).to(device)  # noqa: E731
    meta = AttentionMetadata(
        num_reqs=len(q_lens), num_tokens=num_tokens, max_query_len=max(q_lens), max_seq_len=max(seq_lens),
        query_start_loc=torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32,
                                     device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=block_tables.to(device), slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        query_lens_cpu=list(q_lens), seq_lens_cpu=list(seq_lens), block_size=block_size)
    qkv = (rand(num_tokens, num_heads, head_dim), rand(num_tokens, num_kv_heads, head_dim),
           rand(num_tokens, num_kv_heads, head_dim))
    return meta, qkv, rand(2, num_blocks, block_size, num_kv_heads, head_dim)


def run_backends(meta, qkv, cache, scale, sliding_window=None):
    from specserve.models.layers.triton_attn import TritonAttentionBackend

    outs, caches = [], []
    for backend in (TritonAttentionBackend(), TorchAttentionBackend()):
        c = cache.clone()
        backend.prepare(meta)
        outs.append(backend.forward(*qkv, c, meta, scale, sliding_window=sliding_window))
        caches.append(c)
    return outs, caches


@pytest.mark.parametrize("window", [None, 5])
def test_backend_matches_torch_backend_on_mixed_step(window):
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    # decode, verify (1 + 3 drafts), prefill chunk behind a cached prefix, fresh prefill
    meta, qkv, cache = make_step([1, 4, 12, 6], [23, 9, 40, 6], num_heads=4, num_kv_heads=2, head_dim=32,
                                 block_size=16, dtype=torch.float32, device=device)
    (out, ref), (cache_out, cache_ref) = run_backends(meta, qkv, cache, 32 ** -0.5, window)
    assert torch.equal(cache_out, cache_ref)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("window", [1, 5, 16])
def test_torch_backend_sliding_window_matches_reference(window):
    from specserve.kernels import ref_paged_attention

    # decodes, a verify, a chunk behind a prefix, and a prefill of 40 (longer than the short-query group)
    meta, qkv, cache = make_step([1, 1, 4, 12, 40], [23, 1, 9, 40, 40], num_heads=4, num_kv_heads=2, head_dim=32,
                                 block_size=4, dtype=torch.float32, device=torch.device("cpu"), seed=window)
    backend = TorchAttentionBackend()
    backend.prepare(meta)
    scale = 32 ** -0.5
    out = backend.forward(*qkv, cache, meta, scale, sliding_window=window)
    full = backend.forward(*qkv, cache, meta, scale)  # a global layer of the same step: its own mask
    args = (qkv[0], cache, meta.query_start_loc, meta.seq_lens, meta.block_tables, scale)
    torch.testing.assert_close(out, ref_paged_attention(*args, sliding_window=window), atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(full, ref_paged_attention(*args), atol=2e-5, rtol=2e-5)
    assert not torch.allclose(out, full)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("num_heads, num_kv_heads, window", [(6, 2, None), (6, 2, 5), (4, 4, None), (8, 1, None)])
def test_torch_backend_half_precision_short_queries_match_the_reference(dtype, num_heads, num_kv_heads, window):
    """On the CPU in bf16 / fp16 the decode group (one query row per request) and the verification group
    (a few rows per request) run the query heads that share a KV head as rows of one query
    (`_folded_attention`; a lone row of a KV head per query head is doubled): the same attention as the
    reference over every head, window and padded request; a long prefill chunk is not folded."""
    from specserve.kernels import ref_paged_attention
    from specserve.models.layers import torch_attn

    meta, qkv, cache = make_step([1, 1, 1, 4, 2, 40], [23, 1, 40, 9, 30, 45], num_heads=num_heads,
                                 num_kv_heads=num_kv_heads, head_dim=32, block_size=4, dtype=dtype,
                                 device=torch.device("cpu"), seed=num_heads)
    backend = TorchAttentionBackend()
    backend.prepare(meta)
    scale = 32 ** -0.5
    calls = []
    folded = torch_attn._folded_attention
    torch_attn._folded_attention = lambda *a: calls.append(a[0].shape) or folded(*a)
    try:
        out = backend.forward(*qkv, cache, meta, scale, sliding_window=window)  # writes the step's KV
    finally:
        torch_attn._folded_attention = folded
    # the three decodes, then the two verifications (padded to 4 rows); the 40-token chunk is not folded
    assert calls == [torch.Size([3, num_heads, 1, 32]), torch.Size([2, num_heads, 4, 32])]
    ref = ref_paged_attention(qkv[0].float(), cache.float(), meta.query_start_loc, meta.seq_lens, meta.block_tables,
                              scale, sliding_window=window)
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)


def test_backend_imports_and_names_itself():
    from specserve.models.layers.triton_attn import TritonAttentionBackend

    assert TritonAttentionBackend.name == "triton"


@pytest.mark.gpu
@pytest.mark.parametrize("block_size", [16, 32])
def test_gpu_backend_matches_torch_backend_bf16(block_size):
    q_lens = [1] * 6 + [5] * 4 + [200, 64]
    seq_lens = [3000, 1, 17, 400, 999, 2048, 5, 700, 1500, 33, 1200, 64]
    meta, qkv, cache = make_step(q_lens, seq_lens, num_heads=32, num_kv_heads=8, head_dim=128,
                                 block_size=block_size, dtype=torch.bfloat16, device=torch.device("cuda"))
    (out, ref), (cache_out, cache_ref) = run_backends(meta, qkv, cache, 128 ** -0.5)
    assert torch.equal(cache_out, cache_ref)
    err = ((out.double() - ref.double()).norm() / ref.double().norm()).item()
    assert err < 1.5e-2
    (out, ref), _ = run_backends(meta, qkv, cache, 128 ** -0.5, sliding_window=512)
    err = ((out.double() - ref.double()).norm() / ref.double().norm()).item()
    assert err < 1.5e-2


def test_eagle_steps_launched_ahead_on_the_triton_kernels(tiny_llama_dir, trained_head_dir):
    """The engine on the Triton attention kernels (the interpreter on a CPU, where the graphs are not
    captured; a GPU runs test_eagle.py's graph case), drafting on the device with async drafting:
    steps launched ahead of their predecessor's tokens are moved back on the device, and the kernels
    read those context lengths and KV slots: greedy output is the torch backend's (fp32)."""
    from specserve import LLM, SamplingParams
    from tests.spec_decode.conftest import spec_prompts

    device = "cuda" if torch.cuda.is_available() else "cpu"
    spec = dict(method="eagle", model=str(trained_head_dir), num_speculative_tokens=3, adaptive=False)
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in spec_prompts()[:4]]
    outs = {}
    for name, kw in {"torch": dict(attention_backend="torch"),
                     "triton": dict(attention_backend="triton", async_drafting=True)}.items():
        # a KV cache of its own size: on a GPU the first engine's cache still holds its share of memory
        llm = LLM(str(tiny_llama_dir), dtype="float32", device=device, max_num_seqs=4, max_num_batched_tokens=64,
                  block_size=8, num_kv_blocks=256, async_scheduling=True, enforce_eager=True,
                  speculative_config=spec, **kw)
        llm.engine.proposer.drafts_on_device = True
        outs[name] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        stats = llm.engine.stats()
        assert (stats["num_ahead_steps"] > 0) == (name == "triton") and stats["num_failed_steps"] == 0
        assert stats["spec_decode_num_accepted_tokens"] > 0 and stats["num_used_blocks"] == 0
    assert outs["triton"] == outs["torch"]
