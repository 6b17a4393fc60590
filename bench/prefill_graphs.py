"""Time to first token with and without prefill CUDA graphs (engine/cuda_graphs.py), in one engine,
the two alternating per prompt so both see the same machine.

    python bench/prefill_graphs.py --device cuda --load-format dummy --model smollm2-135m \
        --prompt-lens 20 50 100 150 250 400 600 --reps 7 --out prefill_s135.json
    python bench/prefill_graphs.py ... --decoding 15    # admissions beside 15 decoding requests

Each measurement adds a fresh prompt (no prefix-cache hit) with max_tokens=1 and steps the engine
until it finishes: its prefill step, its sampled token and the engine's bookkeeping (with
`--decoding N`, N other requests decode meanwhile, as in a server: the prompt's step is an
admission). "eager" hides the prefill graphs (`StepGraphs.prefill_lens = ()`), as the engine ran
before them; decode graphs stay in both. Reported: the median per prompt length, and eager / graphs.
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import torch

from specserve import LLM, SamplingParams


def first_token_seconds(llm: LLM, prompt: list[int], request_id: str) -> float:
    engine = llm.engine
    if engine.device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    engine.add_request(request_id, {"prompt_token_ids": prompt}, SamplingParams(temperature=0.0, max_tokens=1))
    while not any(o.request_id == request_id and o.finished for o in engine.step()):
        pass
    return time.perf_counter() - t0


def keep_decoding(llm: LLM, num: int, vocab: int, rng: random.Random) -> None:
    """Top up the background requests to `num` decoding ones (each runs for hundreds of steps)."""
    engine = llm.engine
    running = [r for r in engine.groups if r.startswith("bg")]
    for i in range(num - len(running)):
        prompt = [rng.randrange(3, vocab) for _ in range(16)]
        engine.add_request(f"bg{time.monotonic_ns()}-{i}", {"prompt_token_ids": prompt},
                           SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True))
    while any(r.num_output_tokens == 0 for r in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--load-format", default="dummy")
    ap.add_argument("--prompt-lens", type=int, nargs="+", default=[20, 50, 100, 150, 250, 400, 600])
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--decoding", type=int, default=0, help="requests decoding beside each prompt")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    max_len = max(args.prompt_lens) + 480
    llm = LLM(args.model, dtype=args.dtype, device=args.device, load_format=args.load_format,
              max_num_seqs=1 + args.decoding, max_model_len=max_len)
    graphs = llm.engine.runner.graphs
    if graphs is None or not graphs.prefill_lens:
        raise SystemExit("no prefill graphs were captured (CUDA with the triton backend, not enforce_eager)")
    captured = graphs.prefill_lens
    rng = random.Random(0)
    vocab = llm.engine.loaded.arch.vocab_size
    times: dict[str, dict[int, list[float]]] = {"graphs": {}, "eager": {}}
    count = 0
    for n in args.prompt_lens:
        for rep in range(2 + args.reps):  # two to warm up: each shape's first eager GEMMs pick their kernels
            for mode in ("graphs", "eager"):
                keep_decoding(llm, args.decoding, vocab, rng)
                graphs.prefill_lens = captured if mode == "graphs" else ()
                count += 1
                seconds = first_token_seconds(llm, [rng.randrange(3, vocab) for _ in range(n)], f"p{count}")
                graphs.prefill_lens = captured
                if rep >= 2:
                    times[mode].setdefault(n, []).append(seconds)
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
