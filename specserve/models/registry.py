"""Model architectures we implement, and the shape/config record parsed from a HF config.json."""
from __future__ import annotations

import importlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Gemma3ForCausalLM": "gemma3_text",
}
# architectures whose model is not our Llama-family one: name -> "module:class" (imported on use)
MODEL_CLASSES = {
    "Gemma3ForCausalLM": "specserve.models.gemma3:Gemma3ForCausalLM",
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
    qk_norm: bool = False  # RMSNorm over each query and key head before RoPE (Qwen3, Gemma 3)
    # Gemma 3: interleaved local (sliding-window) and global layers, each kind with its own RoPE
    layer_windows: list[int | None] = field(default_factory=list)  # per layer, None = full; [] = all full
    local_rope_theta: float | None = None  # RoPE base of the sliding-window layers (never scaled)
    query_pre_attn_scalar: float | None = None  # attention scale = this ** -0.5 (None: head_dim)
    final_logit_softcapping: float | None = None  # logits = cap * tanh(logits / cap)
    eos_token_ids: list[int] = field(default_factory=list)
    bos_token_id: int | None = None
    raw: dict[str, Any] = field(default_factory=dict, repr=False)

    @property
    def num_params(self) -> int:
        h, i, v = self.hidden_size, self.intermediate_size, self.vocab_size
        qkv = h * (self.num_heads + 2 * self.num_kv_heads) * self.head_dim
        norms = 4 * h if self.architecture == "Gemma3ForCausalLM" else 2 * h  # Gemma: pre and post norms
        per_layer = qkv + self.num_heads * self.head_dim * h + 3 * h * i + norms + 2 * self.head_dim * self.qk_norm
        return self.num_layers * per_layer + v * h * (1 if self.tie_word_embeddings else 2) + h

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes


def model_class(arch: ArchConfig) -> type:
    """Our module for `arch`: the Llama-family model unless MODEL_CLASSES names another (imported here,
    lazily: the model modules import this one)."""
    module, _, name = MODEL_CLASSES.get(arch.architecture, "specserve.models.llama:LlamaForCausalLM").partition(":")
    return getattr(importlib.import_module(module), name)


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
        gemma = _gemma3_fields(raw, int(raw["num_hidden_layers"]), source) if arch == "Gemma3ForCausalLM" else {}
        if gemma:
            rope_theta, rope_scaling = gemma.pop("rope_theta"), gemma.pop("rope_scaling")
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
            qk_norm=arch in ("Qwen3ForCausalLM", "Gemma3ForCausalLM"),
            eos_token_ids=_as_list(raw.get("eos_token_id")),
            bos_token_id=raw.get("bos_token_id"),
            raw=raw,
            **gemma,
        )
    except KeyError as e:
        raise ValueError(f"{source}: missing required field {e.args[0]!r}") from None


def _gemma3_fields(raw: dict[str, Any], num_layers: int, source: str) -> dict[str, Any]:
    """Gemma 3's own fields, from a config.json of either generation: transformers 5 writes
    `layer_types` and per-layer-type `rope_parameters`; older files have `sliding_window_pattern`,
    `rope_theta`, `rope_local_base_freq` and a `rope_scaling` that applies to the global layers only.
    Missing fields take transformers' Gemma3TextConfig defaults."""
    if raw.get("attn_logit_softcapping") is not None:
        raise ValueError(f"{source}: attention logit softcapping is not supported (Gemma 3 does not use it)")
    if raw.get("use_bidirectional_attention"):
        raise ValueError(f"{source}: bidirectional attention (an embedding model) is not supported")
    activation = raw.get("hidden_activation") or raw.get("hidden_act") or "gelu_pytorch_tanh"
    if activation not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise ValueError(f"{source}: activation {activation!r} is not supported (Gemma 3 uses gelu_pytorch_tanh)")
    layer_types = raw.get("layer_types")
    if layer_types is None:
        pattern = int(raw.get("sliding_window_pattern", raw.get("_sliding_window_pattern", 6)))
        layer_types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(num_layers)]
    if len(layer_types) != num_layers or set(layer_types) - {"sliding_attention", "full_attention"}:
        raise ValueError(f"{source}: layer_types must name sliding_attention or full_attention for each of "
                         f"the {num_layers} layers, got {layer_types!r}")
    window = int(raw.get("sliding_window") or 4096)
    rope = raw.get("rope_parameters") or {}
    full = rope.get("full_attention") or {}
    local = rope.get("sliding_attention") or {}
    if local.get("rope_type", "default") != "default":
        raise ValueError(f"{source}: RoPE scaling of the sliding-window layers is not supported")
    return dict(
        rope_theta=float(full.get("rope_theta", raw.get("rope_theta", 1_000_000.0))),
        rope_scaling=raw.get("rope_scaling") or (full if full.get("rope_type", "default") != "default" else None),
        layer_windows=[window if t == "sliding_attention" else None for t in layer_types],
        local_rope_theta=float(local.get("rope_theta", raw.get("rope_local_base_freq", 10_000.0))),
        query_pre_attn_scalar=float(raw.get("query_pre_attn_scalar", 256)),
        final_logit_softcapping=raw.get("final_logit_softcapping"),
    )


def load_arch_config(path: str | Path) -> ArchConfig:
    path = Path(path)
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        raise ValueError(f"model config not found: {path}") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from None
    return parse_arch_config(raw, str(path))
