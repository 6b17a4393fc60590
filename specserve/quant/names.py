"""Quantization method names and self-draft names, torch-free: configs validate them without
loading torch or bitsandbytes (specserve.config imports this module)."""
from __future__ import annotations

INT8 = "bitsandbytes-int8"
NF4 = "bitsandbytes-nf4"
METHODS = (INT8, NF4)
# vLLM's `--quantization bitsandbytes`: the method a pre-quantized checkpoint declares, else nf4
BNB = "bitsandbytes"
# --draft-model names for the target's own weights as the draft (quant/self_draft.py builds them)
SELF_DRAFT_NAMES = {"self": None, "self-int8": INT8, "self-nf4": NF4}


def is_self_draft(model: str | None) -> bool:
    return isinstance(model, str) and model.lower() in SELF_DRAFT_NAMES


def parse_self_draft(model: str, quantization: str | None) -> str | None:
    """The draft quantization of a self-draft name ('self-nf4' -> 'bitsandbytes-nf4'); `quantization`
    (--draft-quantization) may repeat it or complete a bare 'self', not contradict it."""
    if not is_self_draft(model):
        raise ValueError(f"{model!r} is not a self-draft; use one of {', '.join(SELF_DRAFT_NAMES)}")
    named = SELF_DRAFT_NAMES[model.lower()]
    if named is not None and quantization is not None and quantization != named:
        raise ValueError(f"--draft-model {model} already says {named}; drop --draft-quantization "
                         f"{quantization} or use --draft-model self --draft-quantization {quantization}")
    return named or quantization
