"""ModelExecutor: one model running over the engine's KV block ids — its KV tensor, its forward (a
captured CUDA graph where one holds the step, eager otherwise), and a forward over token lists for
callers without a scheduled step. The model runner runs the target through one; the builder gives a
draft model one of its own, so target and draft share every mechanism (KV allocation, bytes per
block, metadata, graphs) and differ only in their weights.

KV layout: one tensor `[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]`; a block id
indexes the same slots in every layer, and in every executor's tensor (copy-on-write copies them all).

Slot states: a model may ask for per-slot vectors kept beside its KV in the same blocks (`slot_states`:
name -> width; an EAGLE head keeps the target's hidden state of every computed position). Each is one
tensor `[num_blocks * block_size + 1, width]` indexed by KV slot; its last row stays zero (a slot index
for "no state": an EAGLE entry at position 0). They count in the bytes per block and are copied with
the KV on copy-on-write.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from specserve.engine.step_inputs import HostStaging, batch_metadata
from specserve.models.layers.attention import AttentionBackend, AttentionMetadata
from specserve.models.llama import LlamaForCausalLM

if TYPE_CHECKING:
    from specserve.engine.cuda_graphs import Verdict


class ExecutorDeadError(RuntimeError):
    """The executor can run no more steps (a tensor-parallel worker died or hung): the engine's fault,
    not a request's, so step isolation does not search for a culprit and the engine stops."""


class ModelExecutor:
    # capture the one-token decode graphs of a target that computes an EAGLE head's fused feature
    # also without it (a step whose feature nobody reads: `forward(..., aux=False)`)
    plain_decode_graphs = True

    def __init__(self, model: LlamaForCausalLM, backend: AttentionBackend, device: torch.device,
                 dtype: torch.dtype, block_size: int, num_blocks: int) -> None:
        self.model = model
        model.backend = backend
        self.backend = backend
        self.device = device
        self.block_size = block_size
        cfg = model.cfg
        self.kv_cache = torch.zeros(cfg.num_layers, 2, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim,
                                    dtype=dtype, device=device)
        self.kv_caches = list(self.kv_cache.unbind(0))
        self.slot_states = {name: torch.zeros(num_blocks * block_size + 1, width, dtype=dtype, device=device)
                            for name, width in getattr(model, "slot_states", {}).items()}
        self.graphs = None  # StepGraphs once captured
        self.staging = HostStaging(device)

    @staticmethod
    def kv_bytes_per_block(model: LlamaForCausalLM, block_size: int, dtype: torch.dtype) -> int:
        """Bytes one block holds for `model`: its KV, plus its slot states."""
        size = torch.tensor([], dtype=dtype).element_size()
        state_width = sum(getattr(model, "slot_states", {}).values())
        return (model.cfg.kv_bytes_per_token(size) + state_width * size) * block_size

    def capture_graphs(self, max_model_len: int, max_num_seqs: int, query_lens: tuple[int, ...],
                       max_prefill_tokens: int = 0, verdicts: bool = False) -> None:
        """CUDA graphs for steps whose requests compute at most max(query_lens) tokens each, and for
        steps of up to `max_prefill_tokens` tokens in all (engine/cuda_graphs.py); `verdicts`: also the
        verification graphs' verdict variants (`forward_verifying`), for a target whose drafts are
        verified on the device."""
        from specserve.engine.cuda_graphs import StepGraphs

        self.graphs = StepGraphs(self.model, self.kv_caches, self.device, self.block_size, max_model_len,
                                 max_num_seqs, query_lens, max_prefill_tokens, self.plain_decode_graphs, verdicts)
        self.graphs.capture()

    def decode_replay_seconds(self) -> float | None:
        """Device seconds of one replay of the one-request decode graph (None: no graphs captured)."""
        from specserve.engine.cuda_graphs import replay_seconds

        return replay_seconds(self.graphs.graphs[(1, 1, 1)]) if self.graphs is not None else None

    def warm_up_kernels(self, max_model_len: int) -> None:
        """Compile the attention kernel variants this model's layers can launch (a variant first met while
        serving would stall that step: Triton compiles it then)."""
        cfg = self.model.cfg
        windows = {getattr(m, "sliding_window", None) for m in self.model.modules()}
        self.backend.warm_up(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, self.kv_cache.dtype, self.block_size,
                             max_model_len, self.device, tuple(sorted(windows, key=lambda w: w or 0)))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                aux: bool = True, **inputs: torch.Tensor) -> torch.Tensor:
        """input_ids, positions: [num_tokens] -> hidden states [num_tokens, hidden_size] (a target
        with aux layers: wider, `LlamaForCausalLM.forward`). `inputs`: a model's further per-token
        inputs (an EAGLE head's hidden_states: its `graph_inputs`). aux=False: the aux outputs may be
        left out (they are where no graph without them holds the step: read the width)."""
        key = self.graphs.key(meta.num_reqs, meta.max_query_len, meta.num_tokens) if self.graphs is not None else None
        if key is not None:
            return self.graphs.run(input_ids, positions, meta, key, aux, **inputs)
        self.backend.prepare(meta)
        if not aux and getattr(self.model, "aux_layers", ()):  # (other models have no aux outputs)
            inputs["aux"] = False
        return self.model(input_ids, positions, self.kv_caches, meta, **inputs)

    def forward_verifying(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                          aux: bool = True) -> tuple[torch.Tensor, Verdict | None]:
        """`forward` for a step whose requests each verify drafts on the device, every one of its
        tokens a logits row. Where a verdict graph holds it (every request verifying as many drafts,
        `StepGraphs.has_verdict`), the same replay also gives the target's argmax of each row and
        each request's accepted drafts (greedy); else the forward alone and None."""
        graphs = self.graphs
        key = graphs.key(meta.num_reqs, meta.max_query_len, meta.num_tokens) if graphs is not None else None
        if key is None or not graphs.has_verdict(meta, key):
            return self.forward(input_ids, positions, meta, aux=aux), None
        return graphs.run_verdict(input_ids, positions, meta, key)

    def forward_tokens(self, input_ids: list[int] | torch.Tensor, query_lens: list[int], seq_lens: list[int],
                       tables: list[list[int]], **inputs: torch.Tensor) -> torch.Tensor:
        """A ragged batch given as lists: request i computes the last query_lens[i] of its seq_lens[i]
        tokens (KV in blocks tables[i]); input_ids: list or [T] tensor -> hidden [T, hidden_size]."""
        positions, meta, _ = batch_metadata(query_lens, seq_lens, tables, self.block_size, self.device,
                                            staging=self.staging)
        ids = input_ids if isinstance(input_ids, torch.Tensor) else \
            torch.tensor(input_ids, dtype=torch.long, device=self.device)
        return self.forward(ids, positions, meta, **inputs)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden_size] -> fp32 logits [N, vocab]."""
        return self.model.compute_logits(hidden)

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy whole KV blocks src -> dst in every layer (all reads before writes)."""
        src = torch.tensor([c[0] for c in copies], device=self.device)
        dst = torch.tensor([c[1] for c in copies], device=self.device)
        self.kv_cache[:, :, dst] = self.kv_cache[:, :, src]
        for state in self.slot_states.values():
            blocks = state[:-1].view(-1, self.block_size, state.shape[1])  # [num_blocks, block_size, width]
            blocks[dst] = blocks[src]

    def shutdown(self) -> None:
        """Release what outlives a step (a tensor-parallel executor stops its workers)."""
