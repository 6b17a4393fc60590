"""What a checkpoint says about quantization: pre-quantized bitsandbytes checkpoints (HF
`quantization_config` in config.json) and checkpoints that were quantized before we got them
(GGUF Q4/Q5/Q8, e.g. the default model, converted from Q4_1).

Pre-quantized bitsandbytes checkpoints (saved by transformers with `load_in_8bit` / `load_in_4bit`
nf4) load as follows: each quantized tensor is dequantized as it streams in (to the fused qkv /
gate_up layout our model uses), then quantized again with the same method. For int8 (row-wise
absmax) and nf4 (block absmax; the block's largest weight maps to ±1 exactly, and the block scales
are kept in fp32 rather than double-quantized again) this round trip reproduces the stored codes
and scales: in fp32 the served weights equal the checkpoint's dequantized weights (tested).
"""
from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch

from specserve.quant.names import BNB, INT8, NF4

logger = logging.getLogger(__name__)

# Written next to a converted checkpoint to record where its weights came from, e.g.
# {"source_format": "gguf", "source_file": "SmolLM2-135M-Instruct.Q4_1.gguf", "source_quantization": "Q4_1"}
PROVENANCE_FILE = "specserve_provenance.json"
_FLOAT_GGUF_TYPES = {"F32", "F16", "BF16", "F64"}
_4BIT_STATS = ("absmax", "quant_map", "nested_absmax", "nested_quant_map")


def checkpoint_quantization(raw_config: dict[str, Any], requested: str | None, source: str) -> str | None:
    """The method a checkpoint must be served with: `requested`, or the one its config.json's
    `quantization_config` declares (`requested` "bitsandbytes", vLLM's name: that one, or nf4 for a
    float checkpoint). Raises for checkpoints we cannot serve faithfully."""
    qc = raw_config.get("quantization_config")
    if requested == BNB:
        if not qc:
            return NF4
        requested = None
    if not qc:
        return requested
    kind = qc.get("quant_method", "unknown")
    if kind != "bitsandbytes":
        raise ValueError(f"{source}: the checkpoint is quantized with {kind!r}; specserve loads "
                         "bitsandbytes (int8 / nf4) pre-quantized checkpoints or float ones")
    if qc.get("load_in_8bit") or qc.get("_load_in_8bit"):
        stored = INT8
    elif qc.get("load_in_4bit") or qc.get("_load_in_4bit"):
        qtype = qc.get("bnb_4bit_quant_type", "fp4")
        if qtype != "nf4":
            raise ValueError(f"{source}: the checkpoint is bitsandbytes 4-bit {qtype}; specserve serves nf4 "
                             "(re-quantize from the float checkpoint with --quantization bitsandbytes-nf4)")
        stored = NF4
    else:
        raise ValueError(f"{source}: quantization_config names bitsandbytes but neither 8-bit nor 4-bit")
    if requested is not None and requested != stored:
        raise ValueError(f"{source}: the checkpoint is pre-quantized with {stored}; run it with "
                         f"--quantization {stored} (or leave --quantization out), not {requested}")
    if requested is None:
        logger.info("%s is a pre-quantized %s checkpoint: serving it as %s", source, stored, stored)
    return stored


