"""`specserve serve | generate | chat | pull`.

Engine flags follow `vllm serve`; every engine flag is also an engine argument of `LLM(...)`
(dashes become underscores).
"""
from __future__ import annotations

import argparse
import logging
import sys
from typing import Any

# Only torch-free modules at the top: `specserve --help` and flag errors must not wait for torch;
# the command functions import the engine.
from specserve.config import DTYPES, LOAD_FORMATS
from specserve.utils import parse_size


def add_engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    g.add_argument("--dtype", choices=DTYPES, default="auto")
    g.add_argument("--device", default="auto", help="auto (cuda if available), cpu, cuda, cuda:N")
    g.add_argument("--load-format", choices=LOAD_FORMATS, default="auto",
                   help="dummy = random weights of the model's shape (benchmarks)")
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--max-num-seqs", type=int, default=256)
    g.add_argument("--max-num-batched-tokens", type=int, default=2048)
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--num-kv-blocks", type=int, default=None, help="fix the KV cache size in blocks")
    g.add_argument("--kv-cache-memory", type=parse_size, default=1 << 30, help="KV cache bytes on the CPU")
    g.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    g.add_argument("--quantization", choices=["bitsandbytes-int8", "bitsandbytes-nf4"], default=None)
    g.add_argument("--quantize-embeddings", action="store_true", default=None,
                   help="with --quantization: also quantize the embeddings and lm_head")
    g.add_argument("--attention-backend", choices=["auto", "torch", "triton"], default="auto")
    g.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    g.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                   help="schedule the next step while the device runs this one (default: on for CUDA)")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--tokenizer", default=None,
                   help="load the tokenizer (and chat template) from this directory instead of the model's")
    g.add_argument("--threads", type=int, default=None,
                   help="CPU threads for the model's math (default: torch's, one per core; on a machine "
                        "shared with other work, fewer is often faster)")
    s = p.add_argument_group("speculative decoding")
    s.add_argument("--speculative-config", default=None,
                   help='JSON, e.g. \'{"method": "ngram", "num_speculative_tokens": 3}\'')
    s.add_argument("--draft-model", default=None,
                   help="a draft model path, or self / self-int8 / self-nf4 (the target's weights)")
    s.add_argument("--num-speculative-tokens", type=int, default=None)
    s.add_argument("--draft-quantization", choices=["bitsandbytes-int8", "bitsandbytes-nf4"], default=None)
    s.add_argument("--draft-load-format", choices=LOAD_FORMATS, default=None)


ENGINE_DESTS = ["dtype", "device", "load_format", "max_model_len", "max_num_seqs", "max_num_batched_tokens",
                "block_size", "num_kv_blocks", "kv_cache_memory", "gpu_memory_utilization",
                "enable_prefix_caching", "quantization", "quantize_embeddings", "attention_backend",
                "enforce_eager", "async_scheduling", "seed", "threads", "tokenizer", "speculative_config",
                "draft_model", "num_speculative_tokens", "draft_quantization", "draft_load_format"]


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    return {k: getattr(args, k) for k in ENGINE_DESTS if hasattr(args, k)}


def cmd_generate(args: argparse.Namespace) -> int:
    from specserve.sampling_params import SamplingParams

    # bad sampling flags fail here, before the model loads
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, max_tokens=args.max_tokens,
                            seed=args.sample_seed)
    from specserve.llm import LLM

    llm = LLM(args.model, **engine_kwargs(args))
    if args.raw or llm.tokenizer is None or not getattr(llm.tokenizer, "chat_template", None):
        outs = llm.generate(args.prompt, params)
    else:
        outs = llm.chat([{"role": "user", "content": args.prompt}], params)
    print(outs[0].outputs[0].text.strip())
    return 0


def cmd_pull(args: argparse.Namespace) -> int:
    from specserve.models.default_model import pull

    print(pull(force=args.force))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specserve", description=__doc__.splitlines()[0])
    parser.add_argument("--log-level", default="WARNING")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text for one prompt (chat template applied)")
    gen.add_argument("prompt")
    gen.add_argument("--model", default=None, help="HF model dir or .gguf (default: SmolLM2-135M-Instruct)")
    gen.add_argument("--max-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--sample-seed", type=int, default=None)
    gen.add_argument("--raw", action="store_true", help="no chat template: continue the prompt")
    add_engine_args(gen)
    gen.set_defaults(func=cmd_generate)

    pull = sub.add_parser("pull", help="fetch and convert the default model (SmolLM2-135M-Instruct)")
    pull.add_argument("--force", action="store_true")
    pull.set_defaults(func=cmd_pull)

    for register in _optional_commands():
        register(sub)
    return parser


def _optional_commands():
    """Subcommands that live with their part of the package (server, client, bench)."""
    out = []
    try:
        from specserve.server.cli import register as register_serve
        out.append(register_serve)
    except ImportError:
        pass
    try:
        from specserve.client.repl import register as register_chat
        out.append(register_chat)
    except ImportError:
        pass
    return out


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except (ValueError, RuntimeError) as e:
        print(f"specserve: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
