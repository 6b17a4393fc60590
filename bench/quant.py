"""Quantized weights: weight memory, KV blocks for a fixed memory budget, decode tokens/s
(bf16 vs bitsandbytes int8 vs nf4, nf4 with quantized embeddings too), and self-draft acceptance.

    # CPU, the default model (SmolLM2-135M-Instruct), < 8 minutes:
    python bench/quant.py --out bench/results/quant_cpu
    # GPU (accelerator machine), random weights of the real Llama-3.1-8B shape:
    python bench/quant.py --device cuda --load-format dummy --model llama-3.1-8b --out bench/results/quant_gpu

KV blocks: on the GPU the engine sizes the KV cache itself (--gpu-memory-utilization, measured after
the weights are on the device), so the column is what the engine really allocated. On the CPU the
KV cache is fixed by --kv-cache-memory, so the column is what a fixed budget (--memory-budget,
weights + KV) leaves for KV blocks. Self-draft acceptance needs real weights (random weights make
acceptance meaningless) and is skipped with --load-format dummy.
"""
from __future__ import annotations

import argparse
import gc
import json
import logging
import platform
import shlex
import sys
import time
from pathlib import Path

import torch

from specserve import LLM, SamplingParams
from specserve.quant import INT8, NF4
from specserve.quant.memory import format_bytes

logger = logging.getLogger("bench.quant")
VARIANTS = {  # name -> (quantization, quantize_embeddings)
    "bf16": (None, False), "int8": (INT8, False), "nf4": (NF4, False), "nf4+emb": (NF4, True),
}
CHAT_PROMPTS = [
    "What is the capital of France?", "Name three primary colors.", "Explain what a CPU cache is.",
    "Who wrote Romeo and Juliet?", "Give me three tips for learning to cook.", "What is photosynthesis?",
    "Write a haiku about the sea.", "How do I reverse a list in Python?", "What causes rain?",
    "Describe a cat in two sentences.", "Why is the sky blue?", "What is the opposite of hot?",
]


def engine_args(args, quantization, quantize_embeddings, **extra) -> dict:
    kw = {"dtype": args.dtype, "device": args.device, "load_format": args.load_format,
          "quantization": quantization, "quantize_embeddings": quantize_embeddings,
          "max_model_len": args.max_model_len, "seed": 0}
    if args.device == "cpu":
        kw["num_kv_blocks"] = args.cpu_kv_blocks  # the decode runs need few; the budget column is computed
    else:
        kw["gpu_memory_utilization"] = args.gpu_memory_utilization
    kw.update(extra)
    return kw


