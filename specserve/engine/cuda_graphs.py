"""CUDA graphs for decode and verification steps, and for short prefill steps, replayed over persistent
buffers.

Two kinds of graph, each keyed by (padded number of requests, padded number of tokens, max query length):
- A step whose requests each compute at most `Q` tokens (Q = 1: decode; Q = 1 + k: speculative
  verification) replays the graph of (padded batch size B in `CAPTURE_SIZES`, B * Q, Q). Padding
  requests compute one token each that writes no KV (slot -1) and attends one slot.
- A step with a longer query (a prompt or its chunk, alone or beside decoding requests: an admission)
  of up to the largest of `PREFILL_LENS` tokens in all replays the graph of (the largest batch size,
  the next such token count T, T). Padding requests compute no tokens; padding tokens (past the real
  ones) are computed, write no KV and are never read back. An eager forward launches each layer's
  kernels from Python: on an H200, ~11 ms of host time for the default model's 30 layers against
  well under 1 ms on the device, most of a prompt's time to first token at one request, and the
  admission steps that speculation's staggered request ends multiply.
At run time the real tokens fill the front of the buffers (ragged: `query_start_loc` is copied in).
The attention kernels take their grid from python ints only (`max_seq_len` only picks how far the
KV range is split), so a graph replays correctly for any contexts and for queries its `max_query_len`
bounds. Other steps (more tokens, more requests) run eagerly.
"""
from __future__ import annotations

import logging
import time

import torch

from specserve.models.layers.attention import PAD_SLOT_ID, AttentionMetadata

logger = logging.getLogger(__name__)

CAPTURE_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512)
# token counts of prefill graphs: steps of 1.5x, so padding costs at most half the tokens (past 512
# tokens a large model's forward is bound by its compute, and padding would cost more than launching
# eagerly saves)
PREFILL_LENS = (16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)


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


