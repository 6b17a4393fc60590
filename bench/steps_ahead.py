"""How many of a drafting run's steps async drafting launches ahead of their predecessor's tokens, on the
default model with its shipped EAGLE head, on a CPU: the CUDA path (drafting on the device, async
scheduling, async drafting) run eagerly, so the count is the scheduler's and the proposer's, not a GPU's.
Held-out ShareGPT prompts (records after `--sharegpt-skip`), `--requests` of them with at most
`--concurrency` running, `--max-tokens` each (ignore_eos), k forced unless `--adaptive`. Prints and
writes the launches by kind (ahead: `Scheduler.schedule_ahead`; other: a prefill, an admission, a step
after one held back, a synchronous one) and the drafts' acceptance.

    PYTHONPATH=/tmp/sg python bench/steps_ahead.py --concurrency 16 --requests 32 --out bench/results/steps_ahead
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

from prompts import sharegpt_conversations  # noqa: E402

from specserve import LLM, SamplingParams  # noqa: E402
from specserve.engine.intake import PromptError  # noqa: E402
from specserve.models.default_model import ensure_default_model  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--max-prompt-len", type=int, default=400)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--adaptive", action="store_true", help="adaptive k (timed on this CPU: not a GPU's plans)")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--sharegpt-skip", type=int, default=8000)
    ap.add_argument("--out", help="path without suffix: writes .json")
    args = ap.parse_args()

    llm = LLM(str(ensure_default_model()), dtype=args.dtype, device="cpu", max_num_seqs=args.concurrency,
              max_model_len=args.max_prompt_len + args.max_tokens + 64, async_scheduling=True, async_drafting=True,
              speculative_config={"method": "eagle", "num_speculative_tokens": args.k, "adaptive": args.adaptive})
    eng = llm.engine
    eng.proposer.drafts_on_device = True  # the CUDA path, eagerly (as the tests run it)
    launches = collections.Counter()
    launch = eng.runner.launch

    def counted(sched, prev=None, defer=False, ahead_of=None):
        launches["ahead" if ahead_of is not None else "other"] += 1
        return launch(sched, prev, defer, ahead_of)

    eng.runner.launch = counted
    prompts = []
    for question, _ in sharegpt_conversations(limit=20 * args.requests, skip=args.sharegpt_skip):
        try:
            prompt = eng.intake.chat([{"role": "user", "content": question}])
        except PromptError:
            continue
        if len(prompt.token_ids) <= args.max_prompt_len:
            prompts.append(prompt)
        if len(prompts) == args.requests:
            break
    llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True))
    stats = eng.stats()
    result = {"args": vars(args), "launches": dict(launches),
              "ahead_share": round(launches["ahead"] / sum(launches.values()), 3),
              "num_ahead_steps": stats["num_ahead_steps"],
              "draft_tokens": stats["spec_decode_num_draft_tokens"],
              "accepted_tokens": stats["spec_decode_num_accepted_tokens"]}
    print(json.dumps(result))
    if args.out:
        with open(args.out + ".json", "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
