"""Where a closed-loop run's time goes, with and without speculation: every `engine.step()` of a run
of `--requests` requests at `--concurrency` is timed and classified:

- `prefill`: a prompt chunk was scheduled (a request admitted: its step runs eagerly, not from a
  CUDA graph);
- `draft-graph` / `draft-eager`: drafts were verified, and the EAGLE head's catch-up for the next
  drafts ran from its CUDA graph or eagerly (`draft-none`: no head forward);
- `plain`: no drafts;
- `-tail`: fewer requests were scheduled than the concurrency.

Per class: steps, milliseconds in all, milliseconds per step. Dummy weights, random prompts.

    python bench/spec_steps.py --device cuda --model smollm2-135m --concurrency 16 --no-adaptive \\
        --eagle-acceptance 0.5355 0.6409 0.6897 0.575
"""
from __future__ import annotations

import argparse
import collections
import json
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import spec_profile  # noqa: E402
from spec_decode import spread_params  # noqa: E402

from specserve import SamplingParams  # noqa: E402


def classified_run(llm, prompts: list[list[int]], concurrency: int, params: list[SamplingParams]) -> dict:
    """One closed-loop run; per step class [steps, ms, ms per step], and tokens/s."""
    eng = llm.engine
    flags: dict = {}
    proposer = eng.proposer
    restore = []
    if proposer is not None and getattr(proposer, "executor", None) is not None:
        ex = proposer.executor
        forward = ex.forward

        def head_forward(ids, positions, meta, **kw):
            flags["catch_up"] = "graph" if ex.graphs is not None and ex.graphs.can_run(meta) else "eager"
            return forward(ids, positions, meta, **kw)
        ex.forward = head_forward
        restore.append(lambda: delattr(ex, "forward"))
    schedule = eng.scheduler.schedule

    def classify_schedule():
        out = schedule()
        flags["prefill"] = any(s.num_tokens > 1 + len(s.spec_token_ids) for s in out.scheduled)
        flags["n"], flags["drafts"] = len(out.scheduled), sum(len(s.spec_token_ids) for s in out.scheduled)
        return out
    eng.scheduler.schedule = classify_schedule
    restore.append(lambda: delattr(eng.scheduler, "schedule"))
    classes = collections.defaultdict(lambda: [0, 0.0])
    pending, in_flight, num_out = list(enumerate(prompts)), 0, 0
    t0 = time.perf_counter()
    try:
        while pending or eng.has_unfinished():
            while pending and in_flight < concurrency:
                i, p = pending.pop(0)
                eng.add_request(f"s{time.monotonic_ns()}-{i}", {"prompt_token_ids": p}, params[i])
                in_flight += 1
            flags.clear()
            t = time.perf_counter()
            outs = eng.step()
            dt = time.perf_counter() - t
            for o in outs:
                if o.finished:
                    in_flight -= 1
                    num_out += len(o.outputs[0].token_ids)
            if flags.get("prefill"):
                kind = "prefill"
            elif flags.get("drafts"):
                kind = "draft-" + flags.get("catch_up", "none")
            else:
                kind = "plain"
            kind += "" if flags.get("n", 0) >= concurrency else "-tail"
            classes[kind][0] += 1
            classes[kind][1] += dt
    finally:
        for undo in restore:
            undo()
    elapsed = time.perf_counter() - t0
    return {"tokens_per_s": round(num_out / elapsed, 1), "elapsed_s": round(elapsed, 3),
            "classes": {k: [n, round(1000 * s, 1), round(1000 * s / n, 3)] for k, (n, s) in sorted(classes.items())}}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--eagle", default="dummy", help="dummy (dummy3: fusing target layers) or a head directory")
    ap.add_argument("--eagle-acceptance", type=float, nargs="+", default=[0.6],
                    help="acceptance per draft position (BENCHMARK-ONLY replay)")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--no-adaptive", action="store_true")
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--requests", type=int, default=0, help="per run (default: 3 x concurrency)")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--length-spread", type=float, default=0.0,
                    help="request i stops after max_tokens x (1 - spread x u_i) tokens (u_i uniform, fixed seed)")
    ap.add_argument("--runs", type=int, default=3, help="per engine; the first is a warm-up, not reported")
    ap.add_argument("--out", default=None, help="a .json path")
    args = ap.parse_args()
    args.steps = (args.max_tokens + 8) // (args.k + 1)  # spec_profile.build sizes max_model_len from these
    args.concurrency = [args.concurrency]
    spec = {"method": "eagle", "model": args.eagle, "num_speculative_tokens": args.k, "adaptive": not args.no_adaptive,
            "load_format": "dummy", "simulated_acceptance": args.eagle_acceptance}
    args.load_format = "dummy"
    c = args.concurrency[0]
    num = args.requests or 3 * c
    rng = random.Random(0)
    params = spread_params(args.max_tokens, args.length_spread, True, num)
    results = {"args": vars(args), "runs": {}}
    for name, config in (("none", None), ("eagle", spec)):
        llm = spec_profile.build(args, config)
        vocab = llm.engine.loaded.arch.vocab_size
        for run in range(args.runs):
            prompts = [[rng.randrange(10, min(vocab, 32000)) for _ in range(args.prompt_len)] for _ in range(num)]
            row = classified_run(llm, prompts, c, params)
            if run > 0:
                results["runs"].setdefault(name, []).append(row)
                print(name, run, json.dumps(row), flush=True)
        llm.shutdown()
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
