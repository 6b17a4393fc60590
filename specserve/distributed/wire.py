"""What rank 0 sends the workers per call (executor.py sends, worker.py receives): a pickled header
over the host group, and for a forward the step's integer tensors packed into one int64 tensor."""
from __future__ import annotations

import pickle

import torch
import torch.distributed as dist

from specserve.models.layers.attention import AttentionMetadata

HEADER_BYTES = 4096  # a call's header fits in one broadcast of this size unless the step is large


def encode_header(header: tuple) -> list[torch.Tensor]:
    """A call's header as uint8 tensors: one of HEADER_BYTES (8-byte length + the pickle's start), and
    the rest of a longer pickle (a step of many requests) in a second."""
    data = pickle.dumps(header)
    first = torch.zeros(HEADER_BYTES, dtype=torch.uint8)
    first[:8] = torch.frombuffer(bytearray(len(data).to_bytes(8, "little")), dtype=torch.uint8)
    head = data[:HEADER_BYTES - 8]
    first[8:8 + len(head)] = torch.frombuffer(bytearray(head), dtype=torch.uint8)
    rest = data[HEADER_BYTES - 8:]
    return [first] + ([torch.frombuffer(bytearray(rest), dtype=torch.uint8)] if rest else [])


def receive_header(group: dist.ProcessGroup) -> tuple:
    """A worker's side of `encode_header`: waits (forever) for rank 0's next call."""
    first = torch.empty(HEADER_BYTES, dtype=torch.uint8)
    dist.broadcast(first, src=0, group=group)
    size = int.from_bytes(first[:8].numpy().tobytes(), "little")
    data = first[8:8 + size].numpy().tobytes()
    if size > HEADER_BYTES - 8:
        rest = torch.empty(size - (HEADER_BYTES - 8), dtype=torch.uint8)
        dist.broadcast(rest, src=0, group=group)
        data += rest.numpy().tobytes()
    return pickle.loads(data)


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
