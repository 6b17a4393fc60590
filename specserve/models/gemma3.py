"""Gemma 3 text models (Gemma3ForCausalLM: 270M, 1B; the text part of GGUF gemma3 files) over a flat
ragged token batch, the same interface as our Llama-family model.

What differs from Llama: embeddings scaled by sqrt(hidden_size) (rounded to the model dtype, as in
transformers); Gemma RMSNorm `x * (1 + w)` (weights stored as w, computed in fp32 then rounded); per-head
q/k norms; a norm after attention and another around the MLP (pre and post); a GELU-tanh gated MLP;
attention scaled by `query_pre_attn_scalar ** -0.5`; local layers that attend over a sliding window with
their own RoPE base (`rope_local_base_freq`, never scaled) interleaved with global layers (`rope_theta`
and the config's rope scaling); tied embeddings; optional final logit softcapping.
"""
from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from specserve.models.layers.attention import AttentionBackend, AttentionMetadata
from specserve.models.layers.basic import RotaryEmbedding
from specserve.models.registry import ArchConfig
from specserve.models.weights import load_stacked_weights


class GemmaRMSNorm(nn.Module):
    """RMSNorm with a zero-centred weight: `norm(x) * (1 + w)`, in fp32, rounded to x's dtype once."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """With `residual`: returns (norm(x + residual), x + residual)."""
        if residual is not None:
            x = x + residual
            residual = x
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        h = (h * (1.0 + self.weight.float())).to(x.dtype)
        return h if residual is None else (h, residual)


class GeluGLU(nn.Module):
    """down(gelu_tanh(gate(x)) * up(x)) with one fused gate/up projection (the SwiGLU layout)."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.intermediate_size = intermediate_size
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        return self.down_proj(nn.functional.gelu(gate, approximate="tanh") * up)


class Gemma3Attention(nn.Module):
    def __init__(self, cfg: ArchConfig, rotary: RotaryEmbedding, sliding_window: int | None) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=False)
        self.q_norm = GemmaRMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.rotary = rotary
        self.scale = (cfg.query_pre_attn_scalar or self.head_dim) ** -0.5
        self.sliding_window = sliding_window  # a constant of the layer: CUDA graphs capture it

    def forward(self, positions: torch.Tensor, x: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata, backend: AttentionBackend) -> torch.Tensor:
        num_tokens = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = self.q_norm(q.reshape(-1, self.head_dim)).view(num_tokens, self.num_heads, self.head_dim)
        k = self.k_norm(k.reshape(-1, self.head_dim)).view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        q, k = self.rotary(positions, q, k)
        out = backend.forward(q, k, v, kv_cache, meta, self.scale, sliding_window=self.sliding_window)  # [T, H, D]
        return self.o_proj(out.reshape(num_tokens, self.q_size))


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, cfg: ArchConfig, rotary: RotaryEmbedding, sliding_window: int | None) -> None:
        super().__init__()
        eps = cfg.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(cfg.hidden_size, eps)
        self.self_attn = Gemma3Attention(cfg, rotary, sliding_window)
        self.post_attention_layernorm = GemmaRMSNorm(cfg.hidden_size, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(cfg.hidden_size, eps)
        self.mlp = GeluGLU(cfg.hidden_size, cfg.intermediate_size)
        self.post_feedforward_layernorm = GemmaRMSNorm(cfg.hidden_size, eps)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None,
                kv_cache: torch.Tensor, meta: AttentionMetadata, backend: AttentionBackend
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (this layer's post-MLP output, the residual stream before it is added): the next
        layer's input norm (or the final norm) adds the two."""
        if residual is None:
            x, residual = self.input_layernorm(x), x
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.post_attention_layernorm(self.self_attn(positions, x, kv_cache, meta, backend))
        x, residual = self.pre_feedforward_layernorm(x, residual)
        return self.post_feedforward_layernorm(self.mlp(x)), residual


class Gemma3ForCausalLM(nn.Module):
    def __init__(self, cfg: ArchConfig, max_positions: int) -> None:
        super().__init__()
        self.cfg = cfg
        windows = cfg.layer_windows or [None] * cfg.num_layers
        global_rotary = RotaryEmbedding(cfg.head_dim, max_positions, cfg.rope_theta, cfg.rope_scaling)
        local_rotary = RotaryEmbedding(cfg.head_dim, max_positions, cfg.local_rope_theta or cfg.rope_theta, None) \
            if any(w is not None for w in windows) else None
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        # sqrt(hidden) in fp32, rounded to the activations' dtype where it is used (as transformers does)
        self.register_buffer("embed_scale", torch.tensor(cfg.hidden_size ** 0.5, dtype=torch.float32),
                             persistent=False)
        self.layers = nn.ModuleList(
            Gemma3DecoderLayer(cfg, global_rotary if w is None else local_rotary, w) for w in windows)
        self.norm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.backend: AttentionBackend | None = None  # set by the model runner

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                meta: AttentionMetadata) -> torch.Tensor:
        """input_ids, positions: [num_tokens] -> hidden states [num_tokens, hidden_size]."""
        x = self.embed_tokens(input_ids)
        x, residual = x * self.embed_scale.to(x.dtype), None
        for layer, kv_cache in zip(self.layers, kv_caches):
            x, residual = layer(positions, x, residual, kv_cache, meta, self.backend)
        x, _ = self.norm(x, residual)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [N, hidden_size] -> fp32 logits [N, vocab_size], softcapped where the config says."""
        if self.lm_head is not None:  # a module: nn.Linear, or a quantized head (specserve.quant)
            logits = self.lm_head(hidden).float()
        else:
            logits = nn.functional.linear(hidden, self.embed_tokens.weight).float()
        cap = self.cfg.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap

    # -- weights ---------------------------------------------------------------------------------
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """HF-named tensors (the norms as transformers stores them: w of `1 + w`) into the fused params."""
        load_stacked_weights(self, weights)


def turn_end_ids(tokenizer) -> list[int]:
    """`<end_of_turn>`, which closes every turn of Gemma's chat format: HF's generation_config of the
    instruct models and llama.cpp stop there besides `<eos>` (a GGUF file records only the latter)."""
    token_id = tokenizer.convert_tokens_to_ids("<end_of_turn>")
    return [] if token_id is None or token_id == tokenizer.unk_token_id else [int(token_id)]
