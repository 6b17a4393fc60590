"""How many bytes a model's weights really take, quantized storage included.

`parameters()` alone undercounts a bitsandbytes model: LLM.int8() keeps its row scales (`SCB`) and
nf4 its block absmax (plus the nested absmax / code books of double quantization) outside the
parameter. We count every tensor that holds weights — parameters, persistent buffers and bnb
quantization state — once per storage (tied weights count once), and skip non-persistent buffers
(the rotary cos/sin tables are derived, not weights).
"""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

from specserve.quant.bnb import is_quantized_module


@dataclass(slots=True)
class WeightMemory:
    total: int  # bytes of all weights
    quantized: int  # bytes held by quantized layers (data + scales)
    num_quantized_layers: int

    @property
    def unquantized(self) -> int:
        return self.total - self.quantized


def _quant_state_tensors(state) -> Iterator[torch.Tensor]:
    """absmax / code / nested absmax / nested code of a bnb QuantState."""
    if state is None:
        return
    for name in ("absmax", "code", "offset"):
        t = getattr(state, name, None)
        if isinstance(t, torch.Tensor):
            yield t
    yield from _quant_state_tensors(getattr(state, "state2", None))


def _module_tensors(module: nn.Module) -> Iterator[torch.Tensor]:
    """The weight tensors a module owns directly (not its children's)."""
    yield from (p for p in module._parameters.values() if p is not None)
    persistent = [n for n in module._buffers if n not in module._non_persistent_buffers_set]
    yield from (module._buffers[n] for n in persistent if module._buffers[n] is not None)
    weight = module._parameters.get("weight")
    if weight is not None:
        for name in ("SCB", "CB"):  # Int8Params before the first forward
            t = getattr(weight, name, None)
            if isinstance(t, torch.Tensor):
                yield t
        yield from _quant_state_tensors(getattr(weight, "quant_state", None))
    state = getattr(module, "state", None)  # Linear8bitLt after the first forward
    for name in ("CB", "SCB"):
        t = getattr(state, name, None)
        if isinstance(t, torch.Tensor):
            yield t
    yield from _quant_state_tensors(getattr(module, "quant_state", None))
    qstate = getattr(module, "__dict__", {}).get("state")  # QuantizedVocab's nf4 code book
    if qstate is not None and not isinstance(qstate, torch.Tensor) and hasattr(qstate, "code"):
        yield qstate.code


def _is_quantized(module: nn.Module) -> bool:
    from specserve.quant.vocab import QuantizedVocab

    return isinstance(module, QuantizedVocab) or is_quantized_module(module)


def weight_memory(*models: nn.Module | None) -> WeightMemory:
    """Weights of one model, or of several counted together (a target and its self-draft share
    tensors: each storage counts once)."""
    seen: set[int] = set()
    seen_modules: set[int] = set()
    total = quantized = num_quantized = 0
    modules = (m for model in models if model is not None for m in model.modules())
    for module in modules:
        if id(module) in seen_modules:
            continue
        seen_modules.add(id(module))
        is_q = _is_quantized(module)
        num_quantized += is_q
        for t in _module_tensors(module):
            if t.device.type == "meta":
                continue
            storage = t.untyped_storage()
            key = storage.data_ptr()
            if key in seen:
                continue
            seen.add(key)
            total += storage.nbytes()
            if is_q:
                quantized += storage.nbytes()
    return WeightMemory(total, quantized, num_quantized)


def format_bytes(num: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if num >= size:
            return f"{num / size:.2f} {unit}"
    return f"{num} B"


def weight_bytes(model: nn.Module) -> int:
    """Bytes of all weights of `model`, bitsandbytes storage and scales included."""
    return weight_memory(model).total


def dequant_workspace_bytes(model: nn.Module, dtype: torch.dtype) -> int:
    """Transient memory bitsandbytes may need on the GPU for one multi-token matmul: it dequantizes
    a 4-bit weight to `dtype` before multiplying, so reserve room for the largest one."""
    from specserve.quant.vocab import QuantizedVocab

    itemsize = torch.tensor([], dtype=dtype).element_size()
    largest = 0
    for module in model.modules():
        if isinstance(module, QuantizedVocab):
            largest = max(largest, module.num_embeddings * module.embedding_dim)
        elif _is_quantized(module) and hasattr(module, "in_features"):
            largest = max(largest, module.in_features * module.out_features)
    return largest * itemsize
