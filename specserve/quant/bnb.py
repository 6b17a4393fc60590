"""bitsandbytes layers for our model: which combinations run, and the Linear -> bnb replacement.

Quantize-on-load: the loader builds and fills the model on the CPU, then `quantize_linears` turns
each projection (qkv_proj, o_proj, gate_up_proj, down_proj) into a bitsandbytes layer ON the target
device, one layer at a time, so the device never holds the full-precision copy of the model.

- int8 = LLM.int8() (`Linear8bitLt`, row-wise absmax scales `SCB`, outlier threshold 6.0 as in HF).
- nf4 = `Linear4bit(quant_type="nf4")`, blocksize 64, double-quantized absmax (4.13 bits/weight).
"""
from __future__ import annotations

import logging
import sys
from collections.abc import Iterator

import torch
from torch import nn

from specserve.quant.names import INT8, METHODS

logger = logging.getLogger(__name__)

LINEAR_NAMES = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
NF4_BLOCKSIZE = 64
INT8_THRESHOLD = 6.0  # LLM.int8() outlier threshold (HF's default)
# bitsandbytes' AVX512-BF16 CPU path repacks a 4-bit weight [N, K] on its first forward into tiles of
# 32 output rows, with one absmax per (row, K-block): it needs N % 32 == 0 and K % blocksize == 0, and
# fails on other shapes (bitsandbytes 0.50: "shape '[64, 1]' is invalid for input of size 96").
CPU_PACKED_BLOCK_N = 32


def require_bitsandbytes():
    """Import bitsandbytes or say how to get it."""
    try:
        import bitsandbytes
    except ImportError as e:
        raise ValueError(f"quantization needs bitsandbytes, which is not installed ({e}); "
                         "install it with `pip install 'specserve[quant]'` (bitsandbytes>=0.45)") from None
    return bitsandbytes


def check_supported(method: str, device: torch.device, dtype: torch.dtype) -> None:
    """Raise a one-line ValueError for a combination that does not run."""
    if method not in METHODS:
        raise ValueError(f"quantization {method!r} is not one of {', '.join(METHODS)}")
    require_bitsandbytes()
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"bitsandbytes quantization runs on cpu and cuda here, not {device.type}")
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"bitsandbytes quantization computes in fp32/bf16/fp16, not {dtype}")
    if method == INT8 and device.type == "cuda":
        cap = torch.cuda.get_device_capability(device)
        if cap < (7, 5):
            raise ValueError(f"bitsandbytes-int8 needs a CUDA GPU of compute capability 7.5 or newer "
                             f"(int8 tensor cores); this one is {cap[0]}.{cap[1]}: use bitsandbytes-nf4")


class _Int8CastFilter(logging.Filter):
    """LLM.int8() always quantizes activations through fp16; bitsandbytes logs that on every matmul
    whose input is bf16/fp32. We know, and the output keeps the input dtype: drop that one record."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("MatMul8bitLt: inputs will be cast from")


_FILTER = _Int8CastFilter()


def silence_int8_cast_warning() -> None:
    log = logging.getLogger("bitsandbytes.autograd._functions")
    if _FILTER not in log.filters:
        log.addFilter(_FILTER)


def is_quantized_module(module: nn.Module) -> bool:
    """Is `module` a bitsandbytes layer? Without importing bitsandbytes where nothing has: a model that
    holds its layers imported it, and importing it costs an unquantized engine's start-up a warning
    on AVX512-BF16 CPUs (bitsandbytes 0.50 looks for a CPU kernel on the model hub, and says so when
    it cannot reach it)."""
    bnb = sys.modules.get("bitsandbytes")
    return bnb is not None and isinstance(module, (bnb.nn.Linear8bitLt, bnb.nn.Linear4bit))


def dequantize_weight(module: nn.Module) -> torch.Tensor:
    """The float weight [out, in] of a plain or bitsandbytes Linear (for re-quantizing a copy)."""
    import bitsandbytes as bnb
    import bitsandbytes.functional as F

    if isinstance(module, bnb.nn.Linear4bit):
        w = module.weight
        qs = w.quant_state
        if getattr(qs, "packing_format_for_cpu", False):  # bnb repacked it for its AVX512 CPU kernel
            from bitsandbytes.nn.modules import _convert_weight_packed_for_cpu_inverse
            data, qs = _convert_weight_packed_for_cpu_inverse(w.data, qs)
            return F.dequantize_4bit(data, qs)
        return F.dequantize_4bit(w.data, qs)
    if isinstance(module, bnb.nn.Linear8bitLt):
        scb = module.weight.SCB if module.weight.SCB is not None else module.state.SCB
        return module.weight.data.float() * (scb.float().unsqueeze(1) / 127.0)
    return module.weight.data


def cpu_packed_layout_fits(out_features: int, in_features: int, blocksize: int = NF4_BLOCKSIZE) -> bool:
    """Whether bitsandbytes' packed AVX512-BF16 CPU layout can hold a 4-bit weight of this shape."""
    return out_features % CPU_PACKED_BLOCK_N == 0 and in_features % blocksize == 0


