"""Which captured CUDA graph a step replays (engine/cuda_graphs.py): decode and verification steps by
padded batch size and query length, prefill steps (alone or beside decodes) by padded token count. The
choice is plain python over ints: checked here without a GPU (the replays: test_gpu_backend.py)."""
from __future__ import annotations

import torch

from specserve.engine.cuda_graphs import PREFILL_LENS, StepGraphs, prefill_graph_tokens, query_lens_up_to


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


def test_a_verification_of_fewer_drafts_than_the_cap_replays_a_graph_of_its_length():
    """Speculating with a cap of 4 drafts, a step whose requests verify one draft each (adaptive k at many
    requests) computes 2 tokens a request, not 5: on 8B shapes at 64 requests, padded to 1 + 4 tokens a
    request, such a step cost ~2 plain steps on an H200 against ~1.4 from a graph of its own length."""
    g = graphs(0, query_lens_up_to(1 + 4))
    assert g.query_lens == (1, 2, 3, 4, 5)
    assert g.key(3, 2, 6) == (4, 8, 2) and g.key(8, 3, 24) == (8, 24, 3) and g.key(8, 5, 40) == (8, 40, 5)


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


def test_a_drafter_replays_longer_prefill_steps_than_the_target():
    """An admission of prompts beside 64 decoding requests takes the EAGLE head a catch-up over their
    rows: past 512 rows it ran eagerly and kept such steps at 28-35 ms on 8B shapes (H100), against
    19-21 ms from graphs; the target's own steps past 512 tokens run faster eagerly than padded."""
    assert prefill_graph_tokens(8192, drafter=False) == 512 and prefill_graph_tokens(8192, drafter=True) == 2048
    assert prefill_graph_tokens(300, drafter=True) == 300  # never past a step's budget
    head = graphs(prefill_graph_tokens(8192, drafter=True), max_num_seqs=64)
    assert head.key(60, 128, 56 * 2 + 4 * 128) == (64, 768, 768) and head.key(60, 128, 2049) is None
    target = graphs(prefill_graph_tokens(8192, drafter=False), max_num_seqs=64)
    assert target.key(60, 128, 576) is None and target.key(59, 128, 498) == (64, 512, 512)


def test_prefill_graphs_split_the_kv_range_at_most_as_their_tokens_do():
    """The attention launch for short queries splits the KV range by max_seq_len, and its partial sums
    take tokens x heads x splits x head_dim floats: prefill graphs are captured with their token count."""
    g = graphs(512)
    assert g._meta((8, 40, 5)).max_seq_len == 8192
    assert g._meta((8, 96, 96)).max_seq_len == 96 and g._meta((8, 512, 512)).max_seq_len == 512


def _graph_view(g: StepGraphs, key: tuple[int, int, int], num_reqs: int, num_tokens: int, width: int) -> dict:
    """What graph `key` reads of the buffers for a step of `num_reqs` requests and `num_tokens` tokens."""
    batch, tokens, _ = key
    return {"positions": g.positions[:tokens].clone(), "slots": g.slot_mapping[:tokens].clone(),
            "qsl": g.query_start_loc[:batch + 1].clone(), "seq_lens": g.seq_lens[:batch].clone(),
            "tables": g.block_tables[:num_reqs, :width].clone()}


