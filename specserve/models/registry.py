"""Model architectures we implement, and the shape/config record parsed from a HF config.json."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}


@dataclass
class ArchConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    torch_dtype: str | None
    qk_norm: bool = False  # RMSNorm over each query and key head before RoPE (Qwen3)
    eos_token_ids: list[int] = field(default_factory=list)
    bos_token_id: int | None = None
    raw: dict[str, Any] = field(default_factory=dict, repr=False)

    @property
    def num_params(self) -> int:
        h, i, v = self.hidden_size, self.intermediate_size, self.vocab_size
        qkv = h * (self.num_heads + 2 * self.num_kv_heads) * self.head_dim
        per_layer = qkv + self.num_heads * self.head_dim * h + 3 * h * i + 2 * h + 2 * self.head_dim * self.qk_norm
        return self.num_layers * per_layer + v * h * (1 if self.tie_word_embeddings else 2) + h

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes


def _as_list(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, (list, tuple)) else [int(value)]


def parse_arch_config(raw: dict[str, Any], source: str = "config.json") -> ArchConfig:
    archs = raw.get("architectures") or []
    arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
    if arch is None:
        model_type = raw.get("model_type")
        by_type = {v: k for k, v in SUPPORTED_ARCHITECTURES.items()}
        arch = by_type.get(model_type)
    if arch is None:
        raise ValueError(f"{source}: unsupported architecture {archs or raw.get('model_type')!r}; "
                         f"specserve runs {', '.join(sorted(SUPPORTED_ARCHITECTURES))}")
    try:
        num_heads = int(raw["num_attention_heads"])
        hidden = int(raw["hidden_size"])
        rope = raw.get("rope_parameters") or {}
        rope_theta = float(raw.get("rope_theta", rope.get("rope_theta", 10000.0)))
        rope_scaling = raw.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
        if rope_scaling is not None:
            kind = rope_scaling.get("rope_type", rope_scaling.get("type", "default"))
            if kind not in ("default", "linear", "llama3"):
                raise ValueError(f"{source}: rope scaling type {kind!r} is not supported "
                                 "(supported: default, linear, llama3)")
            if kind == "default":
                rope_scaling = None
        max_pos = int(raw.get("max_position_embeddings", 4096))
        sliding = raw.get("sliding_window") if raw.get("use_sliding_window", arch == "MistralForCausalLM") else None
        if sliding:
            max_pos = min(max_pos, int(sliding))  # we attend over the full context: stay inside the window
        return ArchConfig(
            architecture=arch,
            vocab_size=int(raw["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(raw["intermediate_size"]),
            num_layers=int(raw["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(raw.get("num_key_value_heads") or num_heads),
            head_dim=int(raw.get("head_dim") or hidden // num_heads),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=max_pos,
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            qkv_bias=bool(raw.get("attention_bias", arch == "Qwen2ForCausalLM")),
            torch_dtype=raw.get("torch_dtype") or raw.get("dtype"),
            qk_norm=arch == "Qwen3ForCausalLM",
            eos_token_ids=_as_list(raw.get("eos_token_id")),
            bos_token_id=raw.get("bos_token_id"),
            raw=raw,
        )
    except KeyError as e:
        raise ValueError(f"{source}: missing required field {e.args[0]!r}") from None


def load_arch_config(path: str | Path) -> ArchConfig:
    path = Path(path)
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        raise ValueError(f"model config not found: {path}") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from None
    return parse_arch_config(raw, str(path))
