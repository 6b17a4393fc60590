"""The EAGLE chain of greedy drafts as one CUDA graph per (padded batch size, k).

After the catch-up (spec_decode/eagle.py) each drafting request has its newest token's head output
g_{L-1}. The chain turns it into k drafts: d_1 = argmax(logits(g_{L-1})), then for j = 1 .. k - 1 one
head forward of one token per request at position L - 1 + j (token d_j, the head's previous output
as hidden state) and d_{j+1} = its argmax. Eagerly that is k - 1 forwards, each with its own
metadata, launches and graph-buffer copies. Here the whole chain is captured once and replayed: the
positions, KV slots and sequence lengths of every step are computed on the device from the requests'
context lengths L and block tables (both already there: the catch-up's metadata), so a replay costs
a few buffer copies and one launch, and the host waits only for the drafts it reads back. They are
computed for all steps at once, in one launch (`kernels/chain_positions.py`; its torch reference,
spec_decode/chain_positions.py, is ~16 small kernels at any k, where one step's took ~12), and each step's draft is
picked by one kernel (`kernels/greedy_pick.py`: the argmax of the
draft logits in their own dtype, the draft vocabulary's lookup and the write, which took four with
the logits' fp32 cast), over a few requests with a float LM head straight from the head's output
(`EagleHead.pick_greedy`: no logits, the pick over one partial maximum a block of 32 rows): at one
request the chain is tiny kernels that the device runs back to back (at k = 4 on the default model's
shape, on an H100: 77 in 0.225 ms, 0.248 ms with the logits; 113 kernels before `chain_positions`
and `greedy_pick`), so each one left out, or shortened, is time off a drafting step.

A request with fewer drafts than the graph's k (adaptive k differs per request) repeats its last
chain position for the remaining steps without writing KV (slot PAD_SLOT_ID; reading its own valid
positions only); padding requests compute position 0 of block 0 and write nothing. Their extra
tokens are dropped. Random requests draw from per-request generators and run the eager chain.
"""
from __future__ import annotations

import logging
import time

import torch

from specserve.engine.cuda_graphs import CAPTURE_SIZES
from specserve.models.layers.attention import AttentionMetadata
from specserve.spec_decode.eagle_head import EagleHead

logger = logging.getLogger(__name__)

MAX_CHAIN_BATCH = 128  # larger drafting batches are rare (adaptive k) and run the eager chain


class ChainGraphs:
    def __init__(self, head: EagleHead, kv_caches: list[torch.Tensor], device: torch.device, block_size: int,
                 max_model_len: int, max_num_seqs: int, max_k: int) -> None:
        self.head = head
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.max_model_len = max_model_len
        cap = min(max_num_seqs, MAX_CHAIN_BATCH)
        self.sizes = sorted({s for s in CAPTURE_SIZES if s < cap} | {cap})
        self.max_k = max_k
        batch, h = self.sizes[-1], head.cfg.hidden_size
        dtype = head.dtype
        self.out0 = torch.zeros(batch, h, dtype=dtype, device=device)  # g_{L-1} per request
        self.seq_lens = torch.ones(batch, dtype=torch.int32, device=device)  # L: context length
        self.ks = torch.zeros(batch, dtype=torch.long, device=device)  # drafts per request
        self.block_tables = torch.zeros(batch, -(-max_model_len // block_size), dtype=torch.int32, device=device)
        self.tokens = torch.zeros(batch, max_k, dtype=torch.long, device=device)  # drafts (target ids)
        self._query_start_loc = torch.arange(batch + 1, dtype=torch.int32, device=device)
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}

    @torch.inference_mode()
    def capture(self) -> None:
        t0 = time.perf_counter()
        pool = None
        for batch in reversed(self.sizes):  # largest first: the rest reuse its pool
            for k in range(self.max_k, 0, -1):
                self._chain(batch, k)  # warm-up: compile kernels, settle allocations
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self._chain(batch, k)
                pool = graph.pool()
                self.graphs[(batch, k)] = graph
        torch.cuda.synchronize()
        logger.info("captured %d EAGLE chain graphs (batch %d..%d, k 1..%d) in %.1fs", len(self.graphs),
                    self.sizes[0], self.sizes[-1], self.max_k, time.perf_counter() - t0)

    def can_run(self, num_reqs: int, k: int) -> bool:
        return num_reqs <= self.sizes[-1] and k <= self.max_k

    def run(self, out: torch.Tensor, newest: torch.Tensor, seq_lens: torch.Tensor, ks: torch.Tensor,
            block_tables: torch.Tensor, max_k: int) -> torch.Tensor:
        """out: [N, h] the catch-up's head outputs; newest: [P] int64 each request's newest entry's row
        in them; seq_lens: [P] context lengths L (any int dtype); ks: [P] int64 drafts per request, at
        most max_k; block_tables: [P, W] int32. Returns the drafts [P, max_k] (a view of a graph
        buffer: read it before the next replay)."""
        n, width = block_tables.shape
        batch = next(s for s in self.sizes if s >= n)
        torch.index_select(out, 0, newest, out=self.out0[:n])  # picked straight into the buffer: one launch
        self.seq_lens[:n].copy_(seq_lens)
        self.ks[:n].copy_(ks)
        self.block_tables[:n, :width].copy_(block_tables)
        if batch > n:  # padding requests: no drafts, position 0, nothing written
            self.seq_lens[n:batch].fill_(1)
            self.ks[n:batch].zero_()
        self.graphs[(batch, max_k)].replay()
        return self.tokens[:n, :max_k]

    def _chain(self, batch: int, k: int) -> None:
        """The captured work: k drafts for the first `batch` requests of the buffers."""
        from specserve.kernels.chain_positions import checked_chain_positions  # (CUDA only)

        head = self.head
        out = self.out0[:batch]
        tables = self.block_tables[:batch]
        tokens = self.tokens[:batch]
        head.pick_greedy(out, tokens[:, 0])
        if k == 1:
            return
        positions, slots, seq_lens = checked_chain_positions(self.seq_lens[:batch], self.ks[:batch], tables,
                                                             self.block_size, k - 1)
        for j in range(1, k):
            meta = AttentionMetadata(
                num_reqs=batch, num_tokens=batch, max_query_len=1, max_seq_len=self.max_model_len,
                query_start_loc=self._query_start_loc[:batch + 1], seq_lens=seq_lens[j - 1],
                block_tables=tables, slot_mapping=slots[j - 1], query_lens_cpu=[1] * batch,
                seq_lens_cpu=[1] * batch, block_size=self.block_size)
            out = head(tokens[:, j - 1], positions[j - 1], self.kv_caches, meta, hidden_states=out)
            head.pick_greedy(out, tokens[:, j])  # LM head, argmax, lookup and write: two launches

