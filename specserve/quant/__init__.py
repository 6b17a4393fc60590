"""Quantized weights (bitsandbytes int8 / nf4): quantize-on-load, pre-quantized checkpoints,
quantized self-drafts, and weight memory accounting. See docs/quantization.md.

bitsandbytes is imported only when a model is quantized (it is an optional dependency). torch is
imported when a torch-using name is first used (PEP 562): `specserve.quant.names` stays torch-free.
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from specserve.quant.names import INT8, METHODS, NF4
from specserve.utils import lazy_attributes

if TYPE_CHECKING:
    import torch
    from torch import nn

    from specserve.quant.bnb import check_supported
    from specserve.quant.memory import WeightMemory, dequant_workspace_bytes, weight_bytes, weight_memory

logger = logging.getLogger(__name__)

__all__ = ["INT8", "METHODS", "NF4", "WeightMemory", "check_supported", "dequant_workspace_bytes",
           "quantize_model", "weight_bytes", "weight_memory"]

__getattr__ = lazy_attributes(__name__, {
    "check_supported": "specserve.quant.bnb",
    "WeightMemory": "specserve.quant.memory",
    "dequant_workspace_bytes": "specserve.quant.memory",
    "weight_bytes": "specserve.quant.memory",
    "weight_memory": "specserve.quant.memory",
})


def quantize_model(model: nn.Module, method: str, *, device: torch.device | None = None,
                   quantize_embeddings: bool = False, double_quant: bool = True) -> nn.Module:
    """Quantize `model`'s projections in place with `method` and put the whole model on `device`.

    The model may sit on the CPU (the loader's quantize-on-load path: each layer is quantized as it
    moves, so `device` never holds the float copy) or already on `device`. Embeddings and lm_head
    stay in the model dtype unless `quantize_embeddings`. `double_quant=False` keeps nf4 block
    scales in fp32 (what re-quantizing a pre-quantized checkpoint needs to reproduce it exactly).
    Returns the model, in eval mode.
    """
    import torch

    from specserve.quant.bnb import check_supported, move_unquantized, quantize_linears

    first = next(model.parameters())
    device = torch.device(device) if device is not None else first.device
    dtype = first.dtype
    check_supported(method, device, dtype)
    num = quantize_linears(model, method, device, dtype, double_quant=double_quant)
    if quantize_embeddings:
        from specserve.quant.vocab import quantize_vocab
        quantize_vocab(model, method, device, dtype)
    move_unquantized(model, device)
    if device.type == "cuda":
        torch.cuda.empty_cache()  # hand the freed float weights back, so the KV cache can take them
    logger.info("quantized %d linear layers%s with %s", num,
                " and the embeddings / lm_head" if quantize_embeddings else "", method)
    return model.eval()