def test_a_staged_step_is_what_the_copies_would_write(monkeypatch):
    """`batch_metadata(graphs=...)` writes a step straight into the graphs' buffers (one upload) and
    `run` copies nothing more; without it `run` copies the step's tensors in (`_fill`). Both must give
    the graph the same inputs, padding included, for decode, verification and prefill graphs, and
    the step's other arrays must come back intact."""
    import random

    import numpy as np

    from specserve.engine.step_inputs import HostStaging, batch_metadata

    rng = random.Random(0)
    g = graphs(300, max_num_seqs=8)
    host = HostStaging(torch.device("cpu"))
    fresh = host.host_buffer

    def reused(nbytes):  # a pinned ring buffer holds what earlier steps wrote
        buffer, handle = fresh(nbytes)
        buffer[:] = 0x5A
        return buffer, handle
    monkeypatch.setattr(host, "host_buffer", reused)
    for trial in range(300):
        prefill = trial % 3 == 0
        num_reqs = rng.randint(1, 8)
        q_lens = [rng.randint(1, 5) for _ in range(num_reqs)]
        if prefill:
            q_lens[rng.randrange(num_reqs)] = rng.randint(6, 100)
        s_lens = [q + rng.randint(0, 200) for q in q_lens]
        tables = [[rng.randrange(1, 500) for _ in range(-(-s // 16))] for s in s_lens]
        ids = np.asarray([rng.randrange(50_000) for _ in range(sum(q_lens))], dtype=np.int64)
        extras = [np.asarray([rng.randrange(1000) for _ in range(rng.randint(0, 9))], dtype=np.int64)
                  for _ in range(rng.randint(0, 4))]
        key = g.key(num_reqs, max(q_lens), sum(q_lens))
        if key is None:
            continue
        width = max(map(len, tables))
        # the copies: plain tensors, then run's fill
        positions, meta, (ids_d, *extras_d) = batch_metadata(q_lens, s_lens, tables, 16, torch.device("cpu"),
                                                             staging=host, extra_int64=[ids, *extras])
        g.region.fill_(0x5A)  # whatever earlier steps left behind
        g._fill(positions, meta, key)
        copied = _graph_view(g, key, num_reqs, meta.num_tokens, width)
        # staged
        g.region.fill_(0x5A)
        staged_pos, staged_meta, (staged_ids, *staged_extras) = batch_metadata(
            q_lens, s_lens, tables, 16, torch.device("cpu"), staging=host, extra_int64=extras, graphs=g,
            input_ids=ids)
        assert staged_meta.extra["staged"] == key
        staged = _graph_view(g, key, num_reqs, meta.num_tokens, width)
        n, batch, tokens = meta.num_tokens, key[0], key[1]
        for name in ("slots", "qsl", "seq_lens", "tables"):
            assert torch.equal(staged[name], copied[name]), (trial, name)
        assert torch.equal(staged["positions"][:n], copied["positions"][:n])
        assert not staged["positions"][n:].any() and not g.input_ids[n:tokens].any()  # padding: token 0 at 0
        assert not g.block_tables[num_reqs:batch, 0].any()  # a padding request's one block
        assert torch.equal(staged_ids, torch.from_numpy(ids)) and torch.equal(staged_ids, ids_d)
        assert staged_ids.data_ptr() == g.input_ids.data_ptr() and torch.equal(staged_pos, positions)
        assert all(torch.equal(a, b) for a, b in zip(staged_extras, extras_d)) and len(staged_extras) == len(extras)
        for name in ("query_start_loc", "seq_lens", "block_tables", "slot_mapping"):
            assert torch.equal(getattr(staged_meta, name), getattr(meta, name)), (trial, name)
        assert (staged_meta.num_reqs, staged_meta.num_tokens, staged_meta.max_query_len, staged_meta.max_seq_len) == \
            (meta.num_reqs, meta.num_tokens, meta.max_query_len, meta.max_seq_len)


def test_a_step_moved_back_is_the_step_at_its_real_positions():
    """Async drafting builds a step where its requests stand if the step before accepted every draft
    and moves it back on the device (`StepAhead.move_back`): in a graph's buffers (staged) and in
    plain tensors alike, positions, KV slots and context lengths become those of the step built at
    the real positions, and the padding stays as it was."""
    import random

    import numpy as np

    from specserve.engine.step_inputs import HostStaging, StepAhead, batch_metadata

    rng = random.Random(1)
    g = graphs(0, query_lens=(1, 5), max_num_seqs=8)
    host = HostStaging(torch.device("cpu"))
    for trial in range(200):
        num_reqs = rng.randint(1, 8)
        q_lens = [rng.randint(1, 5) for _ in range(num_reqs)]
        back = [rng.randint(0, 4) for _ in range(num_reqs)]  # drafts the step before rejected
        real = [q + rng.randint(1, 200) for q in q_lens]
        ahead = [s + b for s, b in zip(real, back)]
        tables = [[rng.randrange(1, 500) for _ in range(-(-s // 16) + 1)] for s in ahead]
        rows = torch.from_numpy(np.repeat(np.arange(num_reqs), q_lens))
        step = StepAhead(None, None, torch.tensor(back), rows)
        want_pos, want, _ = batch_metadata(q_lens, real, tables, 16, torch.device("cpu"), staging=host)
        key = g.key(num_reqs, max(q_lens), sum(q_lens))
        for staged in (False, True):
            g.region.fill_(0x5A)
            pos, meta, _ = batch_metadata(q_lens, ahead, tables, 16, torch.device("cpu"), staging=host,
                                          graphs=g if staged else None)
            assert bool(meta.extra) == staged
            before = _graph_view(g, key, num_reqs, meta.num_tokens, len(tables[0]))
            step.move_back(pos, meta, rows)
            assert torch.equal(pos, want_pos), (trial, staged)
            for name in ("slot_mapping", "seq_lens", "query_start_loc", "block_tables"):
                assert torch.equal(getattr(meta, name), getattr(want, name)), (trial, staged, name)
            if staged:  # what the graph reads: the real step, and the padding untouched
                after = _graph_view(g, key, num_reqs, meta.num_tokens, len(tables[0]))
                n, batch = meta.num_tokens, key[0]
                assert torch.equal(after["slots"][n:], before["slots"][n:])
                assert torch.equal(after["seq_lens"][num_reqs:batch], before["seq_lens"][num_reqs:batch])
                assert torch.equal(after["positions"][:n], want_pos) and torch.equal(after["slots"][:n],
                                                                                    want.slot_mapping)


def test_verdict_graphs_hold_uniform_verifications_whose_logits_fit():
    """With `verdicts`, the verification graphs (1 + k tokens a request, k > 0) whose fp32 logits fit
    `VERDICT_LOGITS_BYTES` get a verdict variant (the LM head, argmax and accepted counts replayed with
    the forward); a step replays it only where every request computes the graph's query length (each
    verifying as many drafts: the rows reshape to one row of 1 + k per request)."""
    from types import SimpleNamespace

    from specserve.engine.cuda_graphs import VERDICT_LOGITS_BYTES

    model = torch.nn.Linear(2, 2)
    vocab = 128256  # an 8B model's
    model.cfg = SimpleNamespace(vocab_size=vocab)
    g = StepGraphs(model, [], torch.device("cpu"), 16, 8192, 256, query_lens_up_to(5), 512, verdicts=True)
    assert g.verdict_keys and all(q > 1 and t * vocab * 4 <= VERDICT_LOGITS_BYTES for _, t, q in g.verdict_keys)
    assert (64, 320, 5) in g.verdict_keys and (96, 480, 5) in g.verdict_keys and (128, 640, 5) not in g.verdict_keys
    assert (128, 384, 3) in g.verdict_keys and (256, 512, 2) in g.verdict_keys
    assert not any(q == 1 or q in g.prefill_lens for _, _, q in g.verdict_keys)
    # in `capture`, a graph's verdict variant stands beside its plain one: the graphs are not otherwise changed
    assert g.keys == graphs(512, query_lens_up_to(5), 256).keys

    def step(num_reqs, q, num_tokens):
        return SimpleNamespace(num_reqs=num_reqs, max_query_len=q, num_tokens=num_tokens)

    g.verdict_graphs = {key: None for key in g.verdict_keys}  # (as captured)
    assert g.has_verdict(step(3, 5, 15), g.key(3, 5, 15))  # padded to 4 requests: the rows of 3 reshape
    assert not g.has_verdict(step(3, 5, 12), g.key(3, 5, 12))  # one request verifies fewer drafts
    assert not g.has_verdict(step(100, 5, 500), g.key(100, 5, 500))  # (128, 640, 5): its logits do not fit
    assert not g.has_verdict(step(1, 1, 1), g.key(1, 1, 1))  # a decode step: no verification
    plain = graphs(512, query_lens_up_to(5), 256)
    assert plain.verdict_keys == [] and not plain.has_verdict(step(3, 5, 15), plain.key(3, 5, 15))
