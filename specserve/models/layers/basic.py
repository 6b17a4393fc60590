"""RMSNorm, rotary embedding (with Llama-3 and linear scaling) and the SwiGLU MLP."""
from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

_FUSED: tuple | None = None


def fused_ops() -> tuple | None:
    """The Triton RMSNorm / RoPE / SwiGLU-activation kernels, or None where Triton is missing (CUDA
    tensors only) or gradients are being recorded (the kernels have no backward: training a draft
    head, specserve/spec_decode/train.py, takes the plain PyTorch path)."""
    if torch.is_grad_enabled():
        return None
    global _FUSED
    if _FUSED is None:
        try:
            from specserve.kernels import rms_norm, rotary_embedding, silu_and_mul
            _FUSED = (rms_norm, rotary_embedding, silu_and_mul)
        except ImportError:
            _FUSED = ()
    return _FUSED or None


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """With `residual`: returns (norm(x + residual), x + residual)."""
        if x.is_cuda and (fused := fused_ops()) is not None:
            return fused[0](x, self.weight, self.eps, residual)
        if residual is not None:
            x = x + residual
            residual = x
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        h = self.weight * h.to(dtype)
        return h if residual is None else (h, residual)


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if not scaling:
        return inv_freq
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "linear":
        return inv_freq / float(scaling["factor"])
    if kind == "llama3":
        factor = float(scaling["factor"])
        low, high = float(scaling.get("low_freq_factor", 1.0)), float(scaling.get("high_freq_factor", 4.0))
        old_len = float(scaling["original_max_position_embeddings"])
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled)
    raise ValueError(f"unsupported rope scaling {kind!r}")


class RotaryEmbedding(nn.Module):
    """Neox-style rotation (rotate halves), cos/sin tables precomputed in fp32 for all positions."""

    def __init__(self, head_dim: int, max_positions: int, theta: float,
                 scaling: dict[str, Any] | None) -> None:
        super().__init__()
        inv_freq = rope_inv_freq(head_dim, theta, scaling)
        freqs = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)  # [max_positions, head_dim]
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: [T]; q: [T, H, D]; k: [T, KVH, D]."""
        if q.is_cuda and (fused := fused_ops()) is not None:
            return fused[1](positions, q, k, self.cos, self.sin)
        cos = self.cos[positions].to(q.dtype)[:, None, :]
        sin = self.sin[positions].to(q.dtype)[:, None, :]
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class SwiGLU(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.intermediate_size = intermediate_size
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if gate_up.is_cuda and gate_up.dim() == 2 and (fused := fused_ops()) is not None:
            return self.down_proj(fused[2](gate_up))
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        return self.down_proj(nn.functional.silu(gate) * up)
