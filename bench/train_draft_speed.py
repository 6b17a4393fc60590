"""How fast `specserve train-draft` takes steps, phase by phase, on a dummy target of a real shape
(random weights: speed only) and synthetic conversations of chat-like lengths.

    python bench/train_draft_speed.py --model smollm2-135m --device cuda --steps 20 [--profile]

Per step (the trainer's own code, specserve/spec_decode/train.py): the target's ragged forward and
labels (`TargetFeatures.labelled_batch`), the head's forward + backward (`_accumulate`), the
optimizer. Each phase is timed with the device synchronized at its end, so the phases add up to a
step; `tokens/s` is the step's tokens over the median step time. --profile adds torch.profiler's
top operators by device time for one step.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time

import numpy as np
import torch

from specserve.models.loader import load_model
from specserve.spec_decode import train
from specserve.spec_decode.train_data import Sequence
from specserve.spec_decode.train_target import TargetFeatures


def synthetic(num: int, vocab: int, seed: int, mean_len: int, max_len: int) -> list[Sequence]:
    """Conversations with a geometric-ish length spread around mean_len (a prompt, then an answer:
    the second part of each is labelled)."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(num):
        n = int(min(max_len, max(32, rng.exponential(mean_len))))
        ids = rng.integers(0, vocab, n, dtype=np.int32)
        labels = np.zeros(n, dtype=bool)
        labels[n // 4:n - 1] = True
        out.append(Sequence(ids, labels))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m", help="a shipped shape or config.json (dummy weights)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--mean-len", type=int, default=500)
    ap.add_argument("--max-len", type=int, default=2048)
    ap.add_argument("--depth", type=int, default=4)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--out", help="write the numbers as JSON here")
    args = ap.parse_args()
    device = torch.device(args.device)
    loaded = load_model(args.model, dtype=args.dtype, device=device, load_format="dummy", max_positions=args.max_len)
    loaded.model.requires_grad_(False)
    vocab = loaded.arch.vocab_size
    draft_vocab = torch.arange(min(8192, vocab))
    head = train.build_head(loaded, draft_vocab, args.max_len, "last-layer", device, 0)
    optimizer = torch.optim.AdamW(head.parameters(), lr=1e-4, betas=(0.9, 0.95))
    features = TargetFeatures(loaded, device, args.max_len, draft_vocab.to(device), args.batch_size)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else contextlib.nullcontext()
    seqs = synthetic(args.batch_size * (args.steps + 2), vocab, 0, args.mean_len, args.max_len)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()

    def step(batch: list[Sequence]) -> dict[str, float]:
        times = {}
        t0 = time.perf_counter()
        labelled = features.labelled_batch(batch)
        sync()
        times["target"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        train._accumulate(head, features, batch, autocast, args.depth, labelled=labelled)
        sync()
        times["head"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        sync()
        times["optimizer"] = time.perf_counter() - t0
        return times

    batches = [seqs[i:i + args.batch_size] for i in range(0, len(seqs), args.batch_size)]
    for b in batches[:2]:  # warm-up (kernel compiles, allocator)
        step(b)
    rows = []
    for b in batches[2:]:
        t = step(b)
        t["tokens"] = sum(len(s.token_ids) for s in b)
        rows.append(t)
    med = {k: statistics.median(r[k] for r in rows) for k in ("target", "head", "optimizer")}
    total = statistics.median(r["target"] + r["head"] + r["optimizer"] for r in rows)
    tokens = statistics.median(r["tokens"] for r in rows)
    result = {"model": args.model, "device": str(device), "dtype": args.dtype, "batch_size": args.batch_size,
              "mean_len": args.mean_len, "depth": args.depth, "steps": len(rows),
              "median_step_s": round(total, 4), "median_tokens_per_step": tokens,
              "tokens_per_s": round(sum(r["tokens"] for r in rows) /
                                    sum(r["target"] + r["head"] + r["optimizer"] for r in rows), 1),
              "phase_median_s": {k: round(v, 4) for k, v in med.items()}}
    print(json.dumps(result, indent=2))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        with profile(activities=activities) as prof:
            step(batches[-1])
        key = "cuda_time_total" if device.type == "cuda" else "cpu_time_total"
        print(prof.key_averages().table(sort_by=key, row_limit=30))
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20))
        print("operator calls in one step:", sum(e.count for e in prof.key_averages()))


if __name__ == "__main__":
    main()
