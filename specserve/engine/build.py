"""The engine builder: load the target -> the proposer (and its draft model) -> KV sizing -> executors,
KV cache manager, scheduler, model runner, CUDA graphs. Each collaborator gets what it needs in its
constructor (or, for a proposer, in `bind`); nothing is patched in afterwards, and the caller's
config is left alone: `EngineParts.config` is the resolved copy (with the final max_model_len).
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
import gc
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from specserve.cache.kv_cache_manager import KVCacheManager
from specserve.config import EngineConfig
from specserve.engine.cuda_graphs import prefill_graph_tokens, query_lens_up_to
from specserve.engine.executor import ModelExecutor
from specserve.engine.model_runner import ModelRunner
from specserve.engine.scheduler import Scheduler
from specserve.models.layers.attention import get_attention_backend
from specserve.models.layers.cpu_linear import pack_linears
from specserve.models.loader import LoadedModel, hub_snapshot, load_model, load_tokenizer
from specserve.quant.bnb import cuda_graph_safe
from specserve.quant.memory import WeightMemory, dequant_workspace_bytes, format_bytes, weight_memory
from specserve.sample.sampler import RequestGenerators
from specserve.spec_decode.proposer import Proposer, ProposerBinding

if TYPE_CHECKING:
    from specserve.distributed.workers import WorkerGroup

logger = logging.getLogger(__name__)

# Tokens per step when the config leaves it open. A GPU step costs about the same up to thousands of
# tokens (it reads the weights once), so bigger prefill chunks help throughput a little (2048 -> 8192:
# +1.7% for 256 concurrent requests of an 8B model on an H200, BENCHMARKS.md); on a CPU every token
# costs, and small chunks keep the decode steps of running requests short.
DEFAULT_MAX_NUM_BATCHED_TOKENS = {"cuda": 8192, "cpu": 2048}


@dataclass(frozen=True, slots=True)
class EngineParts:
    config: EngineConfig  # resolved: scheduler.max_model_len is the final context length
    device: torch.device
    loaded: LoadedModel
    model_name: str
    proposer: Proposer | None
    weight_memory: WeightMemory  # the target's
    weight_bytes: int  # target + draft
    draft_weight_bytes: int
    kv_cache_bytes: int
    kv_manager: KVCacheManager
    scheduler: Scheduler
    runner: ModelRunner


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except RuntimeError as e:
        raise ValueError(f"bad device {device!r}: {e}") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device cuda requested but no CUDA GPU is available")
    return dev


def build_engine(config: EngineConfig) -> EngineParts:
    device = resolve_device(config.device)
    if config.threads is not None:
        torch.set_num_threads(config.threads)
    config = with_device_defaults(config, device)
    model_name, model_path = _model_path(config)
    workers = _start_workers(config, model_path, device)  # None without tensor parallelism
    try:
        return _build_parts(config, device, model_name, model_path, workers)
    except BaseException:
        if workers is not None:
            workers.stop()
        raise


def _build_parts(config: EngineConfig, device: torch.device, model_name: str, model_path: str,
                 workers: WorkerGroup | None) -> EngineParts:
    mc, cc, sc = config.model, config.cache, config.scheduler
    loaded, target_memory = _load_target(config, device, model_path, workers)
    proposer = _build_proposer(config, loaded, device)
    draft = proposer.draft_model if proposer is not None else None
    weight_bytes = weight_memory(loaded.model, draft).total if draft is not None else target_memory.total
    if draft is not None:  # a self-draft shares the target's tensors: count what it adds
        logger.info("draft %s adds %s of weights (%s in all)", config.spec.model,
                    format_bytes(weight_bytes - target_memory.total), format_bytes(weight_bytes))

    block_bytes = sum(ModelExecutor.kv_bytes_per_block(m, cc.block_size, loaded.dtype)
                      for m in (loaded.model, draft) if m is not None)  # a draft's KV lives in the same blocks
    max_len, num_blocks = _size_kv(config, loaded, device, block_bytes)
    config = dataclasses.replace(config, scheduler=dataclasses.replace(sc, max_model_len=max_len))

    identity = (loaded.path, str(loaded.dtype), loaded.quantization or "")
    if proposer is not None and proposer.cache_identity:
        identity += (proposer.cache_identity,)
    kv_manager = KVCacheManager(num_blocks, cc.block_size, cc.enable_prefix_caching, extra_keys=identity)
    scheduler = Scheduler(config.scheduler, kv_manager,
                          num_lookahead_tokens=proposer.num_lookahead_tokens if proposer is not None else 0)
    backend = get_attention_backend(config.attention_backend, device)
    executors = [ModelExecutor(m, backend, device, loaded.dtype, cc.block_size, num_blocks)
                 for m in (loaded.model, draft) if m is not None]
    if workers is not None:  # the target's calls are mirrored on the workers; a draft runs here only
        from specserve.distributed.executor import ParallelExecutor
        executors[0] = ParallelExecutor(loaded.model, backend, device, loaded.dtype, cc.block_size, num_blocks,
                                        workers)
    if device.type == "cpu":  # small batches through oneDNN (models/layers/cpu_linear.py)
        for executor in executors:
            pack_linears(executor.model)
    generators = RequestGenerators(device)
    rejection = None
    if proposer is not None:
        from specserve.spec_decode.rejection import RejectionSampler

        proposer.bind(ProposerBinding(executors[0], executors[1] if draft is not None else None, generators,
                                      max_len, config.scheduler.async_scheduling))
        rejection = RejectionSampler(config.spec.simulated_acceptance, seed=mc.seed)
    runner = ModelRunner(executors, generators, proposer, rejection, seed=mc.seed)
    if device.type == "cuda" and backend.name == "triton":
        for executor in executors:
            executor.warm_up_kernels(max_len)
    if device.type == "cuda" and async_drafting_applies(sc, proposer):
        from specserve.kernels import warm_up_move_back  # steps ahead move back in one launch

        warm_up_move_back(device, cc.block_size)
    if device.type == "cuda" and not config.enforce_eager and backend.name == "triton" \
            and cuda_graph_safe(loaded.model, draft):
        k = config.spec.num_speculative_tokens if config.spec else 0
        # the target's steps compute 1 + k tokens per request at most, for every k up to the cap (adaptive
        # k plans fewer: a step of 64 requests verifying one draft each, replayed from the graph of 1 + 4
        # tokens each, computed 2.5x the tokens and cost ~2 plain steps on an H200 at 8B shapes against
        # ~1.4 from its own graph); a draft model's forwards are what its proposer says; and every
        # executor's short prefill steps (a prompt, an admission, a head's catch-up over them) up to a
        # chunk's tokens (a drafter's up to more tokens than the target's: `prefill_graph_tokens`). A target
        # whose drafts are verified on the device also replays its verification's LM head, argmax and
        # accepted counts (the verdict graphs)
        verdicts = getattr(proposer, "drafts_on_device", False)
        for executor in executors:
            drafter = executor is not executors[0]
            lens = proposer.draft_query_lens if drafter else query_lens_up_to(1 + k)
            executor.capture_graphs(max_len, sc.max_num_seqs, lens,
                                    prefill_graph_tokens(min(sc.max_num_batched_tokens, max_len), drafter),
                                    verdicts=verdicts and not drafter)
        if proposer is not None:
            proposer.capture_graphs(max_len, sc.max_num_seqs)
    logger.info("KV cache: %d blocks x %d tokens (%s), max_model_len %d, attention %s", num_blocks,
                cc.block_size, format_bytes(num_blocks * block_bytes), max_len, backend.name)
    return EngineParts(config, device, loaded, model_name, proposer, target_memory, weight_bytes,
                       weight_bytes - target_memory.total, num_blocks * block_bytes, kv_manager, scheduler, runner)


def async_drafting_applies(sc, proposer) -> bool:
    """Do steps run ahead of a drafting step's tokens: async drafting asked for and possible here
    (`with_device_defaults` resolved it), and a proposer that drafts on the device?"""
    return bool(sc.async_drafting) and getattr(proposer, "drafts_on_device", False)


def with_device_defaults(config: EngineConfig, device: torch.device) -> EngineConfig:
    """A copy of `config` with what it left to the device filled in."""
    sc = config.scheduler
    tokens = sc.max_num_batched_tokens
    if tokens is None:
        tokens = DEFAULT_MAX_NUM_BATCHED_TOKENS.get(device.type, DEFAULT_MAX_NUM_BATCHED_TOKENS["cpu"])
    # async scheduling: on by default on CUDA (README)
    overlap = sc.async_scheduling if sc.async_scheduling is not None else device.type == "cuda"
    # async drafting (asked for): on top of async scheduling, on one device (under tensor parallelism the
    # workers take each step's metadata from the host, which a step ahead moves on the device)
    drafting = sc.async_drafting and overlap and config.parallel.tensor_parallel_size == 1
    return dataclasses.replace(config, scheduler=dataclasses.replace(sc, max_num_batched_tokens=tokens,
                                                                     async_scheduling=overlap,
                                                                     async_drafting=drafting))


def _model_path(config: EngineConfig) -> tuple[str, str]:
    """(what the model is called: a hub id stays an id, where its files are)."""
    mc = config.model
    model_path = mc.model
    if model_path is None:
        from specserve.models.default_model import ensure_default_model
        model_path = str(ensure_default_model())
    name = model_path
    if mc.load_format != "dummy" and not Path(model_path).exists():  # a hub id (org/name)
        model_path = hub_snapshot(model_path, revision=mc.revision, cache_dir=mc.download_dir)
    return name, model_path


def _start_workers(config: EngineConfig, model_path: str, device: torch.device) -> WorkerGroup | None:
    """Tensor parallelism: check that the model splits, then start ranks 1..N-1 (they load their
    shards while rank 0 loads its own)."""
    size = config.parallel.tensor_parallel_size
    if size == 1:
        return None
    from specserve.distributed.sharding import check_tensor_parallel
    from specserve.distributed.state import rank_device
    from specserve.distributed.workers import WorkerGroup
    from specserve.models.loader import dummy_config_path
    from specserve.models.registry import load_arch_config

    config_file = dummy_config_path(model_path) if config.model.load_format == "dummy" \
        else Path(model_path) / "config.json"
    if config_file.is_file():  # else the loader says what is wrong with the path
        check_tensor_parallel(load_arch_config(config_file), size)
    rank_device(device, size - 1)  # enough GPUs
    return WorkerGroup(config, model_path, device)


def _load_target(config: EngineConfig, device: torch.device, model_path: str, workers: WorkerGroup | None
                 ) -> tuple[LoadedModel, WeightMemory]:
    mc = config.model
    t0 = time.perf_counter()
    tp = (0, workers.size) if workers is not None else None
    loaded = load_model(model_path, dtype=mc.dtype, device=device, load_format=mc.load_format,
                        max_positions=mc.max_model_len, seed=mc.seed, quantization=mc.quantization,
                        quantize_embeddings=mc.quantize_embeddings, tensor_parallel=tp)
    if workers is not None:
        from specserve.distributed.layers import parallelize
        workers.wait_ready()
        parallelize(loaded.model, workers.group, loaded.arch.vocab_size)
    if mc.tokenizer is not None:  # a tokenizer from elsewhere (a dummy-weights model, a fixed template)
        tokenizer = load_tokenizer(mc.tokenizer)
        if tokenizer is None:
            raise ValueError(f"tokenizer {mc.tokenizer}: no tokenizer files (tokenizer.json, tokenizer.model, "
                             "tokenizer_config.json) there")
        if len(tokenizer) > loaded.arch.vocab_size:
            raise ValueError(f"tokenizer {mc.tokenizer} has {len(tokenizer)} tokens, more than the model's "
                             f"vocabulary of {loaded.arch.vocab_size}")
        loaded = dataclasses.replace(loaded, tokenizer=tokenizer)
    if mc.chat_template is not None:  # vLLM's --chat-template: a file, or the template itself
        if loaded.tokenizer is None:
            raise ValueError("--chat-template needs a tokenizer (this model has none: give --tokenizer)")
        template = Path(mc.chat_template)
        loaded.tokenizer.chat_template = (template.read_text() if "{" not in mc.chat_template and template.is_file()
                                          else mc.chat_template)
    mem = weight_memory(loaded.model)  # quantized storage counted as stored, tied weights once
    quant = "" if not loaded.quantization else (
        f"; {loaded.quantization}: {mem.num_quantized_layers} quantized layers {format_bytes(mem.quantized)} "
        f"incl. scales, unquantized {format_bytes(mem.unquantized)}")
    shard = f" per rank, tensor parallel over {workers.size} ranks" if workers is not None else ""
    logger.info("loaded %s (%s, %s of weights%s%s) in %.1fs", model_path, loaded.dtype, format_bytes(mem.total),
                shard, quant, time.perf_counter() - t0)
    return loaded, mem


def _build_proposer(config: EngineConfig, loaded: LoadedModel, device: torch.device) -> Proposer | None:
    if config.spec is None:
        return None
    from specserve.spec_decode import build_proposer

    mc = config.model
    return build_proposer(config.spec, target=loaded, device=device, seed=mc.seed,
                          max_positions=mc.max_model_len or loaded.arch.max_position_embeddings,
                          max_num_batched_tokens=config.scheduler.max_num_batched_tokens)


def _size_kv(config: EngineConfig, loaded: LoadedModel, device: torch.device, block_bytes: int
             ) -> tuple[int, int]:
    """(max_model_len, num_blocks): the KV cache from its memory budget, the context length it allows."""
    mc, cc, arch = config.model, config.cache, loaded.arch
    max_len = mc.max_model_len or arch.max_position_embeddings
    if max_len > arch.max_position_embeddings:
        raise ValueError(f"max_model_len {max_len} exceeds the model's {arch.max_position_embeddings}")
    num_blocks = cc.num_kv_blocks or _auto_num_blocks(config, loaded, device, block_bytes)
    if num_blocks * cc.block_size < max_len:
        if mc.max_model_len:
            raise ValueError(f"max_model_len {max_len} needs {-(-max_len // cc.block_size)} KV blocks, "
                             f"the cache has {num_blocks}; lower --max-model-len or give the cache more memory")
        max_len = num_blocks * cc.block_size
        logger.warning("max_model_len lowered to %d to fit the KV cache", max_len)
    return max_len, num_blocks


def _auto_num_blocks(config: EngineConfig, loaded: LoadedModel, device: torch.device, block_bytes: int) -> int:
    if device.type == "cuda":
        gc.collect()  # an engine dropped just before (benchmarks) frees its KV cache now
        torch.cuda.synchronize()
        free, total = torch.cuda.mem_get_info(device)
        # memory this process's allocator holds but does not use is available to us
        used = total - free - (torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device))
        sc, arch = config.scheduler, loaded.arch
        # activations of one step: hidden/qkv/mlp intermediates and the fp32 logits
        act = sc.max_num_batched_tokens * (4 * arch.hidden_size + 3 * arch.intermediate_size) * 4
        act += sc.max_num_seqs * 8 * arch.vocab_size * 4
        act += dequant_workspace_bytes(loaded.model, loaded.dtype)  # bnb 4-bit matmuls
        budget = total * config.cache.gpu_memory_utilization - used - act
    else:
        budget = config.cache.kv_cache_memory
    num = int(budget // block_bytes)
    if num < 1:
        raise ValueError("no memory left for the KV cache: lower the model size or raise "
                         "--gpu-memory-utilization / --kv-cache-memory")
    return num
