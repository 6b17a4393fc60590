"""Quantized token embeddings and lm_head (opt-in: `quantize_embeddings=True`).

One `QuantizedVocab` holds a [vocab_size, hidden_size] matrix in int8 (row-wise absmax) or nf4
(blocks of 64 along a row, fp32 absmax: no double quantization, so a row's scales can be gathered
directly). It serves both uses of the matrix: `lookup(ids)` dequantizes only the gathered rows
(the embedding) and `logits(hidden)` multiplies through bitsandbytes (the lm_head). A model with
tied embeddings keeps ONE quantized copy for both, as it keeps one float copy when unquantized.
"""
from __future__ import annotations

import torch
from torch import nn

from specserve.quant.bnb import NF4_BLOCKSIZE
from specserve.quant.names import INT8


class QuantizedVocab(nn.Module):
    def __init__(self, weight: torch.Tensor, method: str, dtype: torch.dtype) -> None:
        """weight: [vocab_size, hidden_size] float, already on the target device."""
        super().__init__()
        import bitsandbytes.functional as F

        self.method, self.dtype = method, dtype
        self.num_embeddings, self.embedding_dim = weight.shape
        if method == INT8:
            cb, scb, _ = F.int8_vectorwise_quant(weight.to(torch.float16).contiguous())
            self.register_buffer("qweight", cb)  # [V, H] int8
            self.register_buffer("scale", scb.float())  # [V] fp32 row absmax
            self.state = None
        else:
            if self.embedding_dim % NF4_BLOCKSIZE:
                raise ValueError(f"nf4 embeddings need hidden_size divisible by {NF4_BLOCKSIZE} "
                                 f"(got {self.embedding_dim}); quantize the embeddings with "
                                 "bitsandbytes-int8 or leave them unquantized")
            packed, state = F.quantize_4bit(weight.to(dtype).contiguous(), blocksize=NF4_BLOCKSIZE,
                                            compress_statistics=False, quant_type="nf4")
            self.register_buffer("qweight", packed.view(self.num_embeddings, self.embedding_dim // 2))
            self.register_buffer("scale", state.absmax.view(self.num_embeddings, -1))  # [V, H/64] fp32
            self.state = state

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        """ids: [T] -> [T, hidden_size] in the model dtype."""
        if self.method == INT8:
            return (self.qweight[ids].float() * (self.scale[ids, None] / 127.0)).to(self.dtype)
        import bitsandbytes.functional as F
        from bitsandbytes.functional import QuantState

        shape = torch.Size((ids.numel(), self.embedding_dim))
        rows = QuantState(absmax=self.scale[ids].reshape(-1), shape=shape, code=self.state.code,
                          blocksize=NF4_BLOCKSIZE, quant_type="nf4", dtype=self.dtype)
        return F.dequantize_4bit(self.qweight[ids].reshape(-1, 1), rows)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [N, hidden_size] -> [N, vocab_size] in the model dtype."""
        import bitsandbytes as bnb

        if self.method == INT8:
            # bnb's int8 matmul keeps the matrix int8 (no float copy of the whole vocabulary)
            state = bnb.MatmulLtState()
            state.CB, state.SCB = self.qweight, self.scale
            state.has_fp16_weights, state.is_training = False, False
            return bnb.matmul(hidden, self.qweight, state=state)
        self.state.absmax = self.scale.reshape(-1)  # same storage; follows .to(device)
        return bnb.matmul_4bit(hidden.to(self.dtype), self.qweight.reshape(-1, 1), quant_state=self.state)


class QuantizedEmbedding(nn.Module):
    def __init__(self, vocab: QuantizedVocab) -> None:
        super().__init__()
        self.vocab = vocab

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.vocab.lookup(ids)


class QuantizedLMHead(nn.Module):
    """Callable like the nn.Linear lm_head it replaces (the model calls `lm_head(hidden)`)."""

    def __init__(self, vocab: QuantizedVocab) -> None:
        super().__init__()
        self.vocab = vocab

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.vocab.logits(hidden)


def quantize_vocab(model: nn.Module, method: str, device: torch.device, dtype: torch.dtype) -> None:
    """Replace embed_tokens (and lm_head, or create a tied one) by quantized modules on `device`."""
    from specserve.quant.bnb import silence_int8_cast_warning

    if method == INT8:
        silence_int8_cast_warning()
    embed = QuantizedVocab(model.embed_tokens.weight.data.to(device), method, dtype)
    model.embed_tokens = QuantizedEmbedding(embed)
    if model.lm_head is None:  # tied: the head reads the same quantized rows
        model.lm_head = QuantizedLMHead(embed)
    else:
        head = QuantizedVocab(model.lm_head.weight.data.to(device), method, dtype)
        model.lm_head = QuantizedLMHead(head)
