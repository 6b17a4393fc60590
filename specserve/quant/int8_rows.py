"""Int8 weight rows: the quantization (one fp32 scale per output row, symmetric) and the product's
math in plain PyTorch (the CPU's path and the Triton kernel's test oracle; quant/int8_linear.py)."""
from __future__ import annotations

import torch
from torch import nn


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
