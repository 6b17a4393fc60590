"""Attention over the paged KV cache: per-step metadata, the backend interface, backend selection.

KV cache layout (one tensor per layer): `[2, num_blocks, block_size, num_kv_heads, head_dim]`,
index 0 = keys, 1 = values. Token `t` of a request lives at slot `block_table[t // block_size] *
block_size + t % block_size`; `slot_mapping` holds that slot for every token of the step.

A step's batch is flat and ragged: request `i` contributes tokens
`query_start_loc[i]:query_start_loc[i+1]` (1 for a decode, 1 + k for a speculative verification,
a chunk for prefill), which are the LAST `query_len` tokens of its `seq_lens[i]`-long context.
Attention is causal inside each request's query. A layer may pass a `sliding_window` W (a constant of
that layer, e.g. Gemma 3's local layers): the token at position p then attends to positions
p - W + 1 .. p only. The cache keeps every key either way (block tables and the prefix cache do not
change); keys before the window are masked.
"""
from __future__ import annotations

import importlib
import os
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

PAD_SLOT_ID = -1
# name -> "module:class". By name, not imported here: the backends import this interface module.
_BACKENDS = {
    "torch": "specserve.models.layers.torch_attn:TorchAttentionBackend",
    "triton": "specserve.models.layers.triton_attn:TritonAttentionBackend",
}


@dataclass
class AttentionMetadata:
    num_reqs: int
    num_tokens: int
    max_query_len: int
    max_seq_len: int
    query_start_loc: torch.Tensor  # [num_reqs + 1] int32, device
    seq_lens: torch.Tensor  # [num_reqs] int32, device; context length including this step's tokens
    block_tables: torch.Tensor  # [num_reqs, max_blocks_per_req] int32, device
    slot_mapping: torch.Tensor  # [num_tokens] int64, device; PAD_SLOT_ID = do not write
    query_lens_cpu: list[int]
    seq_lens_cpu: list[int]
    block_size: int  # tokens per KV block (the cache's dim 2)
    extra: dict[str, Any] = field(default_factory=dict)  # the backend's own per-step tensors (prepare)


class AttentionBackend(Protocol):
    name: str

    def warm_up(self, num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, block_size: int,
                max_model_len: int, device: torch.device, sliding_windows: tuple[int | None, ...]) -> None:
        """Compile (once, before serving) every kernel variant attention of this shape can launch."""

    def prepare(self, meta: AttentionMetadata) -> None:
        """Precompute per-step tensors (once per step, shared by all layers) into `meta.extra`."""

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                sliding_window: int | None = None) -> torch.Tensor:
        """Write `key`/`value` into `kv_cache` at `meta.slot_mapping`, then attend (over the last
        `sliding_window` positions of each token when given).

        query: [num_tokens, num_heads, head_dim]; key/value: [num_tokens, num_kv_heads, head_dim];
        kv_cache: [2, num_blocks, block_size, num_kv_heads, head_dim]. Returns [num_tokens, num_heads, head_dim].
        """


def get_attention_backend(name: str, device: torch.device) -> AttentionBackend:
    """`auto` picks triton on CUDA (when importable) and the torch reference elsewhere."""
    if name == "auto":
        name = "triton" if device.type == "cuda" and _triton_available() else "torch"
    if name not in _BACKENDS:
        raise ValueError(f"unknown attention backend {name!r} (choose auto, torch or triton)")
    if name == "triton" and device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError("attention backend 'triton' needs a CUDA device (or, slowly, TRITON_INTERPRET=1); "
                         "use --attention-backend torch")
    return _backend_class(name)()


def _backend_class(name: str) -> type:
    module, _, cls = _BACKENDS[name].partition(":")
    return getattr(importlib.import_module(module), cls)


def _triton_available() -> bool:
    try:
        import triton  # noqa: F401
        _backend_class("triton")
    except ImportError:
        return False
    return True
