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

from specserve.distributed.wire import forward_header, pack_forward
from specserve.distributed.workers import WorkerGroup
from specserve.engine.executor import ModelExecutor
from specserve.models.layers.attention import AttentionBackend, AttentionMetadata
from specserve.models.llama import LlamaForCausalLM


class ParallelExecutor(ModelExecutor):
    # every rank captures the same graphs (their collectives must meet): the workers' models have no
    # aux layers, so rank 0 captures no variants without them either, and its forward keeps them
    plain_decode_graphs = False

    def __init__(self, model: LlamaForCausalLM, backend: AttentionBackend, device: torch.device,
                 dtype: torch.dtype, block_size: int, num_blocks: int, workers: WorkerGroup) -> None:
        self.workers = workers
        with workers.guard():
            workers.call(("executor", backend.name, block_size, num_blocks))
            super().__init__(model, backend, device, dtype, block_size, num_blocks)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                aux: bool = True) -> torch.Tensor:
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

    def capture_graphs(self, max_model_len: int, max_num_seqs: int, query_lens: tuple[int, ...],
                       max_prefill_tokens: int = 0, verdicts: bool = False) -> None:
        # no verdict graphs: the LM head's logits are gathered over the ranks outside the forward
        # (`compute_logits`), so rank 0's graphs hold the forward alone, as the workers' do
        with self.workers.guard():
            self.workers.call(("capture", max_model_len, max_num_seqs, tuple(query_lens), max_prefill_tokens))
            super().capture_graphs(max_model_len, max_num_seqs, query_lens, max_prefill_tokens)

    def decode_replay_seconds(self) -> float | None:
        return None  # its graphs hold collectives: replayed here alone, they would wait for the workers

    def shutdown(self) -> None:
        self.workers.stop()
