"""Self-drafts: the target's own weights, quantized, as the speculative draft (`--draft-model
self-nf4` / `self-int8`, or `self` = an unquantized copy, the top of the acceptance range).

No second checkpoint is read: `build_self_draft(target_module, method)` makes a structural copy of
the target that SHARES every tensor (embeddings, norms, lm_head, rotary tables) and replaces only the
projections by bitsandbytes layers quantized from the target's weights. So the draft adds just its
quantized projections to the weight memory (an nf4 draft of a bf16 model: ~26% of the projections'
bytes), and the draft's KV lives in its own cache tensor under the same block ids (the draft proposer
allocates it; the self-draft has the target's shape, so the same number of KV bytes per block).
"""
from __future__ import annotations

import copy
import logging

import torch
from torch import nn

# the names live torch-free in quant/names.py (configs check them); imported from here too
from specserve.quant.names import SELF_DRAFT_NAMES, is_self_draft, parse_self_draft  # noqa: F401

logger = logging.getLogger(__name__)


def build_self_draft(target: nn.Module | str, method: str | None, **load_kwargs) -> nn.Module:
    """The target quantized with `method` (None = unquantized), as a separate model object.

    `target` is the loaded target module (tensors shared, see the module docstring), or a model path
    (loaded again through specserve.models.loader with `load_kwargs`: device, dtype, load_format, ...).
    """
    if isinstance(target, (str, bytes)) or hasattr(target, "__fspath__"):
        from specserve.models.loader import load_model

        if "device" not in load_kwargs:
            raise ValueError("build_self_draft from a path needs device=")
        return load_model(str(target), quantization=method, **load_kwargs).model
    if not isinstance(target, nn.Module):
        raise TypeError(f"build_self_draft takes a model module or a path, not {type(target).__name__}")
    first = next(target.parameters())
    device, dtype = first.device, first.dtype
    if method is not None:
        from specserve.quant import check_supported
        check_supported(method, device, dtype)
    draft = share_copy(target)
    if method is not None:
        from specserve.quant.bnb import quantize_linears
        num = quantize_linears(draft, method, device, dtype)
        if device.type == "cuda":
            torch.cuda.empty_cache()
        logger.info("self-draft: %d projections of the target quantized with %s, the rest shared",
                    num, method)
    return draft.eval()


def share_copy(model: nn.Module) -> nn.Module:
    """A copy of the module tree whose parameters, buffers and attention backend are the original's."""
    memo: dict[int, object] = {id(t): t for t in model.parameters()}
    memo.update({id(b): b for b in model.buffers()})
    backend = getattr(model, "backend", None)
    if backend is not None:
        memo[id(backend)] = backend
    for module in model.modules():  # bitsandbytes keeps quantized state outside parameters
        for name in ("state", "quant_state"):
            value = module.__dict__.get(name)
            if value is not None:
                memo[id(value)] = value
    return copy.deepcopy(model, memo)


def estimated_draft_cost(target: nn.Module, draft: nn.Module) -> float:
    """Cost of one draft step in target steps when decode is bound by reading weights (a GPU at
    small batch): the bytes the draft reads over the bytes the target reads. The speculative
    planner's default (parameter count ratio) says 1.0 for a self-draft, which would switch
    speculation off. On the CPU bitsandbytes kernels are slower than plain matmuls: there the
    real cost is above 1 (docs/quantization.md)."""
    from specserve.quant.memory import weight_bytes

    return weight_bytes(draft) / max(1, weight_bytes(target))
