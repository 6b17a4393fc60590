"""Load a model: HF directories (single or sharded safetensors), GGUF files, or dummy (random) weights.

Returns our LlamaForCausalLM on the target device plus its tokenizer (None for dummy shapes without
one) and the eos ids from generation_config.json / config.json / the tokenizer.
"""
from __future__ import annotations

import functools
import json
import logging
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from specserve.models.llama import LlamaForCausalLM
from specserve.models.registry import ArchConfig, load_arch_config, model_class, parse_arch_config

logger = logging.getLogger(__name__)

CONFIGS_DIR = Path(__file__).resolve().parent.parent / "configs" / "models"
if not CONFIGS_DIR.is_dir():  # running from a source checkout: configs/ is top-level
    CONFIGS_DIR = Path(__file__).resolve().parents[2] / "configs" / "models"

DTYPE_NAMES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class LoadedModel:
    model: LlamaForCausalLM
    arch: ArchConfig
    tokenizer: object | None
    eos_token_ids: list[int]
    path: str  # where it was loaded from (identity for the prefix-cache hash)
    dtype: torch.dtype
    quantization: str | None = None  # bitsandbytes method the weights are stored in


def resolve_dtype(dtype: str, arch: ArchConfig, device: torch.device | None = None) -> torch.dtype:
    """`auto`: the checkpoint's half type (bf16 unless it says fp16); fp32 on a CPU without native bf16
    math (no AVX512-BF16 / AMX), where bf16 matmuls are several times slower than fp32."""
    if dtype != "auto":
        return DTYPE_NAMES[dtype]
    if device is not None and device.type == "cpu" and not cpu_has_fast_bf16():
        return torch.float32
    return torch.float16 if arch.torch_dtype == "float16" else torch.bfloat16


@functools.cache
def cpu_has_fast_bf16() -> bool:
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def dummy_config_path(model: str) -> Path:
    """A dummy model names a config JSON file, a shipped shape (e.g. `llama-3.1-8b`), or a HF dir."""
    p = Path(model)
    if p.is_dir():
        p = p / "config.json"
    if p.is_file():
        return p
    shipped = CONFIGS_DIR / f"{model.lower()}.json"
    if shipped.is_file():
        return shipped
    names = sorted(f.stem for f in CONFIGS_DIR.glob("*.json"))
    raise ValueError(f"dummy model {model!r}: no such config file; shipped shapes: {', '.join(names)}")


def load_model(model: str, *, dtype: str = "auto", device: torch.device, load_format: str = "auto",
               max_positions: int | None = None, seed: int = 0, quantization: str | None = None,
               quantize_embeddings: bool = False, tensor_parallel: tuple[int, int] | None = None) -> LoadedModel:
    """`quantization` (bitsandbytes-int8 / -nf4): the model is built and filled on the CPU and each
    layer quantized onto `device` (specserve.quant); a pre-quantized checkpoint sets it itself.
    `tensor_parallel` (rank, size): build and fill only that rank's shard (specserve/distributed);
    `LoadedModel.arch` stays the whole model's, `model.cfg` is the shard's."""
    quant = {"quantization": quantization, "quantize_embeddings": quantize_embeddings}
    if load_format == "dummy":
        arch = load_arch_config(dummy_config_path(model))
        weights, tok_dir = None, Path(model) if Path(model).is_dir() else None
    else:
        path = Path(model)
        if tensor_parallel and path.exists() and (path.suffix == ".gguf" or not (path / "config.json").exists()):
            raise ValueError(f"{model}: tensor parallelism loads HF safetensors directories, not GGUF files")
        if path.is_file() and path.suffix == ".gguf":
            return _load_gguf(path, dtype=dtype, device=device, max_positions=max_positions, **quant)
        if not path.exists():
            path = Path(hub_snapshot(model))
        if not path.is_dir():
            raise ValueError(f"model {model} is neither a directory nor a .gguf file")
        ggufs = sorted(path.glob("*.gguf"))
        if not (path / "config.json").exists() and ggufs:
            return _load_gguf(ggufs[0], dtype=dtype, device=device, max_positions=max_positions, **quant)
        arch = load_arch_config(path / "config.json")
        weights, tok_dir = _safetensors_files(path), path
    prequantized = bool(arch.raw.get("quantization_config"))
    if prequantized or quantization:
        from specserve.quant.checkpoint import checkpoint_quantization
        quantization = quant["quantization"] = checkpoint_quantization(arch.raw, quantization, str(model))
        quant["double_quant"] = not prequantized  # fp32 block scales reproduce the stored nf4 exactly
    if tensor_parallel and quantization:
        raise ValueError(f"{model}: {quantization} weights are not sharded; use tensor_parallel_size 1")
    torch_dtype = resolve_dtype(dtype, arch, device)
    build_on = _build_device(device, torch_dtype, model, dummy=weights is None, **quant)
    if tensor_parallel:
        from specserve.distributed.sharding import shard_arch
        net = _build(shard_arch(arch, tensor_parallel[1]), torch_dtype, build_on, max_positions, seed)
    else:
        net = _build(arch, torch_dtype, build_on, max_positions, seed)
    if weights is None:
        _init_dummy(net, seed)
    else:
        tensors = _iter_safetensors(weights, device)
        if prequantized:
            from specserve.quant.checkpoint import dequantize_bnb_tensors
            tensors = dequantize_bnb_tensors(tensors)
        if tensor_parallel:
            from specserve.distributed.sharding import shard_weights
            tensors = shard_weights(tensors, arch, *tensor_parallel)
        net.load_weights(tensors)
    tokenizer = load_tokenizer(tok_dir) if tok_dir is not None else None
    eos = _eos_ids(arch, tok_dir, tokenizer)
    _quantize(net, device, **quant)
    return LoadedModel(net.eval(), arch, tokenizer, eos, str(model), torch_dtype, quantization)


