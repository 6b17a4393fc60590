"""Engine configuration: one dataclass per part, validated on construction.

`engine_config_from_args(**engine_args)` takes the CLI long flag names with underscores (vLLM's
shape, as `LLM(...)` does) and builds the `EngineConfig` the engine runs on.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from dataclasses import dataclass, field
from typing import Any

from specserve.engine.generation_config import check_generation_config  # torch-free
from specserve.quant.names import is_self_draft, parse_self_draft  # torch-free

DTYPES = ("auto", "float32", "bfloat16", "float16")
QUANTIZATIONS = (None, "bitsandbytes", "bitsandbytes-int8", "bitsandbytes-nf4")  # bitsandbytes: see quant/checkpoint.py
LOAD_FORMATS = ("auto", "dummy")
SPEC_METHODS = ("ngram", "draft_model", "eagle", "eagle3")
# an EAGLE head's: weight-only int8 rows (specserve/quant/int8_linear.py), or as trained (none); left
# out (None), by the head's size and the device (spec_decode.head_quantization)
HEAD_QUANTIZATIONS = (None, "int8", "none")
EAGLE_METHODS = ("eagle", "eagle3")  # eagle3: a head that fuses several of the target's layers
# the cap on drafts per step when none is given: for an EAGLE head the chain depth the shipped head was
# trained to (train-draft --ttt-depth 4) and every EAGLE benchmark's; 3 for the others
DEFAULT_NUM_SPECULATIVE_TOKENS = {"eagle": 4, "eagle3": 4}
ATTENTION_BACKENDS = ("auto", "torch", "triton")


@dataclass
class ModelConfig:
    model: str | None = None  # None = the default model (SmolLM2-135M-Instruct)
    dtype: str = "auto"
    load_format: str = "auto"
    max_model_len: int | None = None  # None = the model's own limit
    quantization: str | None = None
    quantize_embeddings: bool = False  # with `quantization`: also the embeddings and lm_head
    seed: int = 0
    tokenizer: str | None = None
    chat_template: str | None = None  # a file or the Jinja template itself, instead of the tokenizer's
    revision: str | None = None  # a hub id's branch, tag or commit (default: main)
    download_dir: str | None = None  # the hub cache for a hub id (default: HF_HUB_CACHE)
    # default sampling parameters: auto = the model's generation_config.json, vllm = none, or a folder's
    # (engine/generation_config.py)
    generation_config: str = "auto"
    max_logprobs: int = 20  # most logprobs one request may ask for per token (-1: the vocabulary)

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype {self.dtype!r} is not one of {', '.join(DTYPES)}")
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(f"load_format {self.load_format!r} is not one of {', '.join(LOAD_FORMATS)}")
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(
                f"quantization {self.quantization!r} is not one of bitsandbytes (the checkpoint's method, "
                "else nf4), bitsandbytes-int8, bitsandbytes-nf4")
        if self.quantize_embeddings and not self.quantization:
            raise ValueError("quantize_embeddings needs --quantization bitsandbytes-int8 or bitsandbytes-nf4")
        if self.chat_template is not None and "{" not in self.chat_template \
                and not Path(self.chat_template).is_file():
            raise ValueError(f"chat_template {self.chat_template!r} is neither a file nor a Jinja template")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")
        check_generation_config(self.generation_config)
        if self.max_logprobs < -1:
            raise ValueError(f"max_logprobs must be -1 (no limit) or >= 0, got {self.max_logprobs}")


@dataclass
class CacheConfig:
    block_size: int = 16
    num_kv_blocks: int | None = None  # fixes the pool size (tests, benchmarks)
    kv_cache_memory: int = 1 << 30  # bytes for the KV cache on the CPU
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        if self.block_size not in (1, 2, 4, 8, 16, 32, 64, 128):
            raise ValueError(f"block_size must be a power of two up to 128, got {self.block_size}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.kv_cache_memory < 1:
            raise ValueError(f"kv_cache_memory must be positive, got {self.kv_cache_memory}")


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 256
    # tokens per step (prefill chunks + decodes); None: chosen by device (engine/build.py:
    # DEFAULT_MAX_NUM_BATCHED_TOKENS — large chunks on a GPU, small ones on a CPU for even inter-token latency)
    max_num_batched_tokens: int | None = None
    max_model_len: int = 0  # filled in from the model config by the engine
    # schedule step N+1 while step N runs on the device (None: on for CUDA, off on the CPU)
    async_scheduling: bool | None = None
    # with async scheduling, also launch a drafting step's successor before the step's tokens are known
    # (EAGLE drafting on the device, CUDA, one GPU): `Scheduler.schedule_ahead`; off (on an H200 it gained at
    # 16 requests, not at one); the builder turns it off without async scheduling or under tensor parallelism
    async_drafting: bool = False

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")


@dataclass
class SpecConfig:
    """Speculative decoding: `method` is "ngram", "draft_model" (`model` names the draft), "eagle"
    (`model` names a draft head made by `specserve train-draft`; left out on the default model, the
    head shipped for it) or "eagle3" (the same, for a head that fuses several of the target's layers;
    "eagle" loads those too). Left out, the method is inferred as vLLM does: "draft_model" when a
    `model` is given (an EAGLE head directory: "eagle"), else "ngram"."""

    method: str | None = None
    num_speculative_tokens: int | None = None  # None: DEFAULT_NUM_SPECULATIVE_TOKENS for the method, else 3
    model: str | None = None
    quantization: str | None = None
    load_format: str = "auto"
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 4
    adaptive: bool = True
    # BENCHMARKS ONLY: accept each draft token with this probability whatever the models say (random
    # weights accept nothing); a list gives one per draft position (draft j, given draft j-1 was
    # accepted; the last value repeats). Output is then no longer the target's: greedy identity does not hold.
    simulated_acceptance: float | list[float] | None = None
    # Adaptive k (specserve/spec_decode/adaptive.py): tokens per forward where the target turns compute bound
    # (None = the device's default) and one draft-model step in target steps (None = parameter ratio).
    compute_bound_tokens: int | None = None
    draft_cost: float | None = None
    # An EAGLE head's draft vocabulary: None, as trained (a reduced one: its LM head rows are the
    # target's for those ids), or "full": every target token (the rows past the trained ones are the
    # target's too; more drafts accepted, a wider LM head per draft step)
    draft_vocab: str | None = None

    def __post_init__(self) -> None:
        if self.method is None:
            self.method = ("eagle" if is_head_dir(self.model) else "draft_model") if self.model else "ngram"
        if self.method not in SPEC_METHODS:
            raise ValueError(f"speculative method {self.method!r} is not one of {', '.join(SPEC_METHODS)}")
        if self.method == "draft_model" and not self.model:
            raise ValueError("speculative method draft_model needs a draft model (--draft-model PATH)")
        if self.method == "ngram" and self.model:
            raise ValueError(f"speculative method ngram drafts from the prompt and takes no model; for the "
                             f"draft model {self.model!r} use method draft_model (or leave method out)")

        if self.num_speculative_tokens is None:
            self.num_speculative_tokens = DEFAULT_NUM_SPECULATIVE_TOKENS.get(self.method, 3)
        if not 1 <= self.num_speculative_tokens <= 16:
            raise ValueError(f"num_speculative_tokens must be in 1..16, got {self.num_speculative_tokens}")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError("need 1 <= prompt_lookup_min <= prompt_lookup_max")
        if self.method in EAGLE_METHODS:
            if self.quantization not in HEAD_QUANTIZATIONS:
                raise ValueError(f"an EAGLE head's quantization is int8 (weight-only, at load) or none (as "
                                 f"trained), not {self.quantization!r}")
        elif self.quantization is not None and self.quantization in HEAD_QUANTIZATIONS:
            raise ValueError(f"draft quantization {self.quantization} is for EAGLE heads; a draft model takes "
                             "bitsandbytes, bitsandbytes-int8 or bitsandbytes-nf4 (or none: leave it out)")
        elif self.quantization not in QUANTIZATIONS:
            raise ValueError(f"draft quantization {self.quantization!r} is not supported")
        if self.method == "draft_model":
            if is_self_draft(self.model):  # the target's own weights: self-nf4 -> quantization nf4
                self.quantization = parse_self_draft(self.model, self.quantization)
        if self.simulated_acceptance is not None:
            rates = self.simulated_acceptance if isinstance(self.simulated_acceptance, list) \
                else [self.simulated_acceptance]
            if not rates or not all(isinstance(a, (int, float)) and 0.0 <= a <= 1.0 for a in rates):
                raise ValueError("simulated_acceptance must be in [0, 1] (or a list of such, one per draft position)")
        if self.draft_vocab is not None:
            if self.draft_vocab != "full":
                raise ValueError(f"draft_vocab is \"full\" (every target token) or left out (as trained), "
                                 f"not {self.draft_vocab!r}")
            if self.method not in EAGLE_METHODS:
                raise ValueError(f"draft_vocab is for EAGLE heads, not speculative method {self.method}")
        if self.compute_bound_tokens is not None and self.compute_bound_tokens < 1:
            raise ValueError(f"compute_bound_tokens must be >= 1, got {self.compute_bound_tokens}")
        if self.draft_cost is not None and self.draft_cost < 0:
            raise ValueError(f"draft_cost must be >= 0, got {self.draft_cost}")

    @classmethod
    def parse(cls, value: str | dict | SpecConfig | None) -> SpecConfig | None:
        if value is None or isinstance(value, SpecConfig):
            return value
        value = _spec_object(value)
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"unknown speculative_config keys: {', '.join(unknown)}")
        return cls(**value)


@dataclass
class ParallelConfig:
    """Tensor parallelism (specserve/distributed/): one process per device, rank 0 the engine."""

    tensor_parallel_size: int = 1
    # a collective that waits longer than this on a worker (a hung rank) fails the engine
    timeout_s: float = 60.0

    def __post_init__(self) -> None:
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if self.timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, got {self.timeout_s}")


@dataclass
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    spec: SpecConfig | None = None
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    device: str = "auto"
    attention_backend: str = "auto"
    enforce_eager: bool = False
    # run the first batches' shapes once before use (engine.py: LLMEngine.warm_up); None = on for CUDA
    warmup: bool | None = None
    # CPU threads for torch's math (torch.set_num_threads); None = torch's default (one per core)
    threads: int | None = None

    def __post_init__(self) -> None:
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"threads must be at least 1, got {self.threads}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(
                f"attention_backend {self.attention_backend!r} is not one of {', '.join(ATTENTION_BACKENDS)}")
        tp = self.parallel.tensor_parallel_size
        if tp > 1 and self.model.quantization:
            raise ValueError(f"tensor_parallel_size {tp} with quantization {self.model.quantization}: bitsandbytes "
                             "weights are not sharded; run quantized models with tensor_parallel_size 1")
        if tp > 1 and self.spec is not None and self.spec.method == "draft_model" and is_self_draft(self.spec.model):
            raise ValueError(f"tensor_parallel_size {tp} with the self-draft {self.spec.model!r}: it would share the "
                             "target's sharded weights; give a separate --draft-model (it runs unsharded on rank 0)")


# Engine arguments (CLI long flags with underscores) -> where they live in EngineConfig.
_MODEL_KEYS = {"model", "dtype", "load_format", "max_model_len", "quantization", "quantize_embeddings",
               "seed", "tokenizer", "chat_template", "revision", "download_dir", "generation_config",
               "max_logprobs"}
_CACHE_KEYS = {"block_size", "num_kv_blocks", "kv_cache_memory", "gpu_memory_utilization",
               "enable_prefix_caching"}
_SCHED_KEYS = {"max_num_seqs", "max_num_batched_tokens", "async_scheduling", "async_drafting"}
_TOP_KEYS = {"device", "attention_backend", "enforce_eager", "threads", "warmup"}
_PARALLEL_KEYS = {"tensor_parallel_size"}
_SPEC_KEYS = {"speculative_config", "draft_model", "num_speculative_tokens", "draft_quantization",
              "draft_load_format"}
ENGINE_ARG_NAMES = _MODEL_KEYS | _CACHE_KEYS | _SCHED_KEYS | _TOP_KEYS | _SPEC_KEYS | _PARALLEL_KEYS


def _spec_object(value: Any) -> dict:
    """`--speculative-config` as a dict: a JSON object's text, or a mapping (YAML, Python)."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"--speculative-config is not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise ValueError("speculative_config must be a JSON object")
    return value


