"""Triton kernels of specserve and their plain-PyTorch references (import name `specserve.kernels`)."""
from specserve.kernels.attention_config import KernelConfig, select_configs
from specserve.kernels.paged_attention import paged_attention, ref_paged_attention
from specserve.kernels.reshape_and_cache import ref_reshape_and_cache, reshape_and_cache

__all__ = [
    "KernelConfig",
    "paged_attention",
    "ref_paged_attention",
    "ref_reshape_and_cache",
    "reshape_and_cache",
    "select_configs",
]
