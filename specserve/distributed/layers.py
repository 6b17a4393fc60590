"""The parallel layers a rank's model runs with (`parallelize` puts them in place of the plain ones
after its shard is loaded, keeping parameter names): row-parallel o_proj / down_proj (one all-reduce
each), the vocabulary-parallel embedding (one all-reduce) and LM head (logits gathered on rank 0).
The model code itself knows nothing of ranks; with one rank nothing is replaced."""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from specserve.distributed.state import TPGroup


class RowParallelLinear(nn.Module):
    """y = x @ W.T where this rank holds W's input columns for its slice of x: the partial products
    of all ranks are summed (in place, captured by CUDA graphs with the rest of the forward)."""

    def __init__(self, weight: nn.Parameter, group: TPGroup) -> None:
        super().__init__()
        self.weight = weight  # [out, in / N]
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.group.all_reduce(nn.functional.linear(x, self.weight))


class VocabParallelEmbedding(nn.Module):
    """Rows [start, start + shard) of the embedding; ids outside them contribute zeros, and the sum
    over ranks is the full lookup."""

    def __init__(self, weight: nn.Parameter, group: TPGroup) -> None:
        super().__init__()
        self.weight = weight  # [vocab / N (padded), hidden]
        self.group = group
        self.start = group.rank * weight.shape[0]

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - self.start
        outside = (local < 0) | (local >= self.weight.shape[0])
        out = nn.functional.embedding(local.masked_fill(outside, 0), self.weight)
        return self.group.all_reduce(out.masked_fill_(outside[:, None], 0))


class ParallelLMHead(nn.Module):
    """Logits of this rank's vocabulary rows, gathered on rank 0 into [N, vocab_size]; the other ranks
    return their own slice (nobody reads it)."""

    def __init__(self, weight: nn.Parameter, vocab_size: int, group: TPGroup) -> None:
        super().__init__()
        self.weight = weight  # [vocab / N (padded), hidden]; the embedding's when tied
        self.vocab_size = vocab_size
        self.group = group

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        local = nn.functional.linear(hidden, self.weight)  # [N, vocab / N]
        if self.group.rank != 0:
            dist.gather(local, None, dst=0, group=self.group.model)
            return local
        parts = [torch.empty_like(local) for _ in range(self.group.size)]
        dist.gather(local, parts, dst=0, group=self.group.model)
        return torch.cat(parts, dim=-1)[:, :self.vocab_size]


def parallelize(model: nn.Module, group: TPGroup, vocab_size: int) -> None:
    """Swap in the parallel layers, in place, on a model built from `shard_arch` holding its shard."""
    for layer in model.layers:
        assert layer.self_attn.o_proj.bias is None and layer.mlp.down_proj.bias is None, "row-parallel: no bias"
        layer.self_attn.o_proj = RowParallelLinear(layer.self_attn.o_proj.weight, group)
        layer.mlp.down_proj = RowParallelLinear(layer.mlp.down_proj.weight, group)
    head = model.lm_head.weight if model.lm_head is not None else model.embed_tokens.weight
    model.embed_tokens = VocabParallelEmbedding(model.embed_tokens.weight, group)
    model.lm_head = ParallelLMHead(head, vocab_size, group)
