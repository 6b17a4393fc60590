"""Default sampling parameters from a model's generation_config.json (vLLM's `--generation-config`).

`auto` (the default, as vLLM's): the model folder's file; `vllm`: none (SamplingParams' neutral
defaults); a folder: that folder's file. The values a model's authors recommend (temperature, top_p,
top_k, min_p, repetition_penalty, and max_new_tokens as max_tokens) become the defaults of requests
that leave those fields out; a field a request sets wins. Other keys (do_sample, eos ids, ...) are not
sampling defaults; eos ids are read by the loader.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path

logger = logging.getLogger(__name__)

FILE = "generation_config.json"
# generation_config.json key -> SamplingParams field
KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
        "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


def check_generation_config(value: str) -> None:
    """`auto`, `vllm`, or a folder holding generation_config.json (ValueError otherwise)."""
    if value in ("auto", "vllm"):
        return
    if not (Path(value) / FILE).is_file():
        raise ValueError(f"generation_config {value!r} is neither auto, vllm, nor a folder holding {FILE}")


def sampling_defaults(generation_config: str, model_path: str | None) -> dict:
    """SamplingParams fields -> the model's default values (empty for `vllm` or without a file)."""
    if generation_config == "vllm":
        return {}
    if generation_config == "auto":
        path = Path(model_path) if model_path else None
        folder = path.parent if path is not None and path.is_file() else path  # a .gguf: its folder
    else:
        folder = Path(generation_config)
    file = folder / FILE if folder is not None else None
    if file is None or not file.is_file():
        return {}
    try:
        data = json.loads(file.read_text())
    except (OSError, ValueError) as e:
        logger.warning("ignoring unreadable %s: %s", file, e)
        return {}
    defaults = {ours: data[key] for key, ours in KEYS.items() if data.get(key) is not None}
    from specserve.sampling_params import SamplingParams
    try:
        SamplingParams(**defaults)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{file}: its sampling defaults are not valid ({e}); pass --generation-config vllm "
                         "to ignore them") from None
    if defaults:
        logger.info("default sampling parameters from %s: %s (--generation-config vllm ignores them)",
                    file, defaults)
    return defaults
