"""What a dormant EAGLE policy saves a decode step: the target's forward without the head's fused
feature (docs/speculative.md, "Dormant"). One engine with a head that fuses target layers decodes
`--concurrency` requests; its plans are forced to draft nothing (as adaptive k does at high
concurrency), so after `dormant_after` steps the policy is dormant. Blocks of `--block` steps then
alternate between dormancy on and off (`dormant_after` huge: every step computes the feature), in
one process, with the off blocks also timed against each other (A/A). Reports the median step time
of each variant and the median of the per-round ratios. (Under async scheduling every step is left in
flight; with synchronous steps, the CPU default, each plans and drafts nothing.)

    python bench/dormant_steps.py                                   # CPU, default model, shipped head
    python bench/dormant_steps.py --device cuda --load-format dummy --model llama-3.1-8b --eagle dummy3
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from specserve import LLM, SamplingParams


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--load-format", default="auto")
    ap.add_argument("--eagle", default=None,
                    help="a head directory (default: the shipped head); dummy3 with dummy weights")
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--block", type=int, default=4, help="steps per block")
    ap.add_argument("--rounds", type=int, default=20, help="rounds of (on, off, off) blocks")
    ap.add_argument("--out", default=None, help="a .json path")
    args = ap.parse_args()
    spec = {"method": "eagle3" if args.eagle == "dummy3" else "eagle", "num_speculative_tokens": 4}
    if args.eagle is not None:
        spec["model"] = args.eagle
    if args.load_format == "dummy":
        spec.update(load_format="dummy", simulated_acceptance=[0.5])
    steps_needed = 64 + args.rounds * 3 * args.block + 16
    llm = LLM(args.model, device=args.device, dtype=args.dtype, load_format=args.load_format,
              max_num_seqs=args.concurrency, max_model_len=args.prompt_len + steps_needed + 16,
              speculative_config=spec)
    engine = llm.engine
    policy = engine.proposer.policy
    # no drafts, and (async scheduling) every step left in flight, as where adaptive k finds none worth
    # trying: dormant after dormant_after steps
    policy.plan = lambda rooms, *a, **kw: dict.fromkeys(rooms, 0)
    engine.proposer.idle = lambda sched: True
    params = SamplingParams(temperature=0.0, max_tokens=steps_needed, ignore_eos=True)
    for i in range(args.concurrency):
        prompt = [(i * 7919 + j * 104729) % 30000 + 3 for j in range(args.prompt_len)]
        engine.add_request(f"r{i}", {"prompt_token_ids": prompt}, params)
    dormant_after = policy.dormant_after
    for _ in range(dormant_after + 8):  # prefill, then dormant
        engine.step()
    assert policy.dormant()

    def sync() -> None:
        if args.device == "cuda":
            torch.cuda.synchronize()

    def block(dormancy: bool) -> float:
        """The mean step time of a block (steps left in flight overlap within it, as in serving)."""
        policy.dormant_after = dormant_after if dormancy else 10 ** 9
        engine.step()  # the switch's step (a step in flight may straddle it) is not timed
        sync()
        t = time.perf_counter()
        for _ in range(args.block):
            engine.step()
        sync()
        return (time.perf_counter() - t) / args.block

    on, off, off2 = [], [], []
    for r in range(args.rounds):
        order = [(on, True), (off, False), (off2, False)] if r % 2 else [(off, False), (off2, False), (on, True)]
        for sink, dormancy in order:
            sink.append(block(dormancy))
    ratios = [b / a for a, b in zip(on, off)]
    control = [b / a for a, b in zip(off2, off)]
    q = lambda xs: [round(x, 4) for x in statistics.quantiles(xs, n=4)]  # noqa: E731
    dtype = next(engine.loaded.model.parameters()).dtype
    result = {"args": vars(args), "dtype": str(dtype), "threads": torch.get_num_threads(),
              "step_ms_dormant": round(1e3 * statistics.median(on), 3),
              "step_ms_feature": round(1e3 * statistics.median(off), 3),
              "feature_over_dormant": round(statistics.median(ratios), 4), "quartiles": q(ratios),
              "aa_control": round(statistics.median(control), 4), "aa_quartiles": q(control)}
    print(json.dumps(result, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
