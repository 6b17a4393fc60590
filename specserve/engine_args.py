"""The engine flags shared by `specserve generate` and `specserve serve` (vLLM's names), and the
engine arguments of `LLM(...)` they map to (dashes become underscores). Torch-free."""
from __future__ import annotations

import argparse
from typing import Any

from specserve.config import DTYPES, HEAD_QUANTIZATIONS, LOAD_FORMATS, QUANTIZATIONS
from specserve.utils import parse_size


def add_engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    g.add_argument("--dtype", choices=DTYPES, default="auto")
    g.add_argument("--device", default="auto", help="auto (cuda if available), cpu, cuda, cuda:N")
    g.add_argument("--load-format", choices=LOAD_FORMATS, default="auto",
                   help="dummy = random weights of the model's shape (benchmarks)")
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--max-num-seqs", type=int, default=256)
    g.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="tokens per engine step (default by device: 8192 on a GPU, 2048 on a CPU)")
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--num-kv-blocks", type=int, default=None, help="fix the KV cache size in blocks")
    g.add_argument("--kv-cache-memory", type=parse_size, default=1 << 30, help="KV cache bytes on the CPU")
    g.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    g.add_argument("--quantization", choices=["bitsandbytes", "bitsandbytes-int8", "bitsandbytes-nf4"], default=None,
                   help="bitsandbytes weights: bitsandbytes = what a pre-quantized checkpoint declares, else nf4")
    g.add_argument("--quantize-embeddings", action="store_true", default=None,
                   help="with --quantization: also quantize the embeddings and lm_head")
    g.add_argument("--attention-backend", choices=["auto", "torch", "triton"], default="auto")
    g.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    g.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                   help="schedule the next step while the device runs this one (default: on for CUDA)")
    g.add_argument("--async-drafting", action=argparse.BooleanOptionalAction, default=None,
                   help="with async scheduling and EAGLE drafting on the GPU, also launch a drafting step's "
                        "successor before the step's tokens are known (default: off)")
    g.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=None,
                   help="before serving, run the shapes the first batches use, so kernels compile then "
                        "and not in the first users' requests (default: on for CUDA, off on the CPU)")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--tokenizer", default=None,
                   help="load the tokenizer (and chat template) from this directory instead of the model's")
    g.add_argument("--revision", default=None, help="with a hub id: the branch, tag or commit (default main)")
    g.add_argument("--download-dir", default=None, help="with a hub id: the cache to download into")
    g.add_argument("--chat-template", default=None,
                   help="a Jinja chat template (a file, or the template itself) instead of the tokenizer's")
    g.add_argument("--generation-config", default="auto",
                   help="default sampling parameters for requests that leave them out: auto = the model's "
                        "generation_config.json (temperature, top_p, top_k, min_p, repetition_penalty, "
                        "max_new_tokens), vllm = none, or a folder holding a generation_config.json")
    g.add_argument("--max-logprobs", type=int, default=20,
                   help="most logprobs a request may ask for per token (default 20; -1: no limit)")
    g.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=None,
                   help="always on (prefill is chunked into the per-step token budget); "
                        "--no-enable-chunked-prefill is refused")
    g.add_argument("--tensor-parallel-size", "-tp", type=int, default=None,
                   help="shard the model over N devices, one process each (docs/tensor_parallel.md)")
    g.add_argument("--threads", type=int, default=None,
                   help="CPU threads for the model's math (default: torch's, one per core; on a machine "
                        "shared with other work, fewer is often faster)")
    s = p.add_argument_group("speculative decoding")
    s.add_argument("--speculative-config", default=None,
                   help='JSON, e.g. \'{"method": "ngram", "num_speculative_tokens": 3}\'')
    s.add_argument("--draft-model", default=None,
                   help="a draft model path, or self / self-int8 / self-nf4 (the target's weights)")
    s.add_argument("--num-speculative-tokens", type=int, default=None,
                   help="the most drafts per request per step (default 4 for an EAGLE head, 3 otherwise)")
    s.add_argument("--draft-quantization", choices=[q for q in QUANTIZATIONS + HEAD_QUANTIZATIONS if q], default=None,
                   help="a draft model's bitsandbytes method; for an EAGLE head int8 (weight-only int8 rows, "
                        "quantized at load; a CUDA kernel) or none (as trained); default for a head: int8 on CUDA "
                        "when a draft step reads 64 MiB or more, else none")
    s.add_argument("--draft-load-format", choices=LOAD_FORMATS, default=None)


ENGINE_DESTS = ["dtype", "device", "load_format", "max_model_len", "max_num_seqs", "max_num_batched_tokens",
                "block_size", "num_kv_blocks", "kv_cache_memory", "gpu_memory_utilization",
                "enable_prefix_caching", "quantization", "quantize_embeddings", "attention_backend",
                "enforce_eager", "async_scheduling", "async_drafting", "warmup", "seed", "threads", "tokenizer",
                "chat_template", "revision", "download_dir", "generation_config", "max_logprobs",
                "enable_chunked_prefill",
                "speculative_config", "draft_model", "num_speculative_tokens", "draft_quantization",
                "draft_load_format", "tensor_parallel_size"]


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    return {k: getattr(args, k) for k in ENGINE_DESTS if hasattr(args, k)}
