"""Weight-only int8 linear layers, for an EAGLE head's draft steps (speculative_config
`"quantization": "int8"`).

A draft step runs the head over one to a few dozen rows, where a linear layer costs the bytes of its
weights: int8 rows (one fp32 scale per output row, symmetric, rounded to nearest) read half a bf16
layer's. Activations stay in the model's dtype. Products over more than INT8_MAX_ROWS rows (a batch of
many requests, a catch-up over a prompt) use the float weights, kept beside, where the kernel is
slower. On CUDA the Triton kernel (kernels/int8_linear.py) widens each weight tile on the fly;
elsewhere `int8_linear_torch` widens the whole weight every call (the same math, slower than the
unquantized layer: for tests and for CPUs, which gain nothing). Quantizing changes a head's drafts
slightly, never the output: the target verifies every draft.
"""
from __future__ import annotations

import torch
from torch import nn

from specserve.quant.int8_rows import int8_linear_torch, quantize_int8_rows

_KERNEL: list = []  # [the Triton kernel, or None where Triton is missing], filled on first CUDA use
# Up to this many rows a product reads the int8 rows; more rows read the float weights kept beside them:
# on an H200 the kernel takes 0.73-0.75x the bf16 GEMM's time on an 8B head's layers up to 16 rows, and
# 1.44x at 64 (BENCHMARKS.md, 2026-12-05)
INT8_MAX_ROWS = 16


def _kernel():
    if not _KERNEL:
        try:
            from specserve.kernels.int8_linear import int8_linear
            _KERNEL.append(int8_linear)
        except ImportError:
            _KERNEL.append(None)
    return _KERNEL[0]


class Int8Linear(nn.Module):
    """y = x W^T + b: up to INT8_MAX_ROWS rows from W's int8 rows and their fp32 scales, more rows from
    the float W kept beside them (buffers: no gradient, inference only; the layer holds 1.5x a bf16
    layer's bytes)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        q, scale = quantize_int8_rows(weight)
        self.register_buffer("weight", q)
        self.register_buffer("scale", scale)
        self.register_buffer("float_weight", weight.detach())
        self.register_buffer("bias", None if bias is None else bias.detach().clone())
        self.max_int8_rows = INT8_MAX_ROWS  # a benchmark may raise it: every product from the int8 rows

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.numel() > self.max_int8_rows * self.in_features:
            return nn.functional.linear(x, self.float_weight, self.bias)
        if x.is_cuda and (kernel := _kernel()) is not None:
            return kernel(x, self.weight, self.scale, self.bias)
        return int8_linear_torch(x, self.weight, self.scale, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 rows"


def quantize_linears(module: nn.Module, skip: tuple[str, ...] = ()) -> int:
    """Swap every `nn.Linear` inside `module` for an Int8Linear of its weights, except those whose
    qualified name starts with one of `skip`; returns how many."""
    swapped = 0
    for prefix, parent in list(module.named_modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear and not f"{prefix}.{name}".lstrip(".").startswith(skip):
                setattr(parent, name, Int8Linear(child.weight, child.bias))
                swapped += 1
    return swapped
