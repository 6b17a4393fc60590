"""Triton kernels of specserve and their plain-PyTorch references (import name `specserve.kernels`)."""
from specserve.kernels.activation import ref_silu_and_mul, silu_and_mul
from specserve.kernels.attention_config import KernelConfig, select_configs
from specserve.kernels.paged_attention import paged_attention, ref_paged_attention, warm_up_paged_attention
from specserve.kernels.reshape_and_cache import ref_reshape_and_cache, reshape_and_cache
from specserve.kernels.rms_norm import ref_rms_norm, rms_norm
from specserve.kernels.rotary import ref_rotary_embedding, rotary_embedding

__all__ = [
    "KernelConfig",
    "paged_attention",
    "ref_paged_attention",
    "ref_reshape_and_cache",
    "ref_rms_norm",
    "ref_rotary_embedding",
    "ref_silu_and_mul",
    "reshape_and_cache",
    "rms_norm",
    "rotary_embedding",
    "select_configs",
    "silu_and_mul",
    "warm_up_paged_attention",
]
