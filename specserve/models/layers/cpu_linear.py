"""Linear layers on the CPU through oneDNN, their weights reordered once when the model is placed.

`nn.functional.linear` on the CPU goes to the BLAS torch was built with. Its small-batch path is what
decoding meets: one token per request, or the few tokens of a verification. On the project's AMD
EPYC machines a 2-5 token fp32 product there costs up to 2.2 one-token ones (the default model's
forward: 1.5-2.2). oneDNN's matmul over a weight reordered into its blocked layout ahead of time
streams the weight once for any small batch: a 2-5 token forward costs 0.9-1.1 one-token ones, and a
one-token forward is 1.5x faster in fp32 and 1.4x in bf16 (`bench/cpu_linear.py`, BENCHMARKS.md).

In fp32 a row's result is the same bits whatever else is in the batch (tests/engine/test_cpu_linear.py),
which is what lets a verification's rows equal one-token decoding's. It takes one repair: on AVX-512
CPUs oneDNN blocks a one-row product over a long input (1152 wide or more, as the default model's MLP
down projection, 1536) differently from a product of two or more rows, whose rows all agree; a layer
that shows this when it is packed (`_one_row_differs`) runs a lone row as two (the row twice; ~10 us
more a call, on that layer only). In bf16 the blocking also changes with the row count (on CPUs with
AMX past 32 rows; with AVX512-BF16 alone, for wide inputs, past a few rows), so bf16 rows are not
batch-invariant: the engine states greedy exactness for fp32 only.

`pack_linears(model)` (the engine builder calls it for a CPU engine's models) swaps a model's
`nn.Linear` layers for `PackedLinear` (the reordered weight replaces the original: no extra memory)
and gives its weight-tensor LM heads (a tied head; an EAGLE head's draft-vocabulary rows, through
`use_packed_linears`) packed copies (those are extra memory: the embedding keeps its rows). Only
fp32, and bf16 where oneDNN runs bf16 (AVX-512 or native bf16 CPUs, not AVX2-only ones), are
packed, and only weights of at least MIN_PACKED_ELEMENTS; quantized layers (bitsandbytes) are not
`nn.Linear` and stay as they are.
"""
from __future__ import annotations

import os

import torch
from torch import nn

ENV_SWITCH = "SPECSERVE_CPU_LINEAR"  # "torch": leave linear layers to nn.functional.linear (A/B runs)
# weights smaller than this (elements) stay with torch: a oneDNN call costs ~15 us more on its own, which
# a 576 x 576 layer breaks even with at one token (bench/cpu_linear.py) and a test-sized one never does
MIN_PACKED_ELEMENTS = 1 << 18
# (out_features, in_features, dtype) -> does oneDNN compute a lone row of such a product differently from
# the same row in a batch, on this CPU (`PackedLinear._one_row_differs`)
_ONE_ROW_DIFFERS: dict[tuple[int, int, torch.dtype], bool] = {}


def can_pack(weight: torch.Tensor) -> bool:
    """Should oneDNN run this linear layer's weight [out, in] on this CPU: a dtype it has native math
    for, large enough, and not switched off?"""
    if os.environ.get(ENV_SWITCH, "onednn") == "torch" or not torch.backends.mkldnn.is_available():
        return False
    if weight.numel() < MIN_PACKED_ELEMENTS:
        return False
    dtype = weight.dtype
    if dtype == torch.float32:
        return True
    if dtype == torch.bfloat16:  # oneDNN's bf16 needs AVX-512 (or native bf16): not on AVX2-only CPUs
        return torch.ops.mkldnn._is_mkldnn_bf16_supported()
    return False


class PackedLinear(nn.Module):
    """y = x W^T + b with W [out_features, in_features] held in oneDNN's blocked layout (opaque: no
    `.weight` to read, no gradient). x: [..., in_features], contiguous or not."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.dtype = weight.dtype
        with torch.no_grad():
            self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)
            self.bias = None if bias is None else bias.detach().clone()
            key = (self.out_features, self.in_features, self.dtype)
            if key not in _ONE_ROW_DIFFERS:  # oneDNN's blocking follows the shape: one check per shape
                _ONE_ROW_DIFFERS[key] = self._one_row_differs()
            self.pad_one_row = _ONE_ROW_DIFFERS[key]

    def _product(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    def _one_row_differs(self) -> bool:
        """Does oneDNN compute a row alone differently from the same row beside another (on this CPU,
        for this shape)? A random row tells: a different summation order changes its bits."""
        row = torch.randn(1, self.in_features, generator=torch.Generator().manual_seed(0)).to(self.dtype)
        pair = torch.cat([row, torch.randn_like(row)])
        return not torch.equal(self._product(row), self._product(pair)[:1])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.pad_one_row and x.numel() == self.in_features:  # a lone row runs as two (module docstring)
            return self._product(x.reshape(1, -1).expand(2, -1))[:1].reshape(*x.shape[:-1], self.out_features)
        return self._product(x)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, dtype={self.dtype}, onednn"


def pack_linears(model: nn.Module) -> int:
    """Swap every `nn.Linear` of `model` that `can_pack` allows for a PackedLinear; a tied LM head
    (the models' convention: `lm_head` None, `embed_tokens` an nn.Embedding) becomes a PackedLinear
    over a copy of the embedding's rows (`compute_logits` then runs it); a model with other
    weight-tensor heads packs them itself (`use_packed_linears(pack)`). Returns how many layers were
    packed. For inference only: a packed model cannot be trained."""
    packed = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear and can_pack(child.weight):
                setattr(parent, name, PackedLinear(child.weight, child.bias))
                packed += 1
    embed = getattr(model, "embed_tokens", None)
    if getattr(model, "lm_head", False) is None and type(embed) is nn.Embedding and can_pack(embed.weight):
        model.lm_head = PackedLinear(embed.weight)
        packed += 1
    hook = getattr(model, "use_packed_linears", None)
    if hook is not None:
        packed += hook(lambda w: PackedLinear(w) if can_pack(w) else None)
    return packed
