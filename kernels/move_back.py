"""Move a step scheduled ahead of its predecessor's tokens back where its requests stand, in one launch.

Async drafting (engine/step_inputs.py, `StepAhead`) builds a step at the positions its requests would
have if the step before accepted every draft; on the device request r is `back[r]` positions behind.
For each token t of request `rows[t]` (its row of the block tables; `reqs[rows[t]]` its index into
`back`, or `rows[t]` itself): positions[t] -= back, slot_mapping[t] = the KV slot of the new position
(block_tables[row, pos // block_size] * block_size + pos % block_size), optionally sources[t] = the
slot of the position before it (an EAGLE head's catch-up reads the target's hidden state there); and
per request, seq_lens[r] -= back. In place, no host syncs (a CUDA graph's buffers, the step's own
tensors). The reference, `ref_move_back`, is the engine's torch version of the same (what it runs off CUDA,
where this module cannot be imported without Triton: specserve/engine/move_back.py): eleven
small launches against one here, on the host's path of every step ahead.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from specserve.engine.move_back import move_back_torch as ref_move_back  # noqa: F401 - the oracle
from specserve.kernels.pdl import pdl_args, pdl_prologue

BLOCK = 128


@triton.jit(do_not_specialize=["num_tokens", "num_reqs", "table_stride"])
def _move_back_kernel(
    positions_ptr,  # [>= num_tokens] int64, in place
    slots_ptr,  # [>= num_tokens] int64, in place
    seq_lens_ptr,  # [>= num_reqs] int32, in place
    tables_ptr,  # [num_reqs, *] int32, rows `table_stride` apart
    rows_ptr,  # [num_tokens] int64: each token's request (its row of the tables)
    back_ptr,  # [*] int64: how far each request is behind
    reqs_ptr,  # [num_reqs] int64: each request's index into back (HAS_REQS)
    sources_ptr,  # [>= num_tokens] int64, written (HAS_SOURCES)
    num_tokens, num_reqs, table_stride,
    BLOCK_SIZE: tl.constexpr, HAS_REQS: tl.constexpr, HAS_SOURCES: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr,
):
    pdl_prologue(PDL)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tok = offs < num_tokens
    row = tl.load(rows_ptr + offs, mask=tok, other=0)
    if HAS_REQS:
        req = tl.load(reqs_ptr + row, mask=tok, other=0)
    else:
        req = row
    pos = tl.load(positions_ptr + offs, mask=tok, other=0) - tl.load(back_ptr + req, mask=tok, other=0)
    tl.store(positions_ptr + offs, pos, mask=tok)
    table = tables_ptr + row * table_stride
    block = tl.load(table + pos // BLOCK_SIZE, mask=tok, other=0).to(tl.int64)
    tl.store(slots_ptr + offs, block * BLOCK_SIZE + pos % BLOCK_SIZE, mask=tok)
    if HAS_SOURCES:
        prev = pos - 1
        block = tl.load(table + prev // BLOCK_SIZE, mask=tok, other=0).to(tl.int64)
        tl.store(sources_ptr + offs, block * BLOCK_SIZE + prev % BLOCK_SIZE, mask=tok)
    live = offs < num_reqs
    if HAS_REQS:
        req = tl.load(reqs_ptr + offs, mask=live, other=0)
    else:
        req = offs
    back = tl.load(back_ptr + req, mask=live, other=0).to(tl.int32)
    tl.store(seq_lens_ptr + offs, tl.load(seq_lens_ptr + offs, mask=live, other=0) - back, mask=live)


def move_back(positions: torch.Tensor, slot_mapping: torch.Tensor, seq_lens: torch.Tensor,
              block_tables: torch.Tensor, block_size: int, rows: torch.Tensor, back: torch.Tensor,
              reqs: torch.Tensor | None = None, sources: torch.Tensor | None = None) -> None:
    """See the module docstring: the batch's first `len(rows)` tokens and first `len(reqs)` requests
    (reqs None: `len(back)`) move; padding past them stays as it is."""
    num_tokens, num_reqs = rows.shape[0], (back if reqs is None else reqs).shape[0]
    if max(num_tokens, num_reqs) == 0:
        return
    if block_tables.stride(1) != 1:
        raise ValueError("block_tables must be contiguous along a row")
    grid = (triton.cdiv(max(num_tokens, num_reqs), BLOCK),)
    _move_back_kernel[grid](
        positions, slot_mapping, seq_lens, block_tables, rows, back, rows if reqs is None else reqs,
        slot_mapping if sources is None else sources, num_tokens, num_reqs, block_tables.stride(0),
        BLOCK_SIZE=block_size, HAS_REQS=reqs is not None, HAS_SOURCES=sources is not None, BLOCK=BLOCK,
        num_warps=1, **pdl_args(positions.device))


def warm_up_move_back(device: torch.device, block_size: int) -> None:
    """Compile the variants the engine launches (a target step; a head's catch-up over every request of
    the step, or over some), so that none compiles while serving."""
    tables = torch.zeros(2, 4, dtype=torch.int32, device=device)
    rows = torch.tensor([0, 0, 1], device=device)
    for reqs, sources in ((None, None), (None, True), (True, True)):
        move_back(torch.full((3,), 9, device=device), torch.zeros(3, dtype=torch.long, device=device),
                  torch.full((2,), 9, dtype=torch.int32, device=device), tables, block_size, rows,
                  torch.zeros(2, dtype=torch.long, device=device),
                  None if reqs is None else torch.tensor([0, 1], device=device),
                  None if sources is None else torch.zeros(3, dtype=torch.long, device=device))
