"""Weight-only int8 linear layers, for an EAGLE head's draft steps (speculative_config
`"quantization": "int8"`).

A draft step runs the head over one to a few dozen rows, where a linear layer costs the bytes of its
weights: int8 rows (one fp32 scale per output row, symmetric, rounded to nearest) read half a bf16
layer's. Activations stay in the model's dtype. On CUDA the Triton kernel (kernels/int8_linear.py)
widens each weight tile on the fly; elsewhere `int8_linear_torch` widens the whole weight every call
(the same math, slower than the unquantized layer: for tests and for CPUs, which gain nothing).
Quantizing changes a head's drafts slightly, never the output: the target verifies every draft.
"""
from __future__ import annotations

import torch
from torch import nn

_KERNEL: list = []  # [the Triton kernel, or None where Triton is missing], filled on first CUDA use


def quantize_int8_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A float weight [N, K] -> (int8 [N, K], fp32 scale [N]): per output row, symmetric, round to
    nearest (scale = the row's largest |weight| / 127; an all-zero row gets scale 1)."""
    w = weight.detach().float()
    scale = w.abs().amax(dim=1) / 127.0
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return q.contiguous(), scale.contiguous()


def int8_linear_torch(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                      bias: torch.Tensor | None = None) -> torch.Tensor:
    """(x @ weight.T) * scale (+ bias) in fp32, rounded to x's dtype: the kernel's math in PyTorch (its
    test oracle)."""
    y = nn.functional.linear(x.float(), weight.float()) * scale
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


def _kernel():
    if not _KERNEL:
        try:
            from specserve.kernels.int8_linear import int8_linear
            _KERNEL.append(int8_linear)
        except ImportError:
            _KERNEL.append(None)
    return _KERNEL[0]


class Int8Linear(nn.Module):
    """y = x W^T + b, W held as int8 rows and their fp32 scales (buffers: no gradient, inference only)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        q, scale = quantize_int8_rows(weight)
        self.register_buffer("weight", q)
        self.register_buffer("scale", scale)
        self.register_buffer("bias", None if bias is None else bias.detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda and (kernel := _kernel()) is not None:
            return kernel(x, self.weight, self.scale, self.bias)
        return int8_linear_torch(x, self.weight, self.scale, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 rows"


def quantize_linears(module: nn.Module) -> int:
    """Swap every `nn.Linear` inside `module` for an Int8Linear of its weights; returns how many."""
    swapped = 0
    for parent in list(module.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear:
                setattr(parent, name, Int8Linear(child.weight, child.bias))
                swapped += 1
    return swapped