def quantize_linear(linear: nn.Module, method: str, device: torch.device, dtype: torch.dtype,
                    double_quant: bool = True) -> nn.Module:
    """A bitsandbytes copy of `linear` (plain or already quantized) on `device`; `linear` is untouched."""
    import bitsandbytes as bnb
    import bitsandbytes.functional as F

    out_features, in_features = linear.out_features, linear.in_features
    has_bias = linear.bias is not None
    w = dequantize_weight(linear).to(device=device)
    if method == INT8:
        # meta: skip allocating and initialising a float weight we would throw away
        q = bnb.nn.Linear8bitLt(in_features, out_features, bias=has_bias, has_fp16_weights=False,
                                threshold=INT8_THRESHOLD, device="meta")
        cb, scb, _ = F.int8_vectorwise_quant(w.to(torch.float16).contiguous())
        q.weight = bnb.nn.Int8Params(cb, requires_grad=False, has_fp16_weights=False, CB=cb, SCB=scb)
    else:
        q = bnb.nn.Linear4bit(in_features, out_features, bias=has_bias, compute_dtype=dtype,
                              compress_statistics=double_quant, quant_type="nf4", device="meta")
        packed, state = F.quantize_4bit(w.to(dtype).contiguous(), blocksize=NF4_BLOCKSIZE,
                                        compress_statistics=double_quant, quant_type="nf4")
        q.weight = bnb.nn.Params4bit(packed, requires_grad=False, quant_state=state, blocksize=NF4_BLOCKSIZE,
                                     compress_statistics=double_quant, quant_type="nf4", module=q,
                                     bnb_quantized=True)
        q.quant_state = state
        # the packed path where its layout holds the weight, bnb's plain 4-bit path elsewhere
        q.support_avx512bf16_for_cpu = (getattr(q, "support_avx512bf16_for_cpu", False)
                                        and cpu_packed_layout_fits(out_features, in_features))
    if has_bias:
        q.bias = nn.Parameter(linear.bias.data.to(device=device, dtype=dtype), requires_grad=False)
    return q.eval()


def target_linears(model: nn.Module) -> Iterator[tuple[nn.Module, str, nn.Module]]:
    """(parent, attribute name, linear) for every projection we quantize."""
    for parent in list(model.modules()):
        for name in LINEAR_NAMES:
            child = getattr(parent, name, None)
            if isinstance(child, nn.Linear) or (child is not None and is_quantized_module(child)):
                yield parent, name, child


def quantize_linears(model: nn.Module, method: str, device: torch.device, dtype: torch.dtype,
                     double_quant: bool = True) -> int:
    """Replace the projections by bitsandbytes layers on `device`; returns how many were replaced."""
    if method == INT8:
        silence_int8_cast_warning()
    slots = [(parent, name) for parent, name, _ in target_linears(model)]  # no references to the weights
    for parent, name in slots:
        # the float layer is dropped as soon as its replacement is set: one float layer at a time
        setattr(parent, name, quantize_linear(getattr(parent, name), method, device, dtype, double_quant))
    return len(slots)


def move_unquantized(model: nn.Module, device: torch.device) -> None:
    """Move every parameter and buffer not owned by a bitsandbytes layer to `device`."""
    for module in model.modules():
        if is_quantized_module(module):
            continue
        for name, p in list(module._parameters.items()):
            if p is not None and p.device != device:
                module._parameters[name] = nn.Parameter(p.data.to(device), requires_grad=False)
        for name, b in list(module._buffers.items()):
            if b is not None and b.device != device:
                module._buffers[name] = b.to(device)


def cuda_graph_safe(*models: nn.Module | None) -> bool:
    """False when a model holds LLM.int8() layers with an outlier threshold: they pick the outlier
    columns on the host at every matmul (`outliers.any()`), which CUDA graph capture cannot hold."""
    try:
        import bitsandbytes as bnb
    except ImportError:
        return True
    for model in models:
        if model is None:
            continue
        if any(isinstance(m, bnb.nn.Linear8bitLt) and m.state.threshold > 0 for m in model.modules()):
            logger.info("CUDA graphs off: bitsandbytes-int8 picks LLM.int8() outlier columns on the host")
            return False
    return True
