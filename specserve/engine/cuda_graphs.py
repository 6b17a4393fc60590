"""CUDA graphs for decode and verification steps, and for one request's short prefill, replayed over
persistent buffers.

A step whose requests each compute at most `Q` tokens (Q = 1: decode; Q = 1 + k: speculative
verification) is captured once per (padded batch size B in `CAPTURE_SIZES`, Q), over B * Q token
slots. A step of one request computing more (a prompt, or its chunk, of up to the largest of
`PREFILL_LENS` tokens) replays the graph of one request and the next such length: an eager forward
launches each layer's kernels from Python (on an H200, ~11 ms of host time for the default model's
30 layers, against well under 1 ms on the device), which at one request is most of a prompt's time to
first token. At run time the real tokens fill the front of the buffers (ragged: `query_start_loc` is
copied in); padding requests compute one token each that writes no KV (slot -1) and attends one slot;
token slots past those (a prefill's padding too) are computed, write no KV and are never read back.
The attention kernels take their grid from python ints only, so a graph captured with `max_seq_len =
max_model_len` and `max_query_len = Q` replays correctly for any shorter context and query. Other
steps (several requests' prefills, longer prompts) run eagerly.
"""
from __future__ import annotations

import logging
import time

import torch

from specserve.models.layers.attention import PAD_SLOT_ID, AttentionMetadata

logger = logging.getLogger(__name__)

CAPTURE_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512)
# query lengths of one-request prefill graphs: steps of 1.5x, so padding costs at most half the tokens
# (past 512 tokens a large model's forward is bound by its compute, and padding would cost more than
# launching eagerly saves)
PREFILL_LENS = (16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)
# the attention kernel's short launch (the one split along the KV range) takes only queries of at most
# this many tokens (its tiles have at most 64 rows: kernels/attention_config.py)
SHORT_QUERY_MAX = 64
assert SHORT_QUERY_MAX in PREFILL_LENS  # DecodeGraphs._meta relies on it


def replay_seconds(graph: torch.cuda.CUDAGraph, reps: int = 20) -> float:
    """Seconds one replay of a captured graph takes (its device time: the best of `reps`, each waited for)."""
    best = float("inf")
    for _ in range(reps + 2):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        graph.replay()
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return best


