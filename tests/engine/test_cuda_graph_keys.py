"""Which captured CUDA graph a step replays (engine/cuda_graphs.py): decode and verification steps by
padded batch size and query length, prefill steps (alone or beside decodes) by padded token count. The
choice is plain python over ints: checked here without a GPU (the replays: test_gpu_backend.py)."""
from __future__ import annotations

import torch

from specserve.engine.cuda_graphs import PREFILL_LENS, StepGraphs


def graphs(max_prefill_tokens: int, query_lens=(1, 5), max_num_seqs: int = 8) -> StepGraphs:
    # nothing is captured: the buffers are made, and the choice needs no more
    return StepGraphs(torch.nn.Linear(2, 2), [], torch.device("cpu"), 16, 8192, max_num_seqs, query_lens,
                        max_prefill_tokens)


def test_decode_and_verification_steps_pad_the_batch():
    g = graphs(0)
    assert g.prefill_lens == ()
    assert g.key(1, 1, 1) == (1, 1, 1) and g.key(3, 1, 3) == (4, 4, 1) and g.key(3, 4, 9) == (4, 20, 5)
    assert g.key(8, 5, 40) == (8, 40, 5)
    assert g.key(9, 1, 9) is None  # more requests than any graph holds
    assert g.key(1, 6, 6) is None  # a prefill, and no prefill graphs


def test_prefill_steps_pad_the_tokens_and_the_requests():
    g = graphs(300)
    assert g.prefill_lens == tuple(t for t in PREFILL_LENS if 5 < t <= 300) and g.prefill_lens[0] == 16
    assert g.key(1, 6, 6) == (8, 16, 16) and g.key(1, 17, 17) == (8, 24, 24) and g.key(1, 100, 100) == (8, 128, 128)
    assert g.key(1, 256, 256) == (8, 256, 256) and g.key(1, 257, 257) is None  # more tokens: eager
    # an admission: a prompt of 128 tokens beside 7 decodes
    assert g.key(8, 128, 135) == (8, 192, 192)
    assert g.key(9, 128, 136) is None
    assert g.holds(2, 100, 101) and not g.holds(2, 100, 300)
    assert len(g.input_ids) == 256  # the buffers hold the largest graph's tokens


def test_prefill_graphs_split_the_kv_range_at_most_as_their_tokens_do():
    """The attention launch for short queries splits the KV range by max_seq_len, and its partial sums
    take tokens x heads x splits x head_dim floats: prefill graphs are captured with their token count."""
    g = graphs(512)
    assert g._meta((8, 40, 5)).max_seq_len == 8192
    assert g._meta((8, 96, 96)).max_seq_len == 96 and g._meta((8, 512, 512)).max_seq_len == 512
