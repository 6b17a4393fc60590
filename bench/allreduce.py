"""All-reduce cost of one tensor-parallel decode step, from a process group like the engine's.

    python bench/allreduce.py --tensor-parallel-size 2 --out bench/results/allreduce_tp2.json
    python bench/allreduce.py --tensor-parallel-size 2 --device cpu --iters 20 --out r.json  # gloo

One decode step of a Llama-family model all-reduces 2 * num_layers + 1 tensors of
[batch, hidden_size] in the model's dtype (o_proj and down_proj per layer, the embedding once); the
LM head's logits are gathered to rank 0 once. For each batch size this times one all-reduce of that
size eagerly and replayed from a CUDA graph (as the engine's decode graphs run them), and the
gather, and reports the sum per step next to nothing else: the batch-1 cost of TP that the
end-to-end numbers (bench/gpu_e2e.py) include. The groups come from specserve/distributed/state.py
(NCCL with NCCL_NVLS_ENABLE=0 on GPUs, gloo on the CPU), one process per device, spawned.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from timing import median_seconds  # noqa: E402

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def _time(fn, iters: int, device: torch.device) -> float:
    """Median seconds of `fn`; the ranks start each call together."""
    return median_seconds(fn, iters, device, before_each=dist.barrier)


def _rank(rank: int, args, rendezvous: str, out: str) -> None:
    from specserve.distributed.state import destroy_tp_group, init_tp_group, rank_device

    device = rank_device(torch.device(args.device), rank)
    group = init_tp_group(rank, args.tensor_parallel_size, device, rendezvous, 120.0)
    dtype = DTYPES[args.dtype]
    rows = []
    for batch in args.batches:
        x = torch.randn(batch, args.hidden_size, dtype=dtype, device=device)
        row = {"batch": batch, "bytes": x.numel() * x.element_size()}
        row["allreduce_us"] = _time(lambda: group.all_reduce(x), args.iters, device) * 1e6  # noqa: B023
        if device.type == "cuda":
            graph = torch.cuda.CUDAGraph()
            group.all_reduce(x)
            torch.cuda.synchronize()
            with torch.cuda.graph(graph):
                for _ in range(args.graph_reps):
                    group.all_reduce(x)
            row["allreduce_graph_us"] = _time(graph.replay, args.iters, device) * 1e6 / args.graph_reps
        vocab = -(-args.vocab_size // group.size)
        logits = torch.randn(batch, vocab, dtype=dtype, device=device)
        parts = [torch.empty_like(logits) for _ in range(group.size)] if rank == 0 else None
        row["gather_logits_us"] = _time(lambda: dist.gather(logits, parts, dst=0, group=group.model),  # noqa: B023
                                        args.iters, device) * 1e6
        per = row.get("allreduce_graph_us", row["allreduce_us"])
        row["per_decode_step_us"] = (2 * args.num_layers + 1) * per + row["gather_logits_us"]
        rows.append(row)
    if rank == 0:
        res = {"tensor_parallel_size": group.size, "device": str(device),
               "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else "none",
               "dtype": args.dtype, "hidden_size": args.hidden_size, "num_layers": args.num_layers,
               "vocab_size": args.vocab_size, "torch": torch.__version__, "rows": rows,
               "command": " ".join(sys.argv)}
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(res, indent=2))
        print(json.dumps(res, indent=2))
    destroy_tp_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tensor-parallel-size", "-tp", type=int, default=2)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--model", default="llama-3.1-8b", help="a shipped shape (configs/models) for the sizes")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64, 128, 256])
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--graph-reps", type=int, default=65, help="all-reduces per captured graph (2 x 32 layers + 1)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    from specserve.models.loader import dummy_config_path
    from specserve.models.registry import load_arch_config

    arch = load_arch_config(dummy_config_path(args.model))
    args.hidden_size, args.num_layers, args.vocab_size = arch.hidden_size, arch.num_layers, arch.vocab_size
    from specserve.distributed.state import set_nccl_env

    set_nccl_env()
    with tempfile.TemporaryDirectory(prefix="specserve-allreduce-") as d:
        mp.spawn(_rank, args=(args, f"file://{d}/rendezvous", args.out), nprocs=args.tensor_parallel_size)


if __name__ == "__main__":
    main()
