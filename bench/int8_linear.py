"""The weight-only int8 linear kernel (kernels/int8_linear.py) against cuBLAS's bf16 GEMM on a draft
head's layer shapes, at the row counts of draft steps.

    python bench/int8_linear.py --out bench/results/int8_linear_gpu.json

Shapes (default: Llama-3.1-8B's decoder layer, as an EAGLE head for it has one, its fc / fuse maps
and a 32,768-row draft LM head). Each case times, in a CUDA graph of 20 calls (launch gaps left out),
bf16 `nn.functional.linear` and the int8 kernel, the calls cycling over copies of the weights that
together exceed the GPU's L2 cache (as a draft step's layers, each read once, do: `--l2-mb`);
achieved bandwidth = weight bytes / time;
`config`: the tiles the kernel timed fastest for the case (its own tuning, on first use).
Correctness: each case's int8 output against the fp32 oracle.

`--norm-before`: each call is an RMSNorm of the row(s) and then the product (bf16 and int8 alike), as a
head's qkv, gate_up and LM head follow a norm: on a GPU with programmatic dependent launch (kernels/pdl.py)
the product's programs then start during the norm and, with `SPECSERVE_INT8_PREFETCH=1`, prefetch their
first weight lines (`SPECSERVE_INT8_PREFETCH=1` against `=0`, the default, is that prefetch's A/B).
"""
from __future__ import annotations

import argparse
import json
import pathlib

import torch
from triton.testing import do_bench_cudagraph

from specserve.kernels.int8_linear import int8_linear, ref_int8_linear, timed_config
from specserve.kernels.rms_norm import rms_norm
from specserve.quant.int8_rows import quantize_int8_rows

ROOT = pathlib.Path(__file__).resolve().parents[1]
H, MLP, V = 4096, 14336, 32768  # hidden, MLP, draft vocabulary (Llama-3.1-8B's head)
SHAPES = {  # name: (N, K)
    "qkv": (H + 2 * 1024, H), "o": (H, H), "gate_up": (2 * MLP, H), "down": (H, MLP), "fc": (H, 2 * H),
    "fuse": (H, 3 * H), "lm_head": (V, H),
}


def timed(fn, reps: int = 20, rep_ms: int = 200) -> float:
    """ms per call: `reps` calls in one captured graph, median of do_bench_cudagraph."""
    def many():
        for _ in range(reps):
            fn()
    return do_bench_cudagraph(many, rep=rep_ms) / reps


def copies(t: torch.Tensor, l2_bytes: int) -> list[torch.Tensor]:
    """t and copies of it, together at least twice `l2_bytes`: cycled over, no call finds its weights in L2."""
    return [t] + [t.clone() for _ in range(-(-2 * l2_bytes // (t.numel() * t.element_size())) - 1)]


def cycled(fn, weights: list) -> callable:
    """fn(w) on the next of `weights` each call."""
    turn = [0]

    def call():
        turn[0] = (turn[0] + 1) % len(weights)
        return fn(weights[turn[0]])
    return call


def case(name: str, w: torch.Tensor, m: int, l2_bytes: int, norm_before: bool = False) -> dict:
    """One shape at m rows: the row of the results table."""
    n, k = w.shape
    q, s = quantize_int8_rows(w)
    x = torch.randn(m, k, device=w.device, dtype=w.dtype)
    ref = ref_int8_linear(x, q, s).float()
    ws, qs = copies(w, l2_bytes), copies(q, l2_bytes)
    gain = torch.ones(k, device=w.device, dtype=w.dtype)
    inp = (lambda: rms_norm(x, gain, 1e-5)) if norm_before else (lambda: x)
    row = {"shape": name, "N": n, "K": k, "M": m,
           "max_err": (int8_linear(x, q, s).float() - ref).abs().max().item(), "ref_max": ref.abs().max().item(),
           "bf16_ms": timed(cycled(lambda w_: torch.nn.functional.linear(inp(), w_), ws)),
           "int8_ms": timed(cycled(lambda q_: int8_linear(inp(), q_, s), qs))}
    row["config"] = timed_config(m, n, k, x.dtype)
    row["bf16_gbps"] = round(n * k * 2 / row["bf16_ms"] / 1e6, 1)
    row["int8_gbps"] = round(n * k / row["int8_ms"] / 1e6, 1)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 5, 16, 64])
    ap.add_argument("--out", default=str(ROOT / "bench/results/int8_linear_gpu.json"))
    ap.add_argument("--l2-mb", type=float, default=50, help="the GPU's L2 cache (H100 / H200: 50 MB); 0 = one "
                    "copy of the weights, which a small layer's calls then find in L2")
    ap.add_argument("--tensor-cores-only", action="store_true", help="time the tensor-core kernel's tiles alone, "
                    "also for one row (the one-row kernel left out: the code before it, for an A/B in one call)")
    ap.add_argument("--norm-before", action="store_true", help="an RMSNorm before each product (timed with it)")
    args = ap.parse_args()
    if args.tensor_cores_only:
        import specserve.kernels.int8_linear as kernel
        kernel.GEMV_CANDIDATES = ()
    dev = torch.device("cuda")
    torch.manual_seed(0)
    out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "l2_mb": args.l2_mb,
           "tensor_cores_only": args.tensor_cores_only, "norm_before": args.norm_before, "cases": []}
    for name, (n, k) in SHAPES.items():
        w = torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02
        for m in args.rows:
            row = case(name, w, m, int(args.l2_mb * 2**20), args.norm_before)
            print(json.dumps(row), flush=True)
            out["cases"].append(row)
    total = {m: (sum(r["bf16_ms"] for r in out["cases"] if r["M"] == m and r["shape"] != "fuse"),
                 sum(r["int8_ms"] for r in out["cases"] if r["M"] == m and r["shape"] != "fuse"))
             for m in args.rows}
    out["draft_step_ms"] = {m: {"bf16": round(b, 4), "int8": round(i, 4), "ratio": round(i / b, 3)}
                            for m, (b, i) in total.items()}
    print("a draft step's GEMMs (qkv, o, gate_up, down, fc, lm_head), ms:", json.dumps(out["draft_step_ms"]))
    pathlib.Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    pathlib.Path(args.out).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
