"""`specserve serve | generate | chat | pull`.

Engine flags follow `vllm serve`; every engine flag is also an engine argument of `LLM(...)`
(dashes become underscores).
"""
from __future__ import annotations

import argparse
import logging
import sys

# Only torch-free modules at the top: `specserve --help` and flag errors must not wait for torch;
# the command functions import the engine.
from specserve.engine_args import add_engine_args, engine_kwargs


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