def _build_device(device: torch.device, dtype: torch.dtype, model: str, *, quantization: str | None,
                  dummy: bool = False, **_) -> torch.device:
    """Where to build the float model: the CPU when it is quantized onto `device` afterwards, so the
    device never holds the float copy (dummy weights are drawn fast on the device, then quantized)."""
    if not quantization:
        return device
    from specserve.quant import check_supported
    from specserve.quant.checkpoint import warn_if_requantizing
    check_supported(quantization, device, dtype)  # fail before the slow part
    warn_if_requantizing(model, quantization)
    return device if dummy else torch.device("cpu")


def _quantize(net: LlamaForCausalLM, device: torch.device, *, quantization: str | None,
              quantize_embeddings: bool, double_quant: bool = True) -> None:
    if quantization:
        from specserve.quant import quantize_model
        quantize_model(net, quantization, device=device, quantize_embeddings=quantize_embeddings,
                       double_quant=double_quant)


def _build(arch: ArchConfig, dtype: torch.dtype, device: torch.device, max_positions: int | None,
           seed: int) -> LlamaForCausalLM:
    """Parameters are created directly on `device` in `dtype` (rope tables stay fp32)."""
    torch.manual_seed(seed)
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            return model_class(arch)(arch, max_positions or arch.max_position_embeddings)
    finally:
        torch.set_default_dtype(old)


def _init_dummy(net: LlamaForCausalLM, seed: int) -> None:
    """Random weights (std 0.02) drawn on the parameters' own device: an 8B model fills in seconds on a GPU."""
    with torch.no_grad():
        for name, p in net.named_parameters():
            if "norm" in name:
                continue
            if p.ndim == 1:
                p.zero_()
                continue
            gen = torch.Generator(device=p.device).manual_seed(seed + len(name))
            p.normal_(0.0, 0.02, generator=gen)


def _safetensors_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.exists():
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (json.JSONDecodeError, KeyError) as e:
            raise ValueError(f"{index} is corrupt: {e}") from None
        files = [path / n for n in names]
    else:
        files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no safetensors weights in {path}")
    missing = [f.name for f in files if not f.exists()]
    if missing:
        raise ValueError(f"{path}: missing weight shards {', '.join(missing)}")
    return files


def _iter_safetensors(files: list[Path], device: torch.device) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open
    from tqdm import tqdm

    bar = tqdm(total=len(files), desc="Loading weights", unit="shard", disable=not sys.stderr.isatty())
    for f in files:
        try:
            with safe_open(str(f), framework="pt", device="cpu") as sf:
                for name in sf.keys():
                    yield name, sf.get_tensor(name)
        except Exception as e:  # safetensors raises its own error type for corrupt files
            raise ValueError(f"cannot read weights {f}: {e}") from None
        bar.update(1)
    bar.close()


HUB_PATTERNS = ["*.json", "*.safetensors", "tokenizer.model", "*.txt", "*.jinja"]


