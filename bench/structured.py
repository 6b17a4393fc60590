"""Structured outputs: what a grammar costs, on the default model's tokenizer (SmolLM2, 49,152 ids).

    python bench/structured.py --out bench/results/structured_cpu.json
    python bench/structured.py --device cuda --out bench/results/gpu/structured_gpu.json

Measures, with the engine's own code (specserve/sample/structured.py):
- compile: the tokenizer info (built once per engine), then each constraint kind cold (compiled)
  and warm (an LRU hit), and the front end's tokenizer-free check;
- per step: filling the bitmask rows of B constrained samples (xgrammar's matcher, on the host)
  and applying them to [B, V] fp32 logits on the device (xgrammar's CPU kernel, or its Triton
  kernel on CUDA, with the host-to-device copy of the mask), for B = 1, 8, 32, 128; and a
  verification's tentative walk through k = 3 drafts (4 masks, rollback) per sample;
- with --e2e: the default model's speed (LLM, fp32, greedy, 4 requests x 32 tokens, prefill
  included) with and without a JSON schema, interleaved, medians of 3.
Medians over --iters calls; the matchers sit inside a JSON value where most tokens are allowed
(the dense, expensive case for the mask fill).
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
sys.path.insert(0, str(Path(__file__).resolve().parent))
from timing import median_seconds  # noqa: E402

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age", "tags"],
          "properties": {"name": {"type": "string", "maxLength": 40},
                         "age": {"type": "integer", "minimum": 0, "maximum": 150},
                         "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 5}}}


def end_to_end(device: str, threads: int | None) -> dict:
    """Output tokens/s of 4 concurrent greedy requests (32 tokens each) with and without a schema."""
    from specserve import LLM, SamplingParams
    from specserve.sampling_params import StructuredOutputsParams as C

    llm = LLM(dtype="float32", device=device, threads=threads)
    messages = [[{"role": "user", "content": f"Describe person number {i} in JSON."}] for i in range(4)]
    # a schema whose strings the model fills to the length: every request decodes all 64 tokens
    schema = {"type": "object", "properties": {"bio": {"type": "string", "minLength": 400}}, "required": ["bio"]}
    runs: dict[str, list[float]] = {"plain": [], "json_schema": []}
    for _ in range(3):
        for name, c in (("plain", None), ("json_schema", C(json=schema))):
            params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=c is None, structured_outputs=c)
            t0 = time.perf_counter()
            outs = llm.chat(messages, params)
            seconds = time.perf_counter() - t0
            runs[name].append(sum(len(o.outputs[0].token_ids) for o in outs) / seconds)
    return {name: {"tokens_per_s": statistics.median(v), "runs": v} for name, v in runs.items()}


def per_step(grammars: list, prefix: list[int], drafts: list[int], vocab: int, device: torch.device,
             iters: int) -> dict:
    """One step's mask work for len(grammars) samples that have accepted `prefix`."""
    from specserve.sample.structured import GrammarMasks

    batch, masks = len(grammars), GrammarMasks()
    for g in grammars:
        for t in prefix:
            assert not g.accept(t)
    logits = torch.randn(batch, vocab, device=device)

    def fill() -> torch.Tensor:
        bitmask = masks.buffer(batch, vocab)
        for i, g in enumerate(grammars):
            g.fill(bitmask, i)
        return bitmask

    bitmask = fill()
    walk_bitmask = GrammarMasks().buffer(batch * (len(drafts) + 1), vocab)

    def walk() -> None:
        for i, g in enumerate(grammars):
            g.fill_drafts(drafts, walk_bitmask, i * (len(drafts) + 1))

    cpu = torch.device("cpu")
    return {"batch": batch, "fill_ms": median_seconds(fill, iters, cpu) * 1e3,
            "apply_ms": median_seconds(lambda: masks.apply(logits, bitmask, range(batch)), iters, device) * 1e3,
            "verify_walk_k3_ms": median_seconds(walk, iters, cpu) * 1e3}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--e2e", action="store_true", help="also time the default model with and without a schema")
    ap.add_argument("--threads", type=int, help="CPU threads for the model (--e2e)")
    ap.add_argument("--tokenizer", type=Path, help="a tokenizer directory (default: the default model's)")
    args = ap.parse_args()
    device = torch.device(args.device)

    from transformers import AutoTokenizer

    from specserve.models.default_model import ensure_default_model
    from specserve.sample.grammars import constraint_key
    from specserve.sample.structured import GrammarCompiler
    from specserve.sample.structured import _parse as parse
    from specserve.sampling_params import StructuredOutputsParams as C

    tokenizer = AutoTokenizer.from_pretrained(str(args.tokenizer or ensure_default_model()))
    vocab = len(tokenizer)
    result: dict = {"device": str(device), "vocab_size": vocab, "torch": torch.__version__}
    t0 = time.perf_counter()
    import xgrammar

    result["import_xgrammar_s"] = time.perf_counter() - t0
    result["xgrammar"] = getattr(xgrammar, "__version__", None) or __import__("importlib.metadata").metadata.version(
        "xgrammar")
    compiler = GrammarCompiler(tokenizer, vocab, [tokenizer.eos_token_id])
    t0 = time.perf_counter()
    compiler.compile(C(regex="a"))  # the first compile builds the tokenizer info
    result["tokenizer_info_and_first_compile_s"] = time.perf_counter() - t0
    kinds = {"json_schema": C(json=SCHEMA), "json_object": C(json_object=True),
             "regex": C(regex=r"[a-z0-9._]{1,20}@[a-z]{2,12}\.(com|org|net)"),
             "choice": C(choice=["positive", "negative", "neutral"]),
             "grammar": C(grammar='root ::= "(" expr ")"\nexpr ::= [0-9]+ (("+" | "*") [0-9]+)*')}
    result["compile"] = {}
    for name, c in kinds.items():
        t0 = time.perf_counter()
        compiled = compiler.compile(c)
        cold = time.perf_counter() - t0
        t0 = time.perf_counter()
        assert compiler.compile(c) is compiled
        warm = time.perf_counter() - t0
        check = median_seconds(lambda c=c: parse(constraint_key(c)), 5, torch.device("cpu"))  # uncached
        result["compile"][name] = {"cold_ms": cold * 1e3, "warm_ms": warm * 1e3, "front_end_check_ms": check * 1e3}

    compiled = compiler.compile(kinds["json_schema"])
    prefix = tokenizer.encode('{"name": "Ada Lovelace', add_special_tokens=False)
    drafts = tokenizer.encode(" Byron", add_special_tokens=False)[:3]
    result["per_step"] = [per_step([compiler.matcher(compiled) for _ in range(batch)], prefix, drafts, vocab,
                                   device, args.iters) for batch in (1, 8, 32, 128)]
    compiler.shutdown()
    save(result, args.out)
    if args.e2e:
        result["e2e"] = end_to_end(args.device, args.threads)
        save(result, args.out)


def save(result: dict, out: Path | None) -> None:
    print(json.dumps(result, indent=2), flush=True)
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