def release() -> None:
    """Give the last engine's memory back (call after dropping every reference to it)."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def decode_rate(llm: LLM, batch: int, prompt_len: int, new_tokens: int) -> float:
    """Decode tokens/s of `batch` requests decoding together: timed after every prefill is done."""
    engine = llm.engine
    vocab = engine.loaded.arch.vocab_size
    gen = torch.Generator().manual_seed(batch)
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    ids = [engine.add_request(None, torch.randint(3, vocab, (prompt_len,), generator=gen).tolist(), params)
           for _ in range(batch)]
    counts = dict.fromkeys(ids, 0)
    while min(counts.values()) < 1:  # prefill (and the first token)
        for out in engine.step():
            counts[out.request_id] = len(out.outputs[0].token_ids)
    start, first = time.perf_counter(), sum(counts.values())
    while engine.has_unfinished():
        for out in engine.step():
            counts[out.request_id] = len(out.outputs[0].token_ids)
    if engine.device.type == "cuda":
        torch.cuda.synchronize()
    return (sum(counts.values()) - first) / (time.perf_counter() - start)


def hf_rate(model_dir: str, variant: str, new_tokens: int, dtype: torch.dtype) -> float | None:
    """The peer: transformers generate at batch 1 with the same bitsandbytes method."""
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    quant, emb = VARIANTS[variant]
    if emb:
        return None  # transformers keeps embeddings unquantized
    kw = {"dtype": dtype}
    if quant == INT8:
        kw.update(quantization_config=BitsAndBytesConfig(load_in_8bit=True), device_map="cpu")
    elif quant == NF4:
        kw.update(quantization_config=BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                                         bnb_4bit_use_double_quant=True,
                                                         bnb_4bit_compute_dtype=dtype), device_map="cpu")
    model = AutoModelForCausalLM.from_pretrained(model_dir, **kw).eval()
    ids = torch.randint(3, model.config.vocab_size, (1, 32), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    with torch.no_grad():
        model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False)  # warm-up
        start = time.perf_counter()
        model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                       do_sample=False)
    rate = new_tokens / (time.perf_counter() - start)
    del model
    release()
    return rate


def run_variant(args, name: str) -> dict:
    quant, emb = VARIANTS[name]
    t0 = time.perf_counter()
    llm = LLM(args.model, **engine_args(args, quant, emb))
    engine = llm.engine
    load_s = time.perf_counter() - t0
    num_blocks = engine.kv_manager.pool.num_blocks
    block_bytes = engine.kv_cache_bytes // num_blocks
    row = {"variant": name, "quantization": quant, "quantize_embeddings": emb, "load_s": round(load_s, 1),
           "weight_bytes": engine.weight_bytes, "quantized_bytes": engine.weight_memory.quantized,
           "kv_block_bytes": block_bytes, "block_size": engine.kv_manager.block_size}
    if args.device == "cpu":
        row["kv_blocks"] = max(0, (args.memory_budget - engine.weight_bytes) // block_bytes)
        row["kv_blocks_note"] = f"({format_bytes(args.memory_budget)} budget - weights) / block bytes"
    else:
        row["kv_blocks"] = num_blocks
        row["kv_blocks_note"] = f"engine auto, gpu_memory_utilization {args.gpu_memory_utilization}"
    row["decode_tok_s"] = {}
    for batch in args.batch:
        rate = decode_rate(llm, batch, args.prompt_len, args.new_tokens)
        row["decode_tok_s"][str(batch)] = round(rate, 2)
        logger.info("%s batch %d: %.1f tok/s", name, batch, rate)
    logger.info("%s: %s of weights, %d KV blocks", name, format_bytes(engine.weight_bytes), row["kv_blocks"])
    del llm, engine
    release()
    if args.hf_peer and args.load_format != "dummy":
        row["hf_tok_s_batch1"] = hf_rate(args.model, name, args.new_tokens, getattr(torch, args.dtype))
    return row


def run_self_draft(args, draft: str) -> dict:
    """Acceptance of the target's own quantized weights as the draft, on real chat prompts (greedy)."""
    llm = LLM(args.model, **engine_args(args, None, False, draft_model=draft,
                                        speculative_config={"num_speculative_tokens": args.k,
                                                            "adaptive": False}))
    params = SamplingParams(temperature=0.0, max_tokens=args.spec_tokens)
    start = time.perf_counter()
    outs = llm.chat([[{"role": "user", "content": p}] for p in CHAT_PROMPTS], params)
    elapsed = time.perf_counter() - start
    drafts = sum(o.metrics.num_drafts for o in outs)
    drafted = sum(o.metrics.num_draft_tokens for o in outs)
    accepted = sum(o.metrics.num_accepted_tokens for o in outs)
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    row = {"draft": draft, "k": args.k, "num_prompts": len(outs), "draft_tokens": drafted,
           "accepted_tokens": accepted, "acceptance_rate": round(accepted / max(1, drafted), 4),
           "mean_acceptance_length": round(1 + accepted / max(1, drafts), 3),
           "draft_weight_bytes": llm.engine.draft_weight_bytes,
           "tok_s": round(tokens / elapsed, 2), "batch": len(outs)}
    del llm, outs
    release()
    return row


