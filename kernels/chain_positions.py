"""An EAGLE chain's step inputs for all of its steps, in one launch (inside the chain's CUDA graph).

Chain step j (0-based, j < k - 1) of request p runs its entry L - 1 + (j + 1): position L + j, or, past
the request's own k drafts (and for padding requests, k = 0), its last position again (L + k - 2, or
L - 1 with k <= 1), writing nothing there (slot PAD_SLOT_ID); its KV slot is that position's in the
request's block table, its sequence length the position + 1. The reference, `ref_chain_positions`, is the
torch version (spec_decode/chain_positions.py): ~16 small kernels at any k, each a
launch the device runs back to back at one request (~2-3 us apiece on an H100), against one here.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from specserve.kernels.checked import FirstUseChecked, all_equal
from specserve.kernels.pdl import pdl_args, pdl_prologue
from specserve.models.layers.attention import PAD_SLOT_ID
from specserve.spec_decode.chain_positions import chain_positions_torch as ref_chain_positions  # noqa: F401 - the oracle


BLOCK = 128  # requests a program: the chain graphs' largest batch (MAX_CHAIN_BATCH) in one


@triton.jit(do_not_specialize=["num_reqs", "table_stride", "num_steps"])  # one compile for every batch and k
def _chain_positions_kernel(
    first_ptr,  # [P] L of each request (any int dtype)
    ks_ptr,  # [P] int64 drafts of each request
    tables_ptr,  # [P, *] int32, rows `table_stride` apart
    positions_ptr,  # [num_steps, P] int64, written
    slots_ptr,  # [num_steps, P] int64, written
    seq_lens_ptr,  # [num_steps, P] int32, written
    num_reqs, table_stride, num_steps,
    BLOCK_SIZE: tl.constexpr, PAD_SLOT: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr,
):
    pdl_prologue(PDL)
    p = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = p < num_reqs
    first = tl.load(first_ptr + p, mask=ok, other=1).to(tl.int64)
    last = tl.maximum(tl.load(ks_ptr + p, mask=ok, other=0) - 2, -1)  # a request's last chain step (-1: none)
    table = tables_ptr + p.to(tl.int64) * table_stride
    for j in range(num_steps):
        pos = first + tl.minimum(last, j)
        block = tl.load(table + pos // BLOCK_SIZE, mask=ok, other=0).to(tl.int64)
        slot = tl.where(last >= j, block * BLOCK_SIZE + pos % BLOCK_SIZE, PAD_SLOT)
        tl.store(positions_ptr + j * num_reqs + p, pos, mask=ok)
        tl.store(slots_ptr + j * num_reqs + p, slot, mask=ok)
        tl.store(seq_lens_ptr + j * num_reqs + p, (pos + 1).to(tl.int32), mask=ok)


def chain_positions(first: torch.Tensor, ks: torch.Tensor, tables: torch.Tensor, block_size: int, steps: int
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`ref_chain_positions` for `steps` (k - 1) chain steps: positions, slots (int64) and sequence
    lengths (int32), [steps, P] each, every step's row contiguous. first: [P] L (any int dtype); ks: [P]
    int64; tables: [P, W] int32 rows (contiguous along a row)."""
    num_reqs = first.shape[0]
    if tables.stride(1) != 1:
        raise ValueError("block tables must be contiguous along a row")
    if ks.shape != (num_reqs,) or tables.shape[0] != num_reqs:
        raise ValueError(f"first {tuple(first.shape)}, ks {tuple(ks.shape)} and tables {tuple(tables.shape)} "
                         "must have one row per request")
    positions = torch.empty(steps, num_reqs, dtype=torch.long, device=first.device)
    slots = torch.empty_like(positions)
    seq_lens = torch.empty(steps, num_reqs, dtype=torch.int32, device=first.device)
    if steps and num_reqs:
        _chain_positions_kernel[(triton.cdiv(num_reqs, BLOCK),)](
            first, ks, tables, positions, slots, seq_lens, num_reqs, tables.stride(0), steps,
            BLOCK_SIZE=block_size, PAD_SLOT=PAD_SLOT_ID, BLOCK=BLOCK, num_warps=1, **pdl_args(first.device))
    return positions, slots, seq_lens


def _reference(first: torch.Tensor, ks: torch.Tensor, tables: torch.Tensor, block_size: int, steps: int
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`chain_positions`' arguments -> the torch reference's outputs (the chain graphs' ops before the kernel)."""
    num_reqs, width = tables.shape
    return ref_chain_positions(first, ks, tables.contiguous(), block_size,
                               torch.arange(steps, device=first.device).unsqueeze(1),
                               (torch.arange(num_reqs, device=first.device) * width).unsqueeze(0))


# what the chain graphs call: the kernel, checked against the reference on its first call (kernels/checked.py)
checked_chain_positions = FirstUseChecked("chain_positions", chain_positions, _reference, all_equal)
