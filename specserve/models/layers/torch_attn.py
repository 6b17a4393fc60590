"""Plain-PyTorch paged attention: the reference backend, used on the CPU and as the oracle.

Requests are attended in padded groups with `scaled_dot_product_attention`: all decodes (one query
token) in one batch, the other short queries (speculative verifications, 1 + k tokens) in another,
each long prefill chunk on its own, so padding never multiplies a prefill chunk by the batch size,
nor a verification's 1 + k rows by the number of decodes.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from specserve.models.layers.attention import AttentionMetadata

SHORT_QUERY_MAX = 32  # queries up to this length share one padded batch
HALF_TYPES = (torch.bfloat16, torch.float16)


@dataclass(slots=True)
class _Group:
    q_index: torch.Tensor  # [B, Q] flat token index of each (padded) query row
    q_valid: torch.Tensor | None  # [B, Q] bool, None when no row is padding
    mask: torch.Tensor  # [B, 1, Q, num_blocks * block_size] bool, True = attend
    q_pos: torch.Tensor  # [B, Q] absolute position of each query row
    block_ids: torch.Tensor  # [B * num_blocks] the requests' block tables, flattened (the KV gather's index)
    windowed: dict[int, torch.Tensor] = field(default_factory=dict)  # sliding window -> its mask, per step
    folded: dict[tuple, torch.Tensor] = field(default_factory=dict)  # (window, rows per KV head) -> mask

    def folded_mask_for(self, sliding_window: int | None, group: int) -> torch.Tensor:
        """`mask_for`'s rows repeated for `_folded_attention` (row g x Q + i is query row i of the g-th
        query head of a KV head): [B, 1, group x Q, L], built once per step, window and group."""
        mask = self.mask_for(sliding_window)
        if mask.shape[2] == 1:  # one query row per request: its mask broadcasts over the rows
            return mask
        folded = self.folded.get((sliding_window, group))
        if folded is None:
            folded = self.folded[sliding_window, group] = mask.repeat(1, 1, group, 1)
        return folded

    def mask_for(self, sliding_window: int | None) -> torch.Tensor:
        """The causal mask, narrowed to the last `sliding_window` positions of each row (built once per
        step and window: the local layers of a model share it)."""
        if sliding_window is None:
            return self.mask
        mask = self.windowed.get(sliding_window)
        if mask is None:
            kv_pos = torch.arange(self.mask.shape[-1], device=self.mask.device)
            in_window = kv_pos[None, None, :] > (self.q_pos - sliding_window)[:, :, None]
            mask = self.windowed[sliding_window] = self.mask & in_window[:, None]
        return mask


class TorchAttentionBackend:
    name = "torch"

    def warm_up(self, num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, block_size: int,
                max_model_len: int, device: torch.device, sliding_windows: tuple[int | None, ...]) -> None:
        """Nothing to compile."""

    def prepare(self, meta: AttentionMetadata) -> None:
        decodes = [i for i, q in enumerate(meta.query_lens_cpu) if q == 1]
        short = [i for i, q in enumerate(meta.query_lens_cpu) if 1 < q <= SHORT_QUERY_MAX]
        groups = [g for g in (decodes, short) if g]
        groups += [[i] for i, q in enumerate(meta.query_lens_cpu) if q > SHORT_QUERY_MAX]
        meta.extra["torch_groups"] = [self._build_group(meta, g) for g in groups]
        written = meta.slot_mapping >= 0  # PAD_SLOT_ID rows (padding) write nothing
        rows = None if bool(written.all()) else written.nonzero().squeeze(1)
        meta.extra["torch_written"] = None if rows is None else (rows, meta.slot_mapping[rows])

    def _build_group(self, meta: AttentionMetadata, reqs: list[int]) -> _Group:
        device = meta.block_tables.device
        block_size = meta.block_size
        q_lens = [meta.query_lens_cpu[i] for i in reqs]
        max_q = max(q_lens)
        # the host's context lengths bound the device's (a step scheduled ahead of its predecessor's
        # tokens is moved back on the device: model_runner.py, `launch`): the mask reads the device's
        num_blocks = -(-max(meta.seq_lens_cpu[i] for i in reqs) // block_size)
        req_idx = torch.tensor(reqs, device=device)
        starts = meta.query_start_loc[req_idx].long()  # [B]
        q_lens_t = torch.tensor(q_lens, device=device)
        s_lens_t = meta.seq_lens[req_idx].long()
        rows = torch.arange(max_q, device=device)
        q_valid = rows[None, :] < q_lens_t[:, None]  # [B, Q]
        q_index = torch.where(q_valid, starts[:, None] + rows[None, :], starts[:, None])
        q_pos = (s_lens_t - q_lens_t)[:, None] + rows[None, :]  # absolute position of each query row
        kv_pos = torch.arange(num_blocks * block_size, device=device)
        mask = (kv_pos[None, None, :] <= q_pos[:, :, None]) & (kv_pos[None, None, :] < s_lens_t[:, None, None])
        return _Group(q_index=q_index, q_valid=None if min(q_lens) == max_q else q_valid,
                      block_ids=meta.block_tables[req_idx, :num_blocks].reshape(-1).long(), mask=mask[:, None],
                      q_pos=q_pos)

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                sliding_window: int | None = None) -> torch.Tensor:
        num_kv_heads, head_dim = key.shape[1], key.shape[2]
        flat_cache = kv_cache.view(2, -1, num_kv_heads, head_dim)  # [2, num_slots, kvh, d]
        written = meta.extra.get("torch_written")  # (rows, their slots) when some rows are padding
        if written is None:
            flat_cache[0].index_copy_(0, meta.slot_mapping, key)
            flat_cache[1].index_copy_(0, meta.slot_mapping, value)
        else:
            rows, slots = written
            flat_cache[0].index_copy_(0, slots, key[rows])
            flat_cache[1].index_copy_(0, slots, value[rows])
        out = torch.empty_like(query)
        for g in meta.extra["torch_groups"]:
            batch = g.q_index.shape[0]
            q = query[g.q_index].transpose(1, 2)  # [B, H, Q, d]
            # index_select copies whole blocks (rows of dim 0): on the CPU 2.5x faster than indexing with
            # the [B, num_blocks] table in bf16 (64 requests x 14 blocks: 0.23 against 0.6 ms a gather)
            k = kv_cache[0].index_select(0, g.block_ids).view(batch, -1, num_kv_heads, head_dim).transpose(1, 2)
            v = kv_cache[1].index_select(0, g.block_ids).view(batch, -1, num_kv_heads, head_dim).transpose(1, 2)
            if q.dtype in HALF_TYPES and q.device.type == "cpu" and q.shape[2] <= SHORT_QUERY_MAX:
                group = q.shape[1] // num_kv_heads
                o = _folded_attention(q, k, v, g.folded_mask_for(sliding_window, group), scale)
            else:
                mask = g.mask_for(sliding_window)
                o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale,
                                                   enable_gqa=q.shape[1] != k.shape[1])
            o = o.transpose(1, 2)  # [B, Q, H, d]
            if g.q_valid is None:
                out[g.q_index.reshape(-1)] = o.reshape(-1, *o.shape[2:])
            else:
                out[g.q_index[g.q_valid]] = o[g.q_valid]
        return out


def _folded_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                      scale: float) -> torch.Tensor:
    """Attention of few query rows per request (q [B, H, Q, d]: decodes, Q = 1, and verifications,
    Q = 1 + k; k, v [B, KVH, L, d]) in half precision on the CPU, as rows of fewer heads: the G = H / KVH
    query heads that share a KV head become the G x Q rows of one query against it (`mask` [B, 1, G x Q, L]:
    `_Group.folded_mask_for`; a lone row, G = Q = 1, is doubled). Prefill chunks longer than
    SHORT_QUERY_MAX do not come here. The CPU's half-precision SDPA kernel runs
    a few query rows per head several times slower than the same rows folded: 64 requests, 9 query heads
    over 3 KV heads, 272 positions, bf16, 2 cores: 9.4 ms as one row of 9 heads, 1.4 ms as 3 rows of 3
    (BENCHMARKS.md); on an Intel Xeon with AMX, 224 positions, 2 rows (a verification of one draft) 1.6 ms
    against 0.84 ms folded, bit-identical. The same attention: each row still reads its own KV head's
    positions under its own row of the request's mask. Returns [B, H, Q, d]."""
    batch, heads, num_q, dim = q.shape
    kv_heads = k.shape[1]
    rows = q.reshape(batch, kv_heads, heads // kv_heads * num_q, dim)  # query head h reads KV head h // G
    if rows.shape[2] == 1:
        rows = torch.cat([rows, rows], dim=2)  # the mask, one row, broadcasts
    o = F.scaled_dot_product_attention(rows, k, v, attn_mask=mask, scale=scale)
    return o[:, :, :heads // kv_heads * num_q].reshape(batch, heads, num_q, dim)