def markdown(result: dict) -> str:
    rows = result["variants"]
    bf16 = next(r for r in rows if r["variant"] == "bf16")
    batches = list(bf16["decode_tok_s"])
    head = ["variant", "weights", "x bf16", "KV blocks", *[f"decode tok/s b{b}" for b in batches]]
    has_hf = any("hf_tok_s_batch1" in r for r in rows)
    if has_hf:
        head.append("HF generate tok/s b1")
    lines = [f"# Quantized weights: {result['model']} on {result['hardware']}", "",
             f"`{result['command']}`", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        ratio = r["weight_bytes"] / bf16["weight_bytes"]
        cells = [r["variant"], format_bytes(r["weight_bytes"]), f"{ratio:.3f}", str(r["kv_blocks"]),
                 *[f"{r['decode_tok_s'][b]:.1f}" for b in batches]]
        if has_hf:
            hf = r.get("hf_tok_s_batch1")
            cells.append("-" if hf is None else f"{hf:.1f}")
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", (f"KV blocks: {bf16['kv_blocks_note']}; {bf16['kv_block_bytes']} bytes per block of "
                   f"{bf16['block_size']} tokens. Decode: prompt {result['prompt_len']} random tokens, "
                   f"{result['new_tokens']} new tokens, greedy, timed after prefill.")]
    if result.get("self_draft"):
        lines += ["", ("| self-draft | k | acceptance rate | mean acceptance length | draft adds | "
                       "tok/s (batch) |"), "|---|---|---|---|---|---|"]
        for s in result["self_draft"]:
            lines.append(f"| {s['draft']} | {s['k']} | {s['acceptance_rate']:.3f} | "
                         f"{s['mean_acceptance_length']:.2f} | {format_bytes(s['draft_weight_bytes'])} | "
                         f"{s['tok_s']:.1f} ({s['batch']}) |")
    elif result.get("self_draft_note"):
        lines += ["", result["self_draft_note"]]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="model dir / shipped shape (default: the default model)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--load-format", default="auto", choices=["auto", "dummy"])
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    ap.add_argument("--batch", type=int, nargs="+", default=None, help="default: 1 8 (cpu), 1 16 64 (cuda)")
    ap.add_argument("--prompt-len", type=int, default=None, help="default: 32 (cpu), 128 (cuda)")
    ap.add_argument("--new-tokens", type=int, default=None, help="default: 32 (cpu), 128 (cuda)")
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--memory-budget", type=int, default=512 << 20, help="CPU: bytes for weights + KV")
    ap.add_argument("--cpu-kv-blocks", type=int, default=256)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    ap.add_argument("--hf-peer", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--self-drafts", nargs="*", default=["self-int8", "self-nf4"])
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--spec-tokens", type=int, default=48)
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    ap.add_argument("--out", default=None, help="path prefix: writes PREFIX.json and PREFIX.md")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("specserve").setLevel(logging.WARNING)
    cuda = args.device.startswith("cuda")
    args.batch = args.batch or ([1, 16, 64] if cuda else [1, 8])
    args.prompt_len = args.prompt_len or (128 if cuda else 32)
    args.new_tokens = args.new_tokens or (128 if cuda else 32)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.model is None:
        from specserve.models.default_model import ensure_default_model
        args.model = str(ensure_default_model())
    cpu = f"{platform.processor() or platform.machine()} CPU, {torch.get_num_threads()} threads"
    hardware = torch.cuda.get_device_name() if cuda else cpu
    result = {"model": args.model, "device": args.device, "dtype": args.dtype, "hardware": hardware,
              "command": "python " + " ".join(shlex.quote(a) for a in sys.argv),
              "prompt_len": args.prompt_len, "new_tokens": args.new_tokens, "torch": torch.__version__,
              "variants": [run_variant(args, v) for v in args.variants]}
    if args.load_format == "dummy":
        result["self_draft_note"] = ("Self-draft acceptance not measured: random weights make acceptance "
                                     "meaningless (bench/spec_decode.py measures speculation cost at "
                                     "simulated acceptance).")
    else:
        result["self_draft"] = [run_self_draft(args, d) for d in args.self_drafts]
    text = markdown(result)
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out + ".json").write_text(json.dumps(result, indent=2))
        Path(args.out + ".md").write_text(text)


if __name__ == "__main__":
    main()
