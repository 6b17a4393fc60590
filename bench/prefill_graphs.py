"""One request's time to first token with and without prefill CUDA graphs (engine/cuda_graphs.py), in
one engine, the two alternating per prompt so both see the same machine.

    python bench/prefill_graphs.py --device cuda --load-format dummy --model smollm2-135m \
        --prompt-lens 20 50 100 150 250 400 600 --reps 7 --out prefill_s135.json

Each measurement is one `generate` of a fresh prompt (no prefix-cache hit) with max_tokens=1: the
prefill step, its sampled token and the engine's bookkeeping. "eager" hides the prefill graphs
(`DecodeGraphs.prefill_lens = ()`), as the engine ran before them; decode graphs stay in both.
Reported: the median per prompt length, and eager / graphs.
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import torch

from specserve import LLM, SamplingParams


def first_token_seconds(llm: LLM, prompt: list[int]) -> float:
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    if llm.engine.device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    llm.generate([{"prompt_token_ids": prompt}], params)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--load-format", default="dummy")
    ap.add_argument("--prompt-lens", type=int, nargs="+", default=[20, 50, 100, 150, 250, 400, 600])
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    max_len = max(args.prompt_lens) + 64
    llm = LLM(args.model, dtype=args.dtype, device=args.device, load_format=args.load_format, max_num_seqs=1,
              max_model_len=max_len)
    graphs = llm.engine.runner.graphs
    if graphs is None or not graphs.prefill_lens:
        raise SystemExit("no prefill graphs were captured (CUDA with the triton backend, not enforce_eager)")
    captured = graphs.prefill_lens
    rng = random.Random(0)
    vocab = llm.engine.loaded.arch.vocab_size
    times: dict[str, dict[int, list[float]]] = {"graphs": {}, "eager": {}}
    for n in args.prompt_lens:
        for _ in range(2):  # warm: each shape's first eager GEMMs pick their kernels
            for mode in ("graphs", "eager"):
                graphs.prefill_lens = captured if mode == "graphs" else ()
                first_token_seconds(llm, [rng.randrange(3, vocab) for _ in range(n)])
        for _ in range(args.reps):
            for mode in ("graphs", "eager"):
                graphs.prefill_lens = captured if mode == "graphs" else ()
                times[mode].setdefault(n, []).append(first_token_seconds(llm, [rng.randrange(3, vocab) for _ in range(n)]))
    graphs.prefill_lens = captured
    rows = []
    for n in args.prompt_lens:
        g, e = statistics.median(times["graphs"][n]), statistics.median(times["eager"][n])
        rows.append({"prompt_len": n, "graphs_ms": round(1e3 * g, 3), "eager_ms": round(1e3 * e, 3),
                     "eager_over_graphs": round(e / g, 2)})
        print(f"{n:5d} tokens: graphs {1e3 * g:7.2f} ms  eager {1e3 * e:7.2f} ms  x{e / g:.2f}", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "prefill_lens": list(captured), "rows": rows,
                       "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu"}, f, indent=1)


if __name__ == "__main__":
    main()
