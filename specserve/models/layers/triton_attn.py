"""Triton attention backend: `reshape_and_cache` + one `paged_attention` call per layer.

The kernels read `query_start_loc`, `seq_lens` and `block_tables` straight from the metadata, so
`prepare` has nothing to precompute and the whole forward is free of host syncs (CUDA-graph safe).
Triton is imported lazily: this module imports on machines without Triton or a GPU, and
`get_attention_backend` decides availability by constructing the backend only on CUDA.
"""
from __future__ import annotations

import torch

from specserve.models.layers.attention import AttentionMetadata


class TritonAttentionBackend:
    name = "triton"

    def __init__(self) -> None:
        from specserve.kernels import paged_attention, reshape_and_cache, warm_up_paged_attention  # needs triton

        self._paged_attention = paged_attention
        self._reshape_and_cache = reshape_and_cache
        self._warm_up = warm_up_paged_attention

    def warm_up(self, num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, block_size: int,
                max_model_len: int, device: torch.device, sliding_windows: tuple[int | None, ...]) -> None:
        """Compile every attention kernel variant these heads can need (kernels/paged_attention.py)."""
        self._warm_up(num_heads, num_kv_heads, head_dim, dtype, block_size, max_model_len, device, sliding_windows)

    def prepare(self, meta: AttentionMetadata) -> None:
        """Nothing to precompute: the kernels read the metadata tensors directly."""

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                sliding_window: int | None = None) -> torch.Tensor:
        """query: [num_tokens, num_heads, head_dim]; key/value: [num_tokens, num_kv_heads, head_dim];
        kv_cache: [2, num_blocks, block_size, num_kv_heads, head_dim]. Returns [num_tokens, num_heads, head_dim]."""
        if kv_cache.shape[2] != meta.block_size:
            raise ValueError(f"kv_cache block size {kv_cache.shape[2]} != metadata block_size "
                             f"{meta.block_size}")
        self._reshape_and_cache(key, value, kv_cache, meta.slot_mapping)
        return self._paged_attention(query, kv_cache, meta.query_start_loc, meta.seq_lens, meta.block_tables,
                                     scale, meta.max_query_len, meta.max_seq_len, sliding_window=sliding_window)
