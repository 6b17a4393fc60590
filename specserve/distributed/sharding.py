"""Megatron sharding of the Llama family: which rank holds which slice of each checkpoint tensor.

Column-parallel (rows of the weight split, no communication): q_proj by query heads, k_proj / v_proj
by KV heads (rank r holds KV heads r*KVH/N.. and the query heads that read them), gate_proj / up_proj
by intermediate rows, their biases alike. Row-parallel (columns split, one all-reduce of the output):
o_proj and down_proj. Vocabulary-parallel: embed_tokens and lm_head by vocabulary rows, padded to a
multiple of N with zero rows (never looked up; their logits are cut off). Norms are replicated.
A rank's model is built from `shard_arch`: the same module code over the per-rank shapes.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator

import torch

from specserve.models.registry import ArchConfig

TP_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
_COLUMN = ("self_attn.q_proj.", "self_attn.k_proj.", "self_attn.v_proj.", "mlp.gate_proj.", "mlp.up_proj.")
_ROW = ("self_attn.o_proj.", "mlp.down_proj.")
_VOCAB = ("embed_tokens.", "lm_head.")


def check_tensor_parallel(arch: ArchConfig, size: int) -> None:
    """A ValueError saying why `arch` cannot be split `size` ways, if it cannot."""
    if size == 1:
        return
    if arch.architecture not in TP_ARCHITECTURES:
        raise ValueError(f"tensor parallelism supports {', '.join(TP_ARCHITECTURES)}; {arch.architecture} runs "
                         "with tensor_parallel_size 1")
    for what, n in (("attention heads", arch.num_heads), ("KV heads", arch.num_kv_heads),
                    ("intermediate size", arch.intermediate_size)):
        if n % size:
            raise ValueError(f"tensor_parallel_size {size} must divide the model's {what} ({n}); "
                             f"choose one of {', '.join(str(d) for d in range(1, n + 1) if n % d == 0 and d <= 8)}")


def vocab_shard(vocab_size: int, size: int) -> int:
    return -(-vocab_size // size)


def shard_arch(arch: ArchConfig, size: int) -> ArchConfig:
    """The shapes one rank's model has: its heads, its intermediate rows, its vocabulary rows."""
    check_tensor_parallel(arch, size)
    return dataclasses.replace(arch, num_heads=arch.num_heads // size, num_kv_heads=arch.num_kv_heads // size,
                               intermediate_size=arch.intermediate_size // size,
                               vocab_size=vocab_shard(arch.vocab_size, size))


def shard_weights(weights: Iterable[tuple[str, torch.Tensor]], arch: ArchConfig, rank: int, size: int
                  ) -> Iterator[tuple[str, torch.Tensor]]:
    """HF-named full tensors -> this rank's slices (same names)."""
    for name, tensor in weights:
        if any(k in name for k in _VOCAB):
            yield name, _vocab_rows(tensor, rank, vocab_shard(arch.vocab_size, size))
        elif any(k in name for k in _COLUMN):
            yield name, tensor.chunk(size, dim=0)[rank].contiguous()
        elif any(k in name for k in _ROW) and tensor.dim() == 2:
            yield name, tensor.chunk(size, dim=1)[rank].contiguous()
        else:
            yield name, tensor


def _vocab_rows(tensor: torch.Tensor, rank: int, shard: int) -> torch.Tensor:
    rows = tensor[rank * shard:(rank + 1) * shard]
    if rows.shape[0] == shard:
        return rows.contiguous()
    out = torch.zeros(shard, *tensor.shape[1:], dtype=tensor.dtype, device=tensor.device)
    out[:rows.shape[0]] = rows
    return out