def hub_snapshot(model: str, revision: str | None = None, cache_dir: str | None = None) -> str:
    """A model that is not a local path but looks like a hub id (`org/name`): its files from the
    Hugging Face hub (cache first). Offline or not found: a ValueError naming the id and what to do."""
    parts = model.split("/")
    if len(parts) != 2 or not all(parts) or model.startswith((".", "~")):
        raise ValueError(f"model not found: {model} (give a HF model directory, a .gguf file, or a hub id org/name)")
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError

    try:
        return snapshot_download(model, revision=revision, cache_dir=cache_dir, allow_patterns=HUB_PATTERNS)
    except HFValidationError as e:
        raise ValueError(f"model not found: {model} is not a local path nor a valid hub id ({e})") from None
    except Exception as e:  # offline, no network, unknown repo, gated: all end here
        offline = os.environ.get("HF_HUB_OFFLINE", "") not in ("", "0")
        hint = ("HF_HUB_OFFLINE is set, so only the local hub cache is looked at: download it once online, or "
                "give a local directory" if offline else "check the id and the network (or set HF_TOKEN for a "
                "gated model), or give a local directory")
        raise ValueError(f"model {model!r} is not a local path and could not be fetched from the Hugging "
                         f"Face hub: {type(e).__name__}: {e}. {hint}") from None


def load_tokenizer(path: Path | str | None, gguf_file: str | None = None):
    if path is None:
        return None
    path = Path(path)
    if gguf_file is None and not any((path / n).exists() for n in ("tokenizer.json", "tokenizer.model",
                                                                    "tokenizer_config.json")):
        return None
    from transformers import AutoTokenizer
    try:
        return AutoTokenizer.from_pretrained(str(path), gguf_file=gguf_file) if gguf_file else \
            AutoTokenizer.from_pretrained(str(path))
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot load the tokenizer in {path}: {e}") from None


def _eos_ids(arch: ArchConfig, path: Path | None, tokenizer) -> list[int]:
    ids: list[int] = []
    gen_cfg = path / "generation_config.json" if path is not None else None
    if gen_cfg is not None and gen_cfg.exists():
        try:
            value = json.loads(gen_cfg.read_text()).get("eos_token_id")
            ids += value if isinstance(value, list) else ([value] if value is not None else [])
        except json.JSONDecodeError:
            logger.warning("ignoring unreadable %s", gen_cfg)
    ids += arch.eos_token_ids
    if tokenizer is not None and getattr(tokenizer, "eos_token_id", None) is not None:
        ids.append(tokenizer.eos_token_id)
    return sorted(set(int(i) for i in ids))


def _load_gguf(file: Path, *, dtype: str, device: torch.device, max_positions: int | None,
               quantization: str | None, quantize_embeddings: bool) -> LoadedModel:
    """GGUF via transformers (dequantized to float), then into our model."""
    if quantization == "bitsandbytes":  # vLLM's name: no bitsandbytes config in a GGUF, so nf4
        quantization = "bitsandbytes-nf4"
    quant = {"quantization": quantization, "quantize_embeddings": quantize_embeddings}
    hf_model, tokenizer = load_gguf_as_hf(file)
    arch = parse_arch_config(hf_model.config.to_dict(), str(file))
    torch_dtype = resolve_dtype(dtype, arch, device)
    build_on = _build_device(device, torch_dtype, str(file), **quant)
    net = _build(arch, torch_dtype, build_on, max_positions, 0)
    net.load_weights(hf_model.state_dict().items())
    eos = sorted(set(arch.eos_token_ids + ([tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else [])))
    if arch.architecture == "Gemma3ForCausalLM":  # no generation_config in a GGUF: end turns as llama.cpp does
        from specserve.models.gemma3 import turn_end_ids
        eos = sorted(set(eos) | set(turn_end_ids(tokenizer)))
    _quantize(net, device, **quant)
    return LoadedModel(net.eval(), arch, tokenizer, eos, str(file), torch_dtype, quantization)


def load_gguf_as_hf(file: Path):
    try:
        from transformers import AutoModelForCausalLM, AutoTokenizer
        tokenizer = AutoTokenizer.from_pretrained(str(file.parent), gguf_file=file.name)
        model = AutoModelForCausalLM.from_pretrained(str(file.parent), gguf_file=file.name,
                                                     dtype=torch.float32)
    except (OSError, ValueError, KeyError) as e:
        raise ValueError(f"cannot load GGUF file {file}: {e}") from None
    return model, tokenizer
