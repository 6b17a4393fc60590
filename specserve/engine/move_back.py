"""Async drafting's move of a step back to where its requests stand, in torch ops (engine/step_inputs.py,
`StepAhead.move_back`: what the engine runs off CUDA; on CUDA the same in one Triton launch,
kernels/move_back.py, whose oracle this is). Torch only: the kernel imports it."""
from __future__ import annotations

import torch


def move_back_torch(positions: torch.Tensor, slot_mapping: torch.Tensor, seq_lens: torch.Tensor,
                    block_tables: torch.Tensor, block_size: int, rows: torch.Tensor, back: torch.Tensor,
                    reqs: torch.Tensor | None = None, sources: torch.Tensor | None = None) -> None:
    """Positions, KV slots and context lengths of a batch built `back` positions ahead, moved back in place
    (kernels/move_back.py says what each argument is)."""
    num_tokens = rows.shape[0]
    behind = back if reqs is None else back[reqs]  # per request of the batch that moves
    pos = positions[:num_tokens]
    pos.sub_(behind[rows])
    seq_lens[:behind.shape[0]].sub_(behind.to(seq_lens.dtype))
    slot_mapping[:num_tokens] = block_tables[rows, pos // block_size].long() * block_size + pos % block_size
    if sources is not None:
        prev = pos - 1
        sources[:num_tokens] = block_tables[rows, prev // block_size].long() * block_size + prev % block_size