class DecodeGraphs:
    def __init__(self, model, kv_caches: list[torch.Tensor], device: torch.device, block_size: int,
                 max_model_len: int, max_num_seqs: int, query_lens: tuple[int, ...] = (1,),
                 max_prefill_tokens: int = 0) -> None:
        """query_lens: Q of the graphs captured for every batch size; max_prefill_tokens: the longest
        one-request step (of `PREFILL_LENS`, up to it) to capture a graph for (0: none)."""
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.sizes = [s for s in CAPTURE_SIZES if s < max_num_seqs] + [max_num_seqs]
        self.sizes = sorted(set(s for s in self.sizes if s <= max(CAPTURE_SIZES)))
        self.query_lens = tuple(sorted(set(query_lens)))
        self.prefill_lens = tuple(q for q in PREFILL_LENS if self.query_lens[-1] < q <= max_prefill_tokens)
        self.keys = [(b, q) for q in self.query_lens for b in self.sizes] + [(1, q) for q in self.prefill_lens]
        max_batch = self.sizes[-1]
        max_tokens = max(b * q for b, q in self.keys)
        max_blocks = -(-max_model_len // block_size)
        self.input_ids = torch.zeros(max_tokens, dtype=torch.long, device=device)
        self.positions = torch.zeros(max_tokens, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((max_tokens,), PAD_SLOT_ID, dtype=torch.long, device=device)
        self.seq_lens = torch.ones(max_batch, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(max_batch + 1, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(max_batch, max_blocks, dtype=torch.int32, device=device)
        self._pad_offsets = torch.arange(1, max_batch + 1, dtype=torch.int32, device=device)
        # a model's further per-token inputs (an EAGLE head's hidden states): name -> width
        dtype = next(model.parameters()).dtype
        self.inputs = {name: torch.zeros(max_tokens, width, dtype=dtype, device=device)
                       for name, width in getattr(model, "graph_inputs", {}).items()}
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.outputs: dict[tuple[int, int], torch.Tensor] = {}

    def _meta(self, batch: int, q: int) -> AttentionMetadata:
        # max_seq_len picks the short launch's KV splits, whose partial sums take q x heads x splits
        # x head_dim floats: a prefill graph whose every query is too long for that launch (each is
        # longer than the next shorter graph's, and SHORT_QUERY_MAX is one of PREFILL_LENS) splits
        # nothing (8B shapes at a 128k context would take 64 splits: 0.5 GB at 512 tokens)
        long_queries = q in self.prefill_lens and q > SHORT_QUERY_MAX
        return AttentionMetadata(
            num_reqs=batch, num_tokens=batch * q, max_query_len=q,
            max_seq_len=q if long_queries else self.max_model_len,
            query_start_loc=self.query_start_loc[:batch + 1], seq_lens=self.seq_lens[:batch],
            block_tables=self.block_tables[:batch], slot_mapping=self.slot_mapping[:batch * q],
            query_lens_cpu=[1] * batch, seq_lens_cpu=[1] * batch, block_size=self.block_size)

    @torch.inference_mode()
    def capture(self) -> None:
        t0 = time.perf_counter()
        pool = None
        for batch, q in sorted(self.keys, key=lambda k: -k[0] * k[1]):  # largest first: the rest reuse its pool
            meta = self._meta(batch, q)
            n = batch * q
            args = (self.input_ids[:n], self.positions[:n], self.kv_caches, meta)
            inputs = {name: buf[:n] for name, buf in self.inputs.items()}
            self.model(*args, **inputs)  # warm-up: compile kernels, settle allocations
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[(batch, q)] = self.model(*args, **inputs)
            pool = graph.pool()
            self.graphs[(batch, q)] = graph
        torch.cuda.synchronize()
        logger.info("captured %d CUDA graphs (batch %d..%d, query lengths %s; one request's prefill up to %d "
                    "tokens) in %.1fs", len(self.graphs), self.sizes[0], self.sizes[-1], self.query_lens,
                    self.prefill_lens[-1] if self.prefill_lens else 0, time.perf_counter() - t0)

    def can_run(self, meta: AttentionMetadata) -> bool:
        return self.holds(meta.num_reqs, meta.max_query_len)

    def holds(self, num_reqs: int, max_query_len: int) -> bool:
        """Is a graph captured for a step of `num_reqs` requests computing at most `max_query_len` tokens each?"""
        return self.key(num_reqs, max_query_len) is not None

    def key(self, num_reqs: int, max_query_len: int) -> tuple[int, int] | None:
        """The smallest captured graph (padded batch, query length) for such a step (None: none)."""
        if max_query_len <= self.query_lens[-1]:
            if num_reqs > self.sizes[-1]:
                return None
            return next(s for s in self.sizes if s >= num_reqs), next(q for q in self.query_lens if q >= max_query_len)
        if num_reqs != 1 or not self.prefill_lens or max_query_len > self.prefill_lens[-1]:
            return None
        return 1, next(q for q in self.prefill_lens if q >= max_query_len)  # one request's prefill

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
            **inputs: torch.Tensor) -> torch.Tensor:
        """Replay the smallest captured graph that holds the step; returns hidden [num_tokens, H]."""
        n, num_tokens = meta.num_reqs, meta.num_tokens
        batch, q = self.key(n, meta.max_query_len)
        width = meta.block_tables.shape[1]
        self.input_ids[:num_tokens].copy_(input_ids)
        self.positions[:num_tokens].copy_(positions)
        for name, value in inputs.items():
            self.inputs[name][:num_tokens].copy_(value)
        self.slot_mapping[:num_tokens].copy_(meta.slot_mapping)
        self.slot_mapping[num_tokens:batch * q].fill_(PAD_SLOT_ID)
        self.query_start_loc[:n + 1].copy_(meta.query_start_loc)
        if batch > n:  # padding requests: one token each, past the real ones
            torch.add(self._pad_offsets[:batch - n], num_tokens, out=self.query_start_loc[n + 1:batch + 1])
            self.seq_lens[n:batch].fill_(1)
        self.seq_lens[:n].copy_(meta.seq_lens)
        self.block_tables[:n, :width].copy_(meta.block_tables)
        self.graphs[(batch, q)].replay()
        return self.outputs[(batch, q)][:num_tokens]
