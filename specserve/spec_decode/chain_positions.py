"""An EAGLE chain's step inputs for all of its steps, in torch ops: the oracle of the chain graphs' one
Triton launch (kernels/chain_positions.py, which imports it), and what the chain graphs replay instead where
that kernel fails its first-use check (kernels/checked.py). Torch only."""
from __future__ import annotations

import torch

from specserve.models.layers.attention import PAD_SLOT_ID


def chain_positions_torch(first: torch.Tensor, ks: torch.Tensor, tables: torch.Tensor, block_size: int,
                          steps: torch.Tensor, table_rows: torch.Tensor
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Every chain step's inputs at once, [k - 1, P] each, contiguous per step: positions (int64),
    KV slots (int64; PAD_SLOT_ID where a request is past its own k) and sequence lengths (int32).
    first: [P] L, the position of a request's first chain entry (any int dtype); ks: [P] int64 its
    drafts; tables: [P, W] int32 block tables (contiguous rows); steps: [k - 1, 1] int64 0 .. k - 2;
    table_rows: [1, P] int64 i * W. Chain step j (1-based) runs entry L - 1 + j: position
    L + j - 1, or, past a request's own k (and for padding requests, k = 0), its last position again
    (L + k - 2, or L - 1 with k <= 1), writing nothing there."""
    last_step = (ks - 2).clamp(min=-1)  # a request's last chain step, 0-based (-1: none)
    positions = first.long() + torch.minimum(last_step, steps)  # [k - 1, P]
    blocks = torch.take(tables, table_rows + positions // block_size).long()
    slots = torch.where(last_step >= steps, blocks * block_size + positions % block_size, PAD_SLOT_ID)
    return positions, slots, (positions + 1).int()
