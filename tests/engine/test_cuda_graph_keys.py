"""Which captured CUDA graph a step replays (engine/cuda_graphs.py): decode and verification steps by
padded batch size and query length, one request's prefill by padded query length. The choice is
plain python over ints: checked here without a GPU (the replays themselves: test_gpu_backend.py)."""
from __future__ import annotations

import torch

from specserve.engine.cuda_graphs import PREFILL_LENS, SHORT_QUERY_MAX, DecodeGraphs


def graphs(max_prefill_tokens: int, query_lens=(1, 5), max_num_seqs: int = 8) -> DecodeGraphs:
    # nothing is captured: the buffers are made, and the choice needs no more
    return DecodeGraphs(torch.nn.Linear(2, 2), [], torch.device("cpu"), 16, 8192, max_num_seqs, query_lens,
                        max_prefill_tokens)


def test_decode_and_verification_steps_pad_the_batch():
    g = graphs(0)
    assert g.prefill_lens == ()
    assert g.key(1, 1) == (1, 1) and g.key(3, 1) == (4, 1) and g.key(3, 4) == (4, 5) and g.key(8, 5) == (8, 5)
    assert g.key(9, 1) is None  # more requests than any graph holds
    assert g.key(1, 6) is None  # a prefill, and no prefill graphs


def test_one_request_prefills_pad_the_query():
    g = graphs(300)
    assert g.prefill_lens == tuple(q for q in PREFILL_LENS if 5 < q <= 300) and g.prefill_lens[0] == 16
    assert g.key(1, 6) == (1, 16) and g.key(1, 17) == (1, 24) and g.key(1, 100) == (1, 128)
    assert g.key(1, 256) == (1, 256) and g.key(1, 257) is None  # longer than the budget: eager
    assert g.key(2, 6) is None  # several requests' prefills run eagerly
    assert g.holds(1, 200) and not g.holds(2, 200)
    assert len(g.input_ids) == 256  # the buffers hold the largest graph's tokens


def test_only_graphs_whose_queries_can_meet_the_split_launch_split_the_kv():
    """A query of at most SHORT_QUERY_MAX tokens may run in the attention kernel's launch split along
    the KV range, which max_seq_len sizes; a graph whose every query is longer captures no splits."""
    g = graphs(512)
    assert g._meta(1, SHORT_QUERY_MAX).max_seq_len == 8192 and g._meta(4, 5).max_seq_len == 8192
    assert g._meta(1, 96).max_seq_len == 96 and g._meta(1, 512).max_seq_len == 512
