"""Our Llama-family model (Llama 2/3, SmolLM2, Qwen2/2.5, Qwen3, Mistral) over a flat ragged token batch.

Fused QKV and gate/up projections; attention goes through an AttentionBackend over the paged KV cache.
The forward takes all of a step's tokens at once ([num_tokens]); no batch or padding dimension.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import nn

from specserve.models.layers.attention import AttentionBackend, AttentionMetadata
from specserve.models.layers.basic import RMSNorm, RotaryEmbedding, SwiGLU
from specserve.models.registry import ArchConfig
from specserve.models.weights import load_stacked_weights


class Attention(nn.Module):
    def __init__(self, cfg: ArchConfig, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=False)
        self.rotary = rotary
        self.scale = self.head_dim ** -0.5
        # Qwen3: each query / key head is RMS-normalised (its own weight over head_dim) before RoPE
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None

    def forward(self, positions: torch.Tensor, x: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata, backend: AttentionBackend) -> torch.Tensor:
        num_tokens = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q = self.q_norm(q.reshape(-1, self.head_dim)).view(num_tokens, self.num_heads, self.head_dim)
            k = self.k_norm(k.reshape(-1, self.head_dim)).view(num_tokens, self.num_kv_heads, self.head_dim)
        q, k = self.rotary(positions, q, k)
        out = backend.forward(q, k, v, kv_cache, meta, self.scale)  # [T, H, D]
        return self.o_proj(out.reshape(num_tokens, self.q_size))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ArchConfig, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, rotary)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = SwiGLU(cfg.hidden_size, cfg.intermediate_size)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None,
                kv_cache: torch.Tensor, meta: AttentionMetadata, backend: AttentionBackend
                ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            x, residual = self.input_layernorm(x), x
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(positions, x, kv_cache, meta, backend)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ArchConfig, max_positions: int) -> None:
        super().__init__()
        self.cfg = cfg
        rotary = RotaryEmbedding(cfg.head_dim, max_positions, cfg.rope_theta, cfg.rope_scaling)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, rotary) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.backend: AttentionBackend | None = None  # set by the model runner
        # decoder layers whose output (the residual stream after them) the forward also returns, for an
        # EAGLE head that fuses several of the target's layers (set by the engine's builder)
        self.aux_layers: tuple[int, ...] = ()
        # with aux layers: fuse them with the final hidden states into one feature here, inside the
        # forward (and its CUDA graphs), instead of returning them: (final, [aux]) -> [T, hidden_size]
        self.aux_features: Callable[[torch.Tensor, list[torch.Tensor]], torch.Tensor] | None = None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                meta: AttentionMetadata, aux: bool = True) -> torch.Tensor:
        """input_ids, positions: [num_tokens] -> hidden states [num_tokens, hidden_size], or with
        `aux_layers` [num_tokens, (1 + len(aux_layers)) * hidden_size]: the final hidden states, then
        each aux layer's output in order, or with `aux_features` too [num_tokens, 2 * hidden_size]:
        the final hidden states, then their feature (compute_logits reads the first hidden_size columns).
        aux=False: the final hidden states alone, with or without aux layers (a step whose feature
        nobody will read)."""
        x, residual = self.embed_tokens(input_ids), None
        outputs = []
        for i, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches)):
            x, residual = layer(positions, x, residual, kv_cache, meta, self.backend)
            if aux and i in self.aux_layers:
                outputs.append(x + residual)
        x, _ = self.norm(x, residual)
        if self.aux_features is not None and outputs:
            return torch.cat([x, self.aux_features(x, outputs)], dim=-1)
        return torch.cat([x, *outputs], dim=-1) if outputs else x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [N, hidden_size] (or a forward's wider rows with aux layers) -> fp32 logits [N, vocab_size]."""
        hidden = hidden[:, :self.cfg.hidden_size]
        if self.lm_head is not None:  # a module: nn.Linear, or a quantized head (specserve.quant)
            return self.lm_head(hidden).float()
        return nn.functional.linear(hidden, self.embed_tokens.weight).float()

    # -- weights ---------------------------------------------------------------------------------
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load HF-named tensors (model.layers.N.self_attn.q_proj.weight, ...) into fused params."""
        load_stacked_weights(self, weights)
