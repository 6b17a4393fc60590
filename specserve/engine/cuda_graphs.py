"""CUDA graphs for decode steps: one graph per padded batch size, replayed over persistent buffers.

A decode step (every request computes exactly one token) is captured once per size in
`CAPTURE_SIZES`; at run time the batch is padded up to the next captured size. Padding rows write
no KV (slot -1) and attend one slot of block 0; their outputs are dropped. The attention kernels
take their grid from python ints only, so a graph captured with `max_seq_len = max_model_len`
replays correctly for any shorter context. Verification and prefill steps run eagerly.
"""
from __future__ import annotations

import logging
import time

import torch

from specserve.models.layers.attention import PAD_SLOT_ID, AttentionMetadata

logger = logging.getLogger(__name__)

CAPTURE_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512)


class DecodeGraphs:
    def __init__(self, model, kv_caches: list[torch.Tensor], device: torch.device, block_size: int,
                 max_model_len: int, max_num_seqs: int) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.sizes = [s for s in CAPTURE_SIZES if s < max_num_seqs] + [max_num_seqs]
        self.sizes = sorted(set(s for s in self.sizes if s <= max(CAPTURE_SIZES)))
        max_batch = self.sizes[-1]
        max_blocks = -(-max_model_len // block_size)
        self.input_ids = torch.zeros(max_batch, dtype=torch.long, device=device)
        self.positions = torch.zeros(max_batch, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((max_batch,), PAD_SLOT_ID, dtype=torch.long, device=device)
        self.seq_lens = torch.ones(max_batch, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(max_batch + 1, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(max_batch, max_blocks, dtype=torch.int32, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}

    def _meta(self, batch: int) -> AttentionMetadata:
        return AttentionMetadata(
            num_reqs=batch, num_tokens=batch, max_query_len=1, max_seq_len=self.max_model_len,
            query_start_loc=self.query_start_loc[:batch + 1], seq_lens=self.seq_lens[:batch],
            block_tables=self.block_tables[:batch], slot_mapping=self.slot_mapping[:batch],
            query_lens_cpu=[1] * batch, seq_lens_cpu=[1] * batch, extra={"block_size": self.block_size})

    @torch.inference_mode()
    def capture(self) -> None:
        t0 = time.perf_counter()
        pool = None
        for batch in reversed(self.sizes):  # largest first: smaller graphs reuse its memory pool
            meta = self._meta(batch)
            args = (self.input_ids[:batch], self.positions[:batch], self.kv_caches, meta)
            self.model(*args)  # warm-up: compile kernels, settle allocations
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[batch] = self.model(*args)
            pool = graph.pool()
            self.graphs[batch] = graph
        torch.cuda.synchronize()
        logger.info("captured %d decode CUDA graphs (batch %d..%d) in %.1fs", len(self.graphs),
                    self.sizes[0], self.sizes[-1], time.perf_counter() - t0)

    def can_run(self, meta: AttentionMetadata) -> bool:
        return meta.max_query_len == 1 and meta.num_reqs <= self.sizes[-1]

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Replay the graph of the smallest captured size >= the batch; returns hidden [num_reqs, H]."""
        n = meta.num_reqs
        batch = next(s for s in self.sizes if s >= n)
        width = meta.block_tables.shape[1]
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.slot_mapping[:n].copy_(meta.slot_mapping)
        self.seq_lens[:n].copy_(meta.seq_lens)
        self.block_tables[:n, :width].copy_(meta.block_tables)
        if batch > n:
            self.slot_mapping[n:batch].fill_(PAD_SLOT_ID)
            self.seq_lens[n:batch].fill_(1)
        self.graphs[batch].replay()
        return self.outputs[batch][:n]
