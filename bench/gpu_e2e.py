"""End-to-end GPU benchmarks on random weights of a real shape (default Llama-3.1-8B, bf16).

    python bench/gpu_e2e.py specserve --out r.json   # batch-1 decode + 256-request throughput
    python bench/gpu_e2e.py specserve --no-flags --out r.json  # the same with LLM(model, load_format="dummy")
    python bench/gpu_e2e.py vllm --out r.json        # vLLM's LLM on the same workload (PYTHONPATH: vLLM)
    python bench/gpu_e2e.py hf --out r.json          # HF transformers generate, same shape/workload
    python bench/gpu_e2e.py bandwidth --out r.json   # measured copy bandwidth -> batch-1 roofline
    python bench/gpu_e2e.py specserve --tensor-parallel-size 2 --out r.json  # (and vllm) over 2 GPUs

Workload (both engines): `--requests` requests of `--prompt-len` random prompt tokens, exactly
`--new-tokens` output tokens each (ignore_eos / min_new_tokens), greedy.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def prompts(n: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(10, vocab - 10, (n, length), generator=g).tolist()


def copy_bandwidth() -> float:
    """Bytes/s of a 4 GiB device-to-device copy (read + write counted), median of 10."""
    import triton.testing
    x = torch.empty(1 << 31, dtype=torch.bfloat16, device="cuda")
    y = torch.empty_like(x)
    ms = triton.testing.do_bench(lambda: y.copy_(x), warmup=5, rep=50, return_mode="median")
    return 2 * x.numel() * x.element_size() / (ms / 1e3)


def bench_specserve(args) -> dict:
    from specserve import LLM, SamplingParams

    t0 = time.perf_counter()
    tp = {"tensor_parallel_size": args.tensor_parallel_size} if args.tensor_parallel_size > 1 else {}
    if args.no_flags:  # what a user who passes nothing but the (dummy) model gets
        llm = LLM(args.model, load_format="dummy", **tp)
    else:
        llm = LLM(args.model, load_format="dummy", dtype="bfloat16", device=args.device,
                  max_model_len=args.max_model_len, max_num_seqs=max(args.requests, 1),
                  max_num_batched_tokens=args.max_num_batched_tokens, enforce_eager=args.enforce_eager,
                  async_scheduling=args.async_scheduling,
                  gpu_memory_utilization=args.gpu_memory_utilization, attention_backend=args.attention_backend,
                  enable_prefix_caching=args.enable_prefix_caching, **tp)
    startup = time.perf_counter() - t0
    vocab = llm.engine.loaded.arch.vocab_size
    params = SamplingParams(temperature=0.0, max_tokens=args.new_tokens, ignore_eos=True)
    result = {"weight_bytes": llm.engine.weight_bytes, "kv_cache_bytes": llm.engine.kv_cache_bytes,
              "cuda_graphs": llm.engine.runner.graphs is not None,
              "async_scheduling": llm.engine.async_scheduling,
              "attention_backend": llm.engine.runner.target.backend.name,
              "max_num_batched_tokens": llm.engine.config.scheduler.max_num_batched_tokens,
              "max_num_seqs": llm.engine.config.scheduler.max_num_seqs, "no_flags": args.no_flags,
              "startup_s": startup, "warmup_s": llm.engine.warmup_seconds,
              "tensor_parallel_size": args.tensor_parallel_size}
    # the first batch right after start-up, timed (no warm-up of ours before it: the engine's own)
    t0 = time.perf_counter()
    llm.generate([{"prompt_token_ids": p} for p in prompts(args.requests, args.prompt_len, vocab, 97)], params)
    result["first_batch_tok_s"] = args.requests * args.new_tokens / (time.perf_counter() - t0)
    llm.generate([{"prompt_token_ids": p} for p in prompts(4, args.prompt_len, vocab, 99)], params)  # warm-up

    # batch 1: decode tokens/s between the first and the last token (prefill excluded), median of runs
    rates, e2e = [], []
    for r in range(args.repeats):
        t0 = time.perf_counter()
        out = llm.generate([{"prompt_token_ids": prompts(1, args.prompt_len, vocab, r)[0]}], params)[0]
        e2e.append(args.new_tokens / (time.perf_counter() - t0))
        m = out.metrics
        rates.append((args.new_tokens - 1) / (m.finished_time - m.first_token_time))
    result["batch1_decode_tok_s"] = statistics.median(rates)
    result["batch1_e2e_tok_s"] = statistics.median(e2e)  # prefill included, as vLLM's is measured
    result["batch1_runs"] = rates

    # throughput: all requests at once, output tokens / wall time (after a short run of the same
    # shape, so kernels for its batch sizes are compiled before timing)
    llm.generate([{"prompt_token_ids": p} for p in prompts(args.requests, args.prompt_len, vocab, 98)],
                 SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    tps = []
    for r in range(args.repeats):
        batch = [{"prompt_token_ids": p} for p in prompts(args.requests, args.prompt_len, vocab, 100 + r)]
        t0 = time.perf_counter()
        outs = llm.generate(batch, params)
        elapsed = time.perf_counter() - t0
        assert all(len(o.outputs[0].token_ids) == args.new_tokens for o in outs)
        tps.append(args.requests * args.new_tokens / elapsed)
    result["throughput_tok_s"] = statistics.median(tps)
    result["throughput_runs"] = tps
    llm.shutdown()
    return result


def bench_vllm(args) -> dict:
    """vLLM's offline LLM with its defaults on the same workload (run with vLLM on PYTHONPATH, in a
    process of its own: one engine per GPU)."""
    import shutil
    import tempfile

    from vllm import LLM, SamplingParams, TokensPrompt

    from specserve.models.loader import dummy_config_path
    model_dir = Path(tempfile.mkdtemp())
    shutil.copy(dummy_config_path(args.model), model_dir / "config.json")
    t0 = time.perf_counter()
    llm = LLM(model=str(model_dir), load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16",
              gpu_memory_utilization=args.gpu_memory_utilization, tensor_parallel_size=args.tensor_parallel_size)
    result = {"startup_s": time.perf_counter() - t0, "tensor_parallel_size": args.tensor_parallel_size}
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    params = SamplingParams(temperature=0, max_tokens=args.new_tokens, ignore_eos=True, detokenize=False)

    def run(batch):
        llm.reset_prefix_cache()
        t0 = time.perf_counter()
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in batch], params, use_tqdm=False)
        assert all(len(o.outputs[0].token_ids) == args.new_tokens for o in outs)
        return time.perf_counter() - t0

    t = run(prompts(args.requests, args.prompt_len, vocab, 97))
    result["first_batch_tok_s"] = args.requests * args.new_tokens / t
    rates = [(args.new_tokens) / run(prompts(1, args.prompt_len, vocab, r)) for r in range(args.repeats)]
    result["batch1_e2e_tok_s"] = statistics.median(rates)
    tps = [args.requests * args.new_tokens / run(prompts(args.requests, args.prompt_len, vocab, 100 + r))
           for r in range(args.repeats)]
    result["throughput_tok_s"] = statistics.median(tps)
    result["throughput_runs"] = tps
    return result


def bench_hf(args) -> dict:
    from transformers import AutoConfig, AutoModelForCausalLM

    from specserve.models.loader import dummy_config_path
    cfg = AutoConfig.from_pretrained(str(dummy_config_path(args.model)))
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).eval()
    vocab = cfg.vocab_size
    result = {}
    for batch in args.hf_batches:
        ids = torch.tensor(prompts(batch, args.prompt_len, vocab, 7), device="cuda")
        new = args.new_tokens if batch > 1 else min(args.new_tokens, 64)
        with torch.inference_mode():
            model.generate(ids[:, :16], attention_mask=torch.ones_like(ids[:, :16]), max_new_tokens=4,
                           do_sample=False, pad_token_id=0)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                           do_sample=False, pad_token_id=0)
            torch.cuda.synchronize()
        result[f"hf_batch{batch}_tok_s"] = batch * new / (time.perf_counter() - t0)
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("which", choices=["specserve", "vllm", "hf", "bandwidth"])
    ap.add_argument("--no-flags", action="store_true",
                    help="specserve: LLM(model, load_format='dummy') and nothing else (its defaults)")
    ap.add_argument("--model", default="llama-3.1-8b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                    help="specserve and vllm: shard the model over this many GPUs (docs/tensor_parallel.md)")
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--max-num-batched-tokens", type=int, default=None,
                    help="default: the engine's for the device")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    ap.add_argument("--attention-backend", default="auto")
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                    help="default: the engine's (on for CUDA)")
    ap.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=False)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--hf-batches", type=int, nargs="+", default=[256])
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    if args.which == "specserve":
        res = bench_specserve(args)
    elif args.which == "vllm":
        res = bench_vllm(args)
    elif args.which == "hf":
        res = bench_hf(args)
    else:
        bw = copy_bandwidth()
        res = {"copy_bandwidth_bytes_s": bw}
    res.update({"which": args.which, "model": args.model,
                "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "none",
                "torch": torch.__version__, "command": " ".join(sys.argv)})
    try:
        import triton
        res["triton"] = triton.__version__
    except ImportError:
        pass
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=2))
    print(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
