"""Host overhead of speculation at high concurrency: a tiny random Llama (2 layers, where the
model's compute is small, as a small target's is on a GPU) with a random EAGLE head of its shape,
256 requests x 32 greedy tokens, with and without the head, on the CPU. A random head accepts
nothing, so adaptive k drafts (almost) nothing: the difference is the proposer's per-step work
(the catch-up forward and its bookkeeping, adaptive k's plan).

    python bench/spec_host_overhead.py [--profile]
"""
from __future__ import annotations

import argparse
import cProfile
import pstats
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from specserve import LLM, SamplingParams  # noqa: E402
from specserve.spec_decode.eagle_head import save_head  # noqa: E402
from tests.conftest import build_tiny_model  # noqa: E402
from tests.spec_decode.test_eagle import _random_head, _target  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--profile", action="store_true", help="print the proposer's functions by cumulative time")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp())
    target = build_tiny_model("llama", work / "tiny", seed=0)
    head = save_head(_random_head(_target(target), seed=3, scale=0.05), work / "head")
    rng = random.Random(0)
    prompts = [{"prompt_token_ids": [rng.randrange(10, 300) for _ in range(64)]} for _ in range(args.requests)]
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    for name, spec in [("none", None), ("eagle", dict(method="eagle", model=str(head), num_speculative_tokens=4))]:
        llm = LLM(str(target), dtype="float32", device="cpu", max_num_seqs=args.requests, num_kv_blocks=4096,
                  max_model_len=256, speculative_config=spec, enable_prefix_caching=False)
        llm.generate(prompts[:8], params)
        prof = cProfile.Profile() if args.profile and spec else None
        t0 = time.perf_counter()
        if prof:
            prof.enable()
        llm.generate(prompts, params)
        if prof:
            prof.disable()
        print(f"{name}: {time.perf_counter() - t0:.2f} s, drafts {llm.engine.stats()['spec_decode_num_drafts']}")
        if prof:
            pstats.Stats(prof).sort_stats("cumulative").print_stats("spec_decode", 15)


if __name__ == "__main__":
    main()
