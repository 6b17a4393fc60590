"""CPU linear layers: nn.functional.linear (torch's BLAS) against oneDNN over a weight reordered once
(specserve/models/layers/cpu_linear.py), on the default model's shapes at the batch sizes decoding
meets (1 token, and the 2-5 tokens of a verification), then the default model's whole forward the
same way (one engine per variant, the same process, rounds alternating).

    python bench/cpu_linear.py --out bench/results/cpu_linear

Reports medians of per-call milliseconds; "x" = torch / oneDNN (above 1: oneDNN is faster), and for
each variant the cost of an M-token call in 1-token calls (the number speculation's verification
pays for M - 1 drafts).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from specserve.models.layers.cpu_linear import ENV_SWITCH, PackedLinear  # noqa: E402

# SmolLM2-135M: qkv, o, gate_up, down, LM head (tied, 49152 rows)
SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536), "lm_head": (49152, 576)}
BATCHES = (1, 2, 3, 5, 9, 17)


def _median_ms(fn, iters: int) -> float:
    fn()
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def layers(dtype: torch.dtype, iters: int) -> dict:
    out = {}
    for name, (n, k) in SHAPES.items():
        w = torch.randn(n, k).to(dtype)
        packed = PackedLinear(w)
        rows = {}
        for m in BATCHES:
            x = torch.randn(m, k).to(dtype)
            reps = max(3, iters // 10) if name == "lm_head" else iters
            t_torch = _median_ms(lambda x=x, w=w: torch.nn.functional.linear(x, w), reps)
            t_dnn = _median_ms(lambda x=x, packed=packed: packed(x), reps)
            rows[m] = {"torch_ms": round(t_torch, 4), "onednn_ms": round(t_dnn, 4), "x": round(t_torch / t_dnn, 2)}
        out[name] = rows
    return out


def forwards(dtype: str, rounds: int) -> dict:
    """The default model's forward over M tokens of one request (the engine's executor), per variant."""
    from specserve import LLM

    engines = {}
    for variant in ("torch", "onednn"):
        os.environ[ENV_SWITCH] = variant
        engines[variant] = LLM(dtype=dtype, enable_prefix_caching=False)
    os.environ.pop(ENV_SWITCH)
    times: dict[str, dict[int, list[float]]] = {v: {m: [] for m in BATCHES[:4]} for v in engines}
    for _ in range(rounds):
        for variant, llm in engines.items():
            ex = llm.engine.runner.target
            for m in BATCHES[:4]:
                times[variant][m].append(_forward_ms(ex, m))
    res = {}
    for variant, per_m in times.items():
        med = {m: statistics.median(v) for m, v in per_m.items()}
        res[variant] = {"ms": {m: round(t, 2) for m, t in med.items()},
                        "in_1_token_forwards": {m: round(t / med[1], 2) for m, t in med.items()}}
    res["x_one_token"] = round(res["torch"]["ms"][1] / res["onednn"]["ms"][1], 2)
    return res


@torch.inference_mode()
def _forward_ms(ex, m: int) -> float:
    """One forward of M new tokens after a 64-token context (one request), and the logits of all M
    rows (what a verification computes), in ms."""
    n = 64 + m
    table = list(range(-(-n // ex.block_size)))  # the first blocks: the engine is idle
    t = time.perf_counter()
    ex.compute_logits(ex.forward_tokens(list(range(100, 100 + m)), [m], [n], [table]))
    return (time.perf_counter() - t) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    result = {"machine": {"cpu": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
                          "torch": torch.__version__, "bf16_native": torch.ops.mkldnn._is_mkldnn_bf16_supported()}}
    dtypes = ["float32"] + (["bfloat16"] if result["machine"]["bf16_native"] else [])
    for dtype in dtypes:
        result[f"layers_{dtype}"] = layers(getattr(torch, dtype), args.iters)
        result[f"forward_{dtype}"] = forwards(dtype, args.rounds)
        print(f"== {dtype}")
        for name, rows in result[f"layers_{dtype}"].items():
            print(f"  {name:8s} " + "  ".join(f"M={m}: {r['torch_ms']:.3f}/{r['onednn_ms']:.3f} ms ({r['x']}x)"
                                          for m, r in rows.items()))
        f = result[f"forward_{dtype}"]
        for variant in ("torch", "onednn"):
            row = f[variant]
            print(f"  forward {variant:6s} ms {row['ms']}  in 1-token forwards {row['in_1_token_forwards']}")
        print(f"  one-token forward: oneDNN {f['x_one_token']}x faster")
    if args.out:
        Path(args.out + ".json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