def build_spec_config(speculative_config: Any = None, draft_model: str | None = None,
                      num_speculative_tokens: int | None = None, draft_quantization: str | None = None,
                      draft_load_format: str | None = None) -> SpecConfig | None:
    """Merge `--speculative-config` with its shorthands (the shorthands win)."""
    if isinstance(speculative_config, SpecConfig):
        speculative_config = dataclasses.asdict(speculative_config)
    elif speculative_config is not None:  # keys as given: a method left out is inferred below
        speculative_config = _spec_object(speculative_config)
    spec = dict(speculative_config or {})
    if draft_model:
        spec.setdefault("method", "draft_model")
        spec["model"] = draft_model
    if num_speculative_tokens is not None:
        spec["num_speculative_tokens"] = num_speculative_tokens
    if draft_quantization is not None:
        spec["quantization"] = draft_quantization
    if draft_load_format is not None:
        spec["load_format"] = draft_load_format
    if not spec:
        return None
    parsed = SpecConfig.parse(spec)
    model = parsed.model
    if (parsed.method == "draft_model" and not is_self_draft(model) and parsed.load_format != "dummy"
            and not Path(model).exists() and not _looks_like_hub_id(model)):  # fail before loading anything
        raise ValueError(f"draft model not found: {model} (a HF model directory, a .gguf file or a hub id)")
    if parsed.method in EAGLE_METHODS and model and parsed.load_format != "dummy" and not is_head_dir(model):
        raise ValueError(f"EAGLE head not found: {model} (a directory made by `specserve train-draft`)")
    return parsed