def dequantize_bnb_tensors(weights: Iterable[tuple[str, torch.Tensor]]
                           ) -> Iterator[tuple[str, torch.Tensor]]:
    """Stream HF-named tensors, turning each bitsandbytes-quantized weight (int8 + `SCB`, or nf4
    packed + absmax/quant_map/quant_state) back into a float32 tensor of its original shape."""
    import bitsandbytes.functional as F
    from bitsandbytes.utils import unpack_tensor_to_dict

    pending: dict[str, dict[str, torch.Tensor]] = {}  # module prefix -> {suffix: tensor}
    for name, tensor in weights:
        prefix, suffix = _split_quant_name(name, tensor)
        if prefix is None:
            yield name, tensor
            continue
        if suffix == "weight_format":
            if int(tensor.item()) != 0:
                raise ValueError(f"{name}: only row-major int8 weights are supported")
            continue
        parts = pending.setdefault(prefix, {})
        parts[suffix] = tensor
        w = parts.get("weight")
        if w is None:
            continue
        if w.dtype == torch.int8 and "SCB" in parts:
            del pending[prefix]
            yield f"{prefix}.weight", w.float() * (parts["SCB"].float().unsqueeze(1) / 127.0)
            continue
        blob = next((k for k in parts if k.startswith("weight.quant_state.bitsandbytes__")), None)
        if w.dtype == torch.uint8 and blob is not None:
            meta = unpack_tensor_to_dict(parts[blob])
            need = ["weight.absmax", "weight.quant_map"]
            if "nested_blocksize" in meta:
                need += ["weight.nested_absmax", "weight.nested_quant_map"]
            if all(k in parts for k in need):
                del pending[prefix]
                state = F.QuantState.from_dict({k.removeprefix("weight."): v for k, v in parts.items()
                                                if k != "weight"}, device=w.device)
                yield f"{prefix}.weight", F.dequantize_4bit(w, state).float()
    if pending:
        prefix, parts = next(iter(pending.items()))
        have = ", ".join(sorted(parts))
        raise ValueError(f"checkpoint tensor {prefix}.weight is incomplete: it has {have} "
                         "but not all of its bitsandbytes quantization statistics")


def _split_quant_name(name: str, tensor: torch.Tensor) -> tuple[str | None, str]:
    """('model.layers.0.mlp.up_proj', 'weight.absmax') for a bnb tensor, (None, '') otherwise."""
    if name.endswith((".SCB", ".weight_format")):
        prefix, _, suffix = name.rpartition(".")
        return prefix, suffix
    if ".weight." in name:
        prefix, _, rest = name.partition(".weight.")
        if rest in _4BIT_STATS or rest.startswith("quant_state."):
            return prefix, f"weight.{rest}"
    if name.endswith(".weight") and tensor.dtype in (torch.int8, torch.uint8):
        return name.removesuffix(".weight"), "weight"
    return None, ""


# -- provenance ------------------------------------------------------------------------------------
def source_quantization(model_path: str | Path) -> str | None:
    """The quantization a checkpoint's weights went through before we load them ('Q4_1', ...),
    or None for float checkpoints. Read from a GGUF file's tensor types, or for a converted
    directory from its provenance marker (the default model's directory counts as Q4_1)."""
    path = Path(model_path)
    if path.is_file() and path.suffix == ".gguf":
        return _gguf_quantization(path)
    if not path.is_dir():
        return None
    marker = path / PROVENANCE_FILE
    if marker.exists():
        try:
            return json.loads(marker.read_text()).get("source_quantization") or None
        except (json.JSONDecodeError, AttributeError):
            logger.warning("ignoring unreadable %s", marker)
    from specserve.models.default_paths import GGUF_NAME, default_model_dir

    try:
        if path.resolve() == default_model_dir().resolve():
            return GGUF_NAME.rsplit(".", 2)[-2]  # "SmolLM2-135M-Instruct.Q4_1.gguf" -> "Q4_1"
    except OSError:
        pass
    ggufs = sorted(path.glob("*.gguf"))
    if ggufs and not (path / "config.json").exists():
        return _gguf_quantization(ggufs[0])
    return None


def _gguf_quantization(file: Path) -> str | None:
    try:
        from gguf import GGUFReader
        reader = GGUFReader(str(file))
    except Exception as e:  # noqa: BLE001 -- unreadable here: the loader will say why; do not guess
        logger.debug("cannot read %s for its quantization type: %s", file, e)
        return None
    types = {t.tensor_type.name for t in reader.tensors if len(t.shape) >= 2}
    quantized = sorted(types - _FLOAT_GGUF_TYPES)
    return "/".join(quantized) or None


def warn_if_requantizing(model_path: str | Path, method: str | None) -> None:
    """nf4 on weights that already went through a 4-5 bit format stacks two rounding grids."""
    if method is None:
        return
    source = source_quantization(model_path)
    if source is None:
        return
    if method == NF4:
        logger.warning("%s was already quantized (%s) before conversion: bitsandbytes-nf4 on top of it "
                       "gives poor quality (see docs/quantization.md); prefer bitsandbytes-int8 for it, "
                       "or nf4 on a bf16/fp16 checkpoint", model_path, source)
    else:
        logger.info("%s was converted from %s; %s keeps it close to that", model_path, source, method)