class StepGraphs:
    def __init__(self, model, kv_caches: list[torch.Tensor], device: torch.device, block_size: int,
                 max_model_len: int, max_num_seqs: int, query_lens: tuple[int, ...] = (1,),
                 max_prefill_tokens: int = 0) -> None:
        """query_lens: Q of the decode graphs, captured for every batch size; max_prefill_tokens: the
        most tokens (of `PREFILL_LENS`, up to it) of a prefill graph (0: none)."""
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.sizes = [s for s in CAPTURE_SIZES if s < max_num_seqs] + [max_num_seqs]
        self.sizes = sorted(set(s for s in self.sizes if s <= max(CAPTURE_SIZES)))
        self.query_lens = tuple(sorted(set(query_lens)))
        max_batch = self.sizes[-1]
        self.prefill_lens = tuple(t for t in PREFILL_LENS if self.query_lens[-1] < t <= max_prefill_tokens)
        # (padded requests, padded tokens, max query length)
        self.keys = [(b, b * q, q) for q in self.query_lens for b in self.sizes] + \
                    [(max_batch, t, t) for t in self.prefill_lens]
        max_tokens = max(t for _, t, _ in self.keys)
        max_blocks = -(-max_model_len // block_size)
        self.input_ids = torch.zeros(max_tokens, dtype=torch.long, device=device)
        self.positions = torch.zeros(max_tokens, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((max_tokens,), PAD_SLOT_ID, dtype=torch.long, device=device)
        self.seq_lens = torch.ones(max_batch, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(max_batch + 1, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(max_batch, max_blocks, dtype=torch.int32, device=device)
        self._arange = torch.arange(max_batch + 1, dtype=torch.int32, device=device)
        # a model's further per-token inputs (an EAGLE head's hidden states): name -> width
        dtype = next(model.parameters()).dtype
        self.inputs = {name: torch.zeros(max_tokens, width, dtype=dtype, device=device)
                       for name, width in getattr(model, "graph_inputs", {}).items()}
        self.graphs: dict[tuple[int, int, int], torch.cuda.CUDAGraph] = {}
        self.outputs: dict[tuple[int, int, int], torch.Tensor] = {}

    def _meta(self, key: tuple[int, int, int]) -> AttentionMetadata:
        batch, tokens, q = key
        # max_seq_len picks the KV splits of the attention launch that takes short queries, whose
        # partial sums take tokens x heads x splits x head_dim floats (8B shapes at a 128k context, one
        # request: 64 splits, 0.5 GB at 512 tokens). A prefill graph splits at most its token count:
        # a short query beside a long context there (a decode in an admission step) walks more of the
        # context per program
        return AttentionMetadata(
            num_reqs=batch, num_tokens=tokens, max_query_len=q,
            max_seq_len=tokens if q in self.prefill_lens else self.max_model_len,
            query_start_loc=self.query_start_loc[:batch + 1], seq_lens=self.seq_lens[:batch],
            block_tables=self.block_tables[:batch], slot_mapping=self.slot_mapping[:tokens],
            query_lens_cpu=[1] * batch, seq_lens_cpu=[1] * batch, block_size=self.block_size)

    @torch.inference_mode()
    def capture(self) -> None:
        t0 = time.perf_counter()
        pool = None
        for key in sorted(self.keys, key=lambda k: -k[1]):  # largest first: the rest reuse its pool
            batch, tokens, q = key
            # a valid batch for the warm-up forward: a decode graph's requests one token each, a
            # prefill graph's first request all of them
            self.seq_lens[:batch].fill_(1)
            if q in self.prefill_lens:
                self.query_start_loc[1:batch + 1].fill_(tokens)
                self.seq_lens[0] = tokens
            else:
                self.query_start_loc[:batch + 1].copy_(self._arange[:batch + 1])
            meta = self._meta(key)
            args = (self.input_ids[:tokens], self.positions[:tokens], self.kv_caches, meta)
            inputs = {name: buf[:tokens] for name, buf in self.inputs.items()}
            self.model(*args, **inputs)  # warm-up: compile kernels, settle allocations
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[key] = self.model(*args, **inputs)
            pool = graph.pool()
            self.graphs[key] = graph
        torch.cuda.synchronize()
        logger.info("captured %d CUDA graphs (batch %d..%d, query lengths %s; prefills of up to %d tokens) in %.1fs",
                    len(self.graphs), self.sizes[0], self.sizes[-1], self.query_lens,
                    self.prefill_lens[-1] if self.prefill_lens else 0, time.perf_counter() - t0)

    def can_run(self, meta: AttentionMetadata) -> bool:
        return self.holds(meta.num_reqs, meta.max_query_len, meta.num_tokens)

    def holds(self, num_reqs: int, max_query_len: int, num_tokens: int) -> bool:
        """Is a graph captured for a step of `num_reqs` requests computing `num_tokens` tokens, at
        most `max_query_len` each?"""
        return self.key(num_reqs, max_query_len, num_tokens) is not None

    def key(self, num_reqs: int, max_query_len: int, num_tokens: int) -> tuple[int, int, int] | None:
        """The smallest captured graph for such a step (None: none)."""
        if num_reqs > self.sizes[-1]:
            return None
        if max_query_len <= self.query_lens[-1]:  # decode, verification
            batch = next(s for s in self.sizes if s >= num_reqs)
            q = next(q for q in self.query_lens if q >= max_query_len)
            return batch, batch * q, q
        if not self.prefill_lens or num_tokens > self.prefill_lens[-1]:
            return None
        t = next(t for t in self.prefill_lens if t >= num_tokens)
        return self.sizes[-1], t, t

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
            key: tuple[int, int, int], **inputs: torch.Tensor) -> torch.Tensor:
        """Replay the graph `key` (the step's `key(...)`); returns hidden [num_tokens, H]."""
        n, num_tokens = meta.num_reqs, meta.num_tokens
        batch, tokens, q = key
        width = meta.block_tables.shape[1]
        self.input_ids[:num_tokens].copy_(input_ids)
        self.positions[:num_tokens].copy_(positions)
        for name, value in inputs.items():
            self.inputs[name][:num_tokens].copy_(value)
        self.slot_mapping[:num_tokens].copy_(meta.slot_mapping)
        if tokens > num_tokens:  # padding tokens write no KV (a call over nothing still costs the host)
            self.slot_mapping[num_tokens:tokens].fill_(PAD_SLOT_ID)
        self.query_start_loc[:n + 1].copy_(meta.query_start_loc)
        if batch > n and q in self.prefill_lens:  # padding requests: no tokens
            self.query_start_loc[n + 1:batch + 1].fill_(num_tokens)
            self.seq_lens[n:batch].fill_(1)
        elif batch > n:  # padding requests: one token each, past the real ones
            torch.add(self._arange[1:batch - n + 1], num_tokens, out=self.query_start_loc[n + 1:batch + 1])
            self.seq_lens[n:batch].fill_(1)
        self.seq_lens[:n].copy_(meta.seq_lens)
        self.block_tables[:n, :width].copy_(meta.block_tables)
        self.graphs[key].replay()
        return self.outputs[key][:num_tokens]