EAGLE_HEAD_ARCHITECTURE = "EagleHead"  # config.json's architecture of a head (spec_decode/eagle_head.py)


def is_head_dir(path: str | Path | None) -> bool:
    """A directory made by `specserve train-draft`: its config.json names the EagleHead architecture
    (here, torch-free, so that a config can infer `method: eagle` without loading anything)."""
    if not path:
        return False
    try:
        raw = json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(raw, dict) and EAGLE_HEAD_ARCHITECTURE in (raw.get("architectures") or [])


def _looks_like_hub_id(model: str) -> bool:
    parts = model.split("/")
    return len(parts) == 2 and all(parts) and not model.startswith((".", "~"))


def engine_config_from_args(**kwargs: Any) -> EngineConfig:
    """Build an EngineConfig from engine arguments named like the CLI flags (underscores)."""
    if kwargs.pop("enable_chunked_prefill", None) is False:  # vLLM's flag: always on here
        raise ValueError("enable_chunked_prefill=False: specserve always chunks prefill into the step's token "
                         "budget (max_num_batched_tokens); raise that for longer chunks")
    unknown = sorted(set(kwargs) - ENGINE_ARG_NAMES)
    if unknown:
        raise TypeError(f"unknown engine arguments: {', '.join(unknown)}")
    pick = lambda keys: {k: v for k, v in kwargs.items() if k in keys and v is not None}  # noqa: E731
    spec = build_spec_config(**{k: kwargs.get(k) for k in _SPEC_KEYS})
    return EngineConfig(model=ModelConfig(**pick(_MODEL_KEYS)), cache=CacheConfig(**pick(_CACHE_KEYS)),
                        scheduler=SchedulerConfig(**pick(_SCHED_KEYS)), spec=spec,
                        parallel=ParallelConfig(**pick(_PARALLEL_KEYS)), **pick(_TOP_KEYS))
