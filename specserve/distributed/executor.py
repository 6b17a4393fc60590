"""ParallelExecutor: rank 0's ModelExecutor under tensor parallelism. Every call that touches the
model or its KV (forward, and with it forward_tokens and the start-up cost profile; compute_logits;
copy_blocks; capture_graphs) is first announced to the workers, which run the same call on their
shard (worker.py), then run here; the collectives inside the model keep the ranks in step.

What crosses per call: a small header over the host group (`control`, gloo: the op and the host-side
facts — query and context lengths, sizes) and, for a forward, the step's integer tensors packed into
one int64 tensor broadcast over the model group (NCCL on GPUs: no device-to-host copy on rank 0, and
with async scheduling the ids of tokens still in flight come from the device); for logits, the hidden
rows. Any failure on the way makes the executor dead (ExecutorDeadError, naming the rank and cause).
"""
from __future__ import annotations

import torch

from specserve.distributed.workers import WorkerGroup
from specserve.engine.executor import ModelExecutor
from specserve.models.layers.attention import AttentionBackend, AttentionMetadata
from specserve.models.llama import LlamaForCausalLM


class ParallelExecutor(ModelExecutor):
    def __init__(self, model: LlamaForCausalLM, backend: AttentionBackend, device: torch.device,
                 dtype: torch.dtype, block_size: int, num_blocks: int, workers: WorkerGroup) -> None:
        self.workers = workers
        with workers.guard():
            workers.call(("executor", backend.name, block_size, num_blocks))
            super().__init__(model, backend, device, dtype, block_size, num_blocks)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
                ) -> torch.Tensor:
        with self.workers.guard():
            self.workers.call(forward_header(meta), pack_forward(input_ids, positions, meta))
            return super().forward(input_ids, positions, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        with self.workers.guard():
            hidden = hidden.contiguous()
            self.workers.call(("logits", tuple(hidden.shape), str(hidden.dtype).removeprefix("torch.")), hidden)
            return super().compute_logits(hidden)

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        with self.workers.guard():
            self.workers.call(("copy", list(copies)))
            super().copy_blocks(copies)

    def capture_graphs(self, max_model_len: int, max_num_seqs: int, query_lens: tuple[int, ...]) -> None:
        with self.workers.guard():
            self.workers.call(("capture", max_model_len, max_num_seqs, tuple(query_lens)))
            super().capture_graphs(max_model_len, max_num_seqs, query_lens)

    def shutdown(self) -> None:
        self.workers.stop()


def forward_header(meta: AttentionMetadata) -> tuple:
    return ("forward", meta.num_reqs, meta.num_tokens, meta.max_query_len, meta.max_seq_len,
            meta.block_tables.shape[1], list(meta.query_lens_cpu), list(meta.seq_lens_cpu), meta.block_size)


def pack_forward(input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
    """[3 * num_tokens + 2 * num_reqs + 1 + num_reqs * width] int64: ids, positions, slots,
    query_start_loc, seq_lens, block tables."""
    return torch.cat([input_ids.long(), positions, meta.slot_mapping, meta.query_start_loc.long(),
                      meta.seq_lens.long(), meta.block_tables.reshape(-1).long()])


def packed_size(header: tuple) -> int:
    _, num_reqs, num_tokens, _, _, width, *_ = header
    return 3 * num_tokens + 2 * num_reqs + 1 + num_reqs * width


def unpack_forward(header: tuple, packed: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """A worker's view of rank 0's forward: (input_ids, positions, meta)."""
    _, num_reqs, num_tokens, max_query_len, max_seq_len, width, query_lens, seq_lens, block_size = header
    t, r = num_tokens, num_reqs
    ids, positions, slots = packed[:t], packed[t:2 * t], packed[2 * t:3 * t]
    cu = packed[3 * t:3 * t + r + 1].int()
    s_lens = packed[3 * t + r + 1:3 * t + 2 * r + 1].int()
    tables = packed[3 * t + 2 * r + 1:].int().view(r, width)
    meta = AttentionMetadata(num_reqs=r, num_tokens=t, max_query_len=max_query_len, max_seq_len=max_seq_len,
                             query_start_loc=cu, seq_lens=s_lens, block_tables=tables, slot_mapping=slots,
                             query_lens_cpu=query_lens, seq_lens_cpu=seq_lens, block_size=block_size)
    return ids, positions, meta
