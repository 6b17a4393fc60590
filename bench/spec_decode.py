"""Speculative decoding: output tokens/s and mean acceptance length, with and without speculation,
at several concurrency levels, in one run, same engine settings and same prompts.

CPU (default): the default model (SmolLM2-135M-Instruct) with n-gram drafts on HumanEval
(the model is asked to complete the function: chat template) and ShareGPT (first human turn; `turns`:
the later turns of conversations the target answered itself, `--turns-file` from bench/head_turns.py),
greedy, natural stops capped at --max-tokens:

    python bench/spec_decode.py --threads 1 --dtype float32 --out bench/results/spec_decode_cpu

On the CPU one engine serves both ("none" = no proposer attached) and the runs of a level alternate
none, ngram, none, ngram, ..., none: each ngram run is compared with the mean of the baseline runs
just before and after it, and the median over runs is reported, next to the same statistic for
baseline runs (A/A: the noise floor of a shared machine).

GPU: dummy weights of real shapes (configs/models/) where acceptance is meaningless, so it is
controlled: draft = target weights (the top of the range) and the Llama-3.2-1B-shaped draft with the
BENCHMARK-ONLY simulated-acceptance switch; random prompts, ignore_eos:

    python bench/spec_decode.py --device cuda --load-format dummy --model llama-3.1-8b \
        --draft-model llama-3.2-1b --max-tokens 256 --prompt-len 128 --out bench/results/spec_decode_gpu

Concurrency c = c requests in flight (closed loop: a finished request is replaced by the next);
each level uses its own prompts (no prefix-cache reuse across levels). Output tokens/s counts
generated tokens over the wall time of a run.
"""
from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import platform
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from prompts import humaneval_prompts, sharegpt_conversations  # noqa: E402
from timing import host_probe  # noqa: E402

from specserve import LLM, SamplingParams  # noqa: E402
from specserve.spec_decode.metrics import conditional_acceptance  # noqa: E402

HUMANEVAL_INSTRUCTION = ("Complete the following Python function. Reply with the complete function, its docstring "
                         "included, in one code block.\n\n")


def requests_per_level(c: int, base: int, waves: int = 1) -> int:
    """Requests run at concurrency c: at least `base` below 16, `waves` x c from 16 (one wave ends in a
    tail where fewer than c are in flight: speculation, finishing requests at different steps, has one
    where plain decoding, all at the same step, has none; more waves make it a smaller share)."""
    return max(base, c) if c < 16 else waves * c


def spread_params(max_tokens: int, spread: float, ignore_eos: bool, num: int) -> list[SamplingParams]:
    """Greedy params for `num` requests: request i stops after max_tokens x (1 - spread x u_i) tokens,
    u_i uniform in [0, 1) from a fixed seed (--length-spread: the same for every engine and run)."""
    rng = random.Random(1)
    return [SamplingParams(temperature=0.0, ignore_eos=ignore_eos,
                           max_tokens=max(1, round(max_tokens * (1 - spread * rng.random())))) for _ in range(num)]


def load_prompts(args, tokenizer) -> dict[str, list[list[int]]]:
    """Prompt token ids per dataset, enough for every level (disjoint slices per level)."""
    need = sum(requests_per_level(c, args.min_requests, args.waves) for c in args.concurrency)
    if args.load_format == "dummy":  # no tokenizer: random ids, fixed length
        rng = random.Random(0)
        return {"random": [[rng.randrange(10, 32000) for _ in range(args.prompt_len)] for _ in range(need)]}
    chat = lambda text: tokenizer.apply_chat_template(  # noqa: E731
        [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True)
    out = {}
    if "humaneval" in args.datasets:
        ids = [tokenizer.encode(chat(HUMANEVAL_INSTRUCTION + t), add_special_tokens=False)
               for t in humaneval_prompts()]
        out["humaneval"] = [p for p in ids if len(p) <= args.max_prompt_len][:need]
    if "sharegpt" in args.datasets:
        texts = [h for h, _ in sharegpt_conversations(limit=4 * need, skip=args.sharegpt_skip)]
        ids = [tokenizer.encode(chat(t), add_special_tokens=False) for t in texts]
        out["sharegpt"] = [p for p in ids if len(p) <= args.max_prompt_len][:need]
    if "turns" in args.datasets:  # later turns of conversations, after the target's own earlier answers
        if not args.turns_file:
            raise SystemExit("--datasets turns needs --turns-file (bench/head_turns.py --regenerated FILE)")
        ids = []
        for messages in json.loads(Path(args.turns_file).read_text()):
            answers = [j for j, m in enumerate(messages) if m["role"] == "assistant"]
            for j in answers[1:]:  # each later answer's prompt: the conversation up to it
                text = tokenizer.apply_chat_template(messages[:j], tokenize=False, add_generation_prompt=True)
                ids.append(tokenizer.encode(text, add_special_tokens=False))
        out["turns"] = [p for p in ids if len(p) <= args.max_prompt_len][:need]
    return out


def run_level(llm: LLM, prompts: list[list[int]], concurrency: int,
              params: SamplingParams | list[SamplingParams]) -> dict:
    """Closed loop with `concurrency` requests in flight; returns throughput and spec counters.
    `params`: for every prompt, or one per prompt (--length-spread)."""
    engine = llm.engine
    before = engine.stats()
    pending = list(enumerate(prompts))
    num_out, steps, in_flight, tpots, step_s = 0, 0, 0, [], []
    sync_s = []  # the steps the engine did not leave in flight (async scheduling): their times
    probe = StallProbe()
    t0 = time.perf_counter()
    while pending or engine.has_unfinished():
        while pending and in_flight < concurrency:
            i, p = pending.pop(0)
            engine.add_request(f"b{time.monotonic_ns()}-{i}", {"prompt_token_ids": p},
                               params[i] if isinstance(params, list) else params)
            in_flight += 1
        t_step, deferred = time.perf_counter(), engine.num_deferred_steps
        outs = engine.step()
        step_s.append(time.perf_counter() - t_step)
        if engine.num_deferred_steps == deferred:
            sync_s.append(step_s[-1])
        for out in outs:
            if out.finished:
                in_flight -= 1
                n = len(out.outputs[0].token_ids)
                num_out += n
                m = out.metrics
                if n > 1:
                    tpots.append((m.finished_time - m.first_token_time) / (n - 1))
        steps += 1
    elapsed = time.perf_counter() - t0
    causes = probe.done()
    after = engine.stats()
    delta = {k: after[k] - before[k] for k in ("spec_decode_num_drafts", "spec_decode_num_draft_tokens",
                                               "spec_decode_num_accepted_tokens")}
    drafts, accepted = delta["spec_decode_num_drafts"], delta["spec_decode_num_accepted_tokens"]
    per_pos, judged = ([a - b for a, b in zip(after[key], before[key])] for key in (
        "spec_decode_num_accepted_tokens_per_pos", "spec_decode_num_judged_tokens_per_pos"))
    assert after["num_used_blocks"] == 0
    return {
        "requests": len(prompts), "output_tokens": num_out, "elapsed_s": round(elapsed, 3),
        "tokens_per_s": round(num_out / elapsed, 2), "steps": steps,
        "tokens_per_step": round(num_out / steps, 3),
        "mean_tpot_ms": round(1000 * sum(tpots) / len(tpots), 2) if tpots else None,
        "num_drafts": drafts, "num_draft_tokens": delta["spec_decode_num_draft_tokens"],
        "num_accepted_tokens": accepted,
        "mean_acceptance_length": round(1 + accepted / drafts, 3) if drafts else None,
        "acceptance_rate": round(accepted / delta["spec_decode_num_draft_tokens"], 3) if drafts else None,
        "accepted_per_pos": per_pos, "judged_per_pos": judged,
        "acceptance_per_position": conditional_rates(per_pos, judged),
        "slowest_steps_ms": [round(1000 * t, 1) for t in sorted(step_s)[-3:]],  # a stall shows here
        # steps not left in flight (prefills, verifications, the policy's plans) and their share of the time
        "sync_steps": len(sync_s), "sync_steps_s": round(sum(sync_s), 3),
        "ahead_steps": after["num_ahead_steps"] - before["num_ahead_steps"],  # --async-drafting
        **causes,
    }


class StallProbe:
    """What may stall a run, counted over it: kernels Triton compiled (new entries in its cache),
    garbage collections (their time), and the CUDA allocator's device allocations and retries; and
    the host's speed just after it (`host_probe`, untimed: where one process's synchronous steps run
    slower than another's, whether its host does too)."""

    def __init__(self) -> None:
        self.cache = Path(os.environ.get("TRITON_CACHE_DIR", Path.home() / ".triton" / "cache"))
        self.kernels = self._kernels()
        self.gc_s, self._gc_t0 = 0.0, 0.0
        gc.callbacks.append(self._gc)
        self.alloc = self._alloc()

    def _kernels(self) -> int:
        return len(os.listdir(self.cache)) if self.cache.is_dir() else 0

    def _gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._gc_t0 = time.perf_counter()
        else:
            self.gc_s += time.perf_counter() - self._gc_t0

    @staticmethod
    def _alloc() -> tuple[int, int]:
        if not torch.cuda.is_available():
            return (0, 0)
        stats = torch.cuda.memory_stats()
        return stats.get("num_device_alloc", 0), stats.get("num_alloc_retries", 0)

    def done(self) -> dict:
        gc.callbacks.remove(self._gc)
        alloc = self._alloc()
        return {"kernels_compiled": self._kernels() - self.kernels, "gc_ms": round(1000 * self.gc_s, 1),
                "device_allocs": alloc[0] - self.alloc[0], "alloc_retries": alloc[1] - self.alloc[1],
                "host_probe_ms": host_probe()}


def conditional_rates(per_pos: list[int], judged: list[int]) -> list[float] | None:
    """A run's conditional acceptance per draft position (`conditional_acceptance` of its counters'
    deltas: what --eagle-acceptance replays), rounded, 0.0 where none was judged; None if none was."""
    if not any(judged):
        return None
    return [0.0 if r is None else round(r, 4) for r in conditional_acceptance(per_pos, judged)]


def configs(args) -> list[tuple[str, dict | None]]:
    """(name, speculative_config): the baseline first."""
    k = args.num_speculative_tokens
    base = dict(num_speculative_tokens=k, adaptive=not args.no_adaptive)
    if args.compute_bound_tokens:
        base["compute_bound_tokens"] = args.compute_bound_tokens
    if args.draft_cost is not None:
        base["draft_cost"] = args.draft_cost
    if args.load_format != "dummy":
        out = [("none", None), ("ngram", dict(base, method="ngram", prompt_lookup_max=args.prompt_lookup_max))]
        if args.no_ngram:
            out.pop()
        if args.draft_model:
            out.append(("draft", dict(base, method="draft_model", model=args.draft_model,
                                      load_format=args.load_format)))
        if args.eagle:
            out.append(("eagle", dict(base, method="eagle", model=args.eagle)))
            if args.host_drafting:
                out.append(("eagle host", out[-1][1]))
            if args.async_drafting:
                out.append(("eagle ahead", out[-1][1]))
            out += [(f"eagle {q}", dict(base, method="eagle", model=args.eagle, quantization=q))
                    for q in args.eagle_quantization]
            if args.eagle_full_vocab:
                out.append(("eagle full vocab", dict(base, method="eagle", model=args.eagle, draft_vocab="full")))
        return out
    out = [("none", None)]
    if args.eagle:  # a random head of the target's shape, accepting at the given rate per position
        # --eagle dummy3: a head that fuses target layers (method eagle3), priced as such
        method = "eagle3" if args.eagle == "dummy3" else "eagle"
        out.append(("eagle sim", dict(base, method=method, load_format="dummy",
                                      simulated_acceptance=args.eagle_acceptance)))
        if args.host_drafting:
            out.append(("eagle sim host", out[1][1]))
        if args.async_drafting:
            out.append(("eagle sim ahead", out[1][1]))
        out += [(f"eagle sim {q}", dict(out[1][1], quantization=q)) for q in args.eagle_quantization]
    if args.draft_model:
        draft = dict(base, method="draft_model", load_format="dummy")
        out.append(("draft=target", dict(draft, model=args.model)))
        out += [(f"draft sim {a}", dict(draft, model=args.draft_model, simulated_acceptance=a))
                for a in args.simulated_acceptance]
    return out


# a run's numbers that merged runs keep as a list, one per run (not summed)
PER_RUN_KEYS = ("slowest_steps_ms", "kernels_compiled", "gc_ms", "device_allocs", "alloc_retries", "sync_steps",
                "sync_steps_s", "ahead_steps", "host_probe_ms")


def merge_runs(runs: list[dict]) -> dict:
    """Totals over repeated runs of one level (tokens/s = all tokens / all time)."""
    if len(runs) == 1:
        return runs[0]
    out = dict(runs[0])
    for key in ("output_tokens", "elapsed_s", "steps", "num_drafts", "num_draft_tokens", "num_accepted_tokens"):
        out[key] = sum(r[key] for r in runs)
    out["elapsed_s"] = round(out["elapsed_s"], 3)
    out["tokens_per_s"] = round(out["output_tokens"] / out["elapsed_s"], 2)
    out["tokens_per_step"] = round(out["output_tokens"] / out["steps"], 3)
    tpots = [r["mean_tpot_ms"] for r in runs if r["mean_tpot_ms"] is not None]
    out["mean_tpot_ms"] = round(sum(tpots) / len(tpots), 2) if tpots else None
    drafts = out["num_drafts"]
    for key in ("accepted_per_pos", "judged_per_pos"):
        out[key] = [sum(col) for col in zip(*(r[key] for r in runs))]
    out["acceptance_per_position"] = conditional_rates(out["accepted_per_pos"], out["judged_per_pos"])
    out["mean_acceptance_length"] = round(1 + out["num_accepted_tokens"] / drafts, 3) if drafts else None
    out["acceptance_rate"] = round(out["num_accepted_tokens"] / out["num_draft_tokens"], 3) if drafts else None
    out["repeats"] = len(runs)
    out["tokens_per_s_runs"] = [r["tokens_per_s"] for r in runs]
    out["steps_runs"] = [r["steps"] for r in runs]
    out["num_drafts_runs"] = [r["num_drafts"] for r in runs]
    for key in PER_RUN_KEYS:
        out[key] = [r[key] for r in runs]
    return out


def add_ratios(row: dict, names: list[str], interleaved: bool) -> None:
    """Speedups of a level. Interleaved runs (the CPU: baseline runs b_0 .. b_R around the runs s_i
    of each speculative setup): speedup = the median of s_i / mean(b_i, b_i+1), robust to a run hit
    by a burst of other work; the A/A control, the same statistic for each inner baseline run,
    b_i / mean(b_i-1, b_i+1), shows the noise floor. Otherwise: the ratio of tokens/s totals."""
    base = row["none"].get("tokens_per_s_runs", [row["none"]["tokens_per_s"]])
    for name in names[1:]:
        r = row[name]
        runs = r.get("tokens_per_s_runs", [r["tokens_per_s"]])
        if interleaved and len(runs) == len(base) - 1:
            r["speedup_runs"] = [round(x / ((a + b) / 2), 3) for x, a, b in zip(runs, base, base[1:])]
            r["speedup"] = round(statistics.median(r["speedup_runs"]), 3)
        else:
            r["speedup"] = round(r["tokens_per_s"] / row["none"]["tokens_per_s"], 3)
    if interleaved and len(base) >= 3:
        row["control_runs"] = [round(x / ((a + b) / 2), 3) for a, x, b in zip(base, base[1:], base[2:])]
        row["control"] = round(statistics.median(row["control_runs"]), 3)


def repeats_for(args, concurrency: int) -> int:
    return args.repeats if concurrency < 32 else args.repeats_large


class Setup:
    """A named configuration: an engine, and the proposer it runs with (None = no speculation).
    N-gram needs no KV, so on the CPU "none" and "ngram" share one engine (and its prefix cache)."""

    def __init__(self, name: str, llm: LLM, proposer) -> None:
        self.name, self.llm, self.proposer = name, llm, proposer

    def run(self, prompts, concurrency, params) -> dict:
        self.llm.engine.runner.proposer = self.proposer
        return run_level(self.llm, prompts, concurrency, params)


def build_setups(args, group, engine_args) -> list[Setup]:
    setups, shared = [], None
    for name, spec in group:
        if args.device == "cpu" and (spec is None or spec["method"] == "ngram"):
            if shared is None:  # with n-gram's proposer, unless n-gram is left out
                ngram = next((dict(c) for _, c in configs(args) if c is not None and c["method"] == "ngram"), None)
                shared = LLM(args.model, speculative_config=ngram, **engine_args)
            llm = shared
            proposer = None if spec is None else shared.engine.proposer
        else:
            ahead = {"async_drafting": True} if name.endswith(" ahead") else {}  # --async-drafting
            llm = LLM(args.model, speculative_config=spec, **engine_args, **ahead)
            proposer = llm.engine.proposer
            if name.endswith(" host"):  # --host-drafting: verification and drafting with a host wait between
                proposer.drafts_on_device = False
        llm.generate({"prompt_token_ids": [5, 6, 7, 8]}, SamplingParams(max_tokens=4))  # warm up
        setups.append(Setup(name, llm, proposer))
    return setups


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct")
    ap.add_argument("--draft-model", default=None)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--load-format", default="auto")
    ap.add_argument("--datasets", nargs="+", default=["humaneval", "sharegpt"],
                    help="humaneval, sharegpt (first prompts), turns (later turns: --turns-file)")
    ap.add_argument("--turns-file", default=None,
                    help="conversations the target answered for several turns (bench/head_turns.py --regenerated): "
                         "each later answer's prompt is the conversation before it, the target's answers included")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16, 64])
    ap.add_argument("--min-requests", type=int, default=8, help="requests per level below c=16")
    ap.add_argument("--waves", type=int, default=1, help="requests per level from c=16: this many x c")
    ap.add_argument("--policy-trace", default=None,
                    help="write adaptive k's trace (a line per plan and per judged step) to this file")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--length-spread", type=float, default=0.0,
                    help="dummy weights: request i stops after max_tokens x (1 - spread x u_i) tokens, u_i uniform "
                         "in [0, 1) from a fixed seed, the same for every engine (requests then end at different "
                         "steps with and without speculation; 0: all after max_tokens)")
    ap.add_argument("--prompt-len", type=int, default=128, help="dummy weights: random prompt length")
    ap.add_argument("--max-prompt-len", type=int, default=256)
    ap.add_argument("--num-speculative-tokens", type=int, default=None,
                    help="the cap on drafts (default: the engine's for the method: 4 for EAGLE, 3 otherwise)")
    ap.add_argument("--prompt-lookup-max", type=int, default=8)
    ap.add_argument("--no-adaptive", action="store_true")
    ap.add_argument("--compute-bound-tokens", type=int, default=None, help="adaptive k: the ridge point")
    ap.add_argument("--draft-cost", type=float, default=None,
                    help="adaptive k: a draft step's price in target steps (the config's draft_cost; 100: "
                         "a control that never drafts, the drafter loaded)")
    ap.add_argument("--simulated-acceptance", type=float, nargs="+", default=[0.6, 0.8])
    ap.add_argument("--eagle", default=None, help="an EAGLE head directory (with dummy weights: any value, "
                    "a random head accepting at --eagle-acceptance; dummy3: one that fuses target layers)")
    ap.add_argument("--eagle-acceptance", type=float, nargs="+", default=[0.8],
                    help="dummy weights: the head's acceptance rate per draft position (BENCHMARK-ONLY replay)")
    ap.add_argument("--no-ngram", action="store_true", help="leave the n-gram setup out")
    ap.add_argument("--eagle-quantization", nargs="+", default=[], choices=["int8", "none"],
                    help="also run the EAGLE head with these weights (speculative_config quantization; the "
                         "default setup leaves it out)")
    ap.add_argument("--eagle-full-vocab", action="store_true",
                    help="also run the EAGLE head drafting over every target token (speculative_config "
                         "draft_vocab full; real weights)")
    ap.add_argument("--host-drafting", action="store_true",
                    help="also run EAGLE with the host path: verification read back before drafting (on CUDA "
                         "the engine drafts on the device, with one host wait per step)")
    ap.add_argument("--async-drafting", action="store_true",
                    help="also run EAGLE with async drafting (a drafting step's successor launched before its "
                         "tokens are known; engine option async_drafting, off by default)")
    ap.add_argument("--sharegpt-skip", type=int, default=0,
                    help="ShareGPT prompts from after the first N conversations (held out from a head's training)")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--repeats", type=int, default=3,
                    help="runs of each speculative setup per level below c=32, each between two baseline runs")
    ap.add_argument("--repeats-large", type=int, default=2, help="the same from c=32 (longer runs)")
    ap.add_argument("--kv-cache-memory", type=int, default=2 << 30)
    ap.add_argument("--interleave", action="store_true",
                    help="GPU: keep every engine alive and alternate their runs, as on the CPU (with an A/A); "
                         "for models small enough that all engines fit at once")
    ap.add_argument("--out", default=None, help="path without suffix: writes .json and .md")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.policy_trace:
        trace = logging.getLogger("specserve.spec_decode.adaptive")
        trace.addHandler(logging.FileHandler(args.policy_trace, mode="w"))
        trace.setLevel(logging.DEBUG)

    dummy = args.load_format == "dummy"
    max_len = (args.prompt_len if dummy else args.max_prompt_len) + args.max_tokens + 64
    engine_args = dict(dtype=args.dtype, device=args.device, load_format=args.load_format,
                       max_num_seqs=max(args.concurrency), max_model_len=max_len,
                       kv_cache_memory=args.kv_cache_memory)
    if args.device != "cpu":  # room for every level's requests (x2), not 90% of the GPU per engine
        engine_args["num_kv_blocks"] = 2 * max(args.concurrency) * -(-max_len // 16)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=dummy)
    if args.length_spread:
        params = spread_params(args.max_tokens, args.length_spread, dummy, 4096)
    results = {"command": " ".join([Path(sys.executable).name] + sys.argv), "device": args.device,
               "platform": platform.processor() or platform.machine(), "torch_threads": torch.get_num_threads(),
               "load_avg_start": os.getloadavg(), "model": args.model or "SmolLM2-135M-Instruct",
               "dtype": args.dtype, "max_tokens": args.max_tokens, "length_spread": args.length_spread,
               "k": args.num_speculative_tokens,
               "adaptive": not args.no_adaptive, "levels": []}
    # CPU (and GPU with --interleave): all setups alive, each level measured back to back (fair under
    # a varying machine load); GPU: one engine at a time (memory), all levels each. Before the timed
    # runs every level's prompts are prefilled once into the prefix cache, so the identical prefill
    # cost does not dilute the comparison of decoding (what speculation changes).
    names = [name for name, _ in configs(args)]
    groups = [configs(args)] if args.device == "cpu" or args.interleave else [[c] for c in configs(args)]
    rows: dict[tuple[str, int], dict] = {}
    prompts = None
    setups = None
    for group in groups:
        setups = None  # drop the previous group's engines (GPU memory) before building the next
        gc.collect()
        setups = build_setups(args, group, engine_args)
        # as the server's engine process does after start-up (engine/core_process.py): what lives as
        # long as the engines stays out of the collector's scans, so a full collection in a timed run
        # is not a pause over every tensor and module (one took 155 ms of an 8B run of ~4.9 s)
        gc.collect()
        gc.freeze()
        for s in setups:
            policy = getattr(s.proposer, "policy", None)
            costs = getattr(policy, "costs", None)
            if costs is not None and costs.table:
                results.setdefault("step_costs", {})[s.name] = costs.table
            if policy is not None and policy.draft_cost:  # a draft step, in one-request target steps
                results.setdefault("draft_cost", {})[s.name] = round(policy.draft_cost, 4)
                print(f"{s.name}: a draft step costs {policy.draft_cost:.4f} target steps", flush=True)
        prompts = prompts or load_prompts(args, setups[0].llm.tokenizer)
        for dataset, ids in prompts.items():
            offset = 0
            for c in args.concurrency:
                n = requests_per_level(c, args.min_requests, args.waves)
                level_prompts, offset = ids[offset:offset + n], offset + n
                for llm in {id(s.llm): s.llm for s in setups}.values():
                    # with the engine's own proposer: a draft model must see (write KV for) the prompts
                    llm.engine.runner.proposer = llm.engine.proposer
                    llm.generate([{"prompt_token_ids": p} for p in level_prompts], SamplingParams(max_tokens=1))
                if args.device != "cpu":  # untimed: compile kernels / warm caches for this level's shapes
                    for s in setups:
                        s.run(level_prompts, c, params)
                row = rows.setdefault((dataset, c), {"dataset": dataset, "concurrency": c})
                repeats = repeats_for(args, c)
                runs: dict[str, list[dict]] = {s.name: [] for s in setups}
                # none, spec, none, spec, ..., none: each speculative run lies between two baseline
                # runs on the same engine, and is compared with their mean (cancels a drifting load)
                base = [s for s in setups if s.name == "none"]
                others = [s for s in setups if s.name != "none"]
                for _ in range(repeats):
                    for s in base + others:
                        runs[s.name].append(s.run(level_prompts, c, params))
                for s in base:
                    runs[s.name].append(s.run(level_prompts, c, params))
                for s in setups:
                    row[s.name] = merge_runs(runs[s.name])
                    print(f"{dataset:9s} c={c:3d} {s.name:14s} {row[s.name]['tokens_per_s']:8.2f} tok/s  "
                          f"TPOT {row[s.name]['mean_tpot_ms']} ms  mean acceptance length "
                          f"{row[s.name]['mean_acceptance_length']} per position "
                          f"{row[s.name]['acceptance_per_position']}", flush=True)
        setups = s = llm = None  # loop variables hold engines too
        gc.unfreeze()  # the engines may go now
        gc.collect()
        if args.device != "cpu":
            torch.cuda.empty_cache()
    for row in rows.values():
        add_ratios(row, names, interleaved=len(groups) == 1)
        results["levels"].append(row)
    results["load_avg_end"] = os.getloadavg()
    table = markdown(results, names)
    print(table)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out + ".json").write_text(json.dumps(results, indent=2))
        Path(args.out + ".md").write_text(table)
    return 0


def markdown(results: dict, names: list[str]) -> str:
    spread = results.get("length_spread")
    spread_note = f" less up to {spread:g} of them (per request, --length-spread)" if spread else ""
    lines = [f"Command: `{results['command']}`", "",
             f"Model {results['model']} ({results['dtype']}, {results['device']}, "
             f"{results['torch_threads']} torch "
             f"threads), greedy, max {results['max_tokens']} output tokens"
             f"{spread_note}"
             f", k <= {results['k']}"
             f"{' (adaptive)' if results['adaptive'] else ''}. Load average at start/end: "
             f"{results['load_avg_start'][0]:.1f} / {results['load_avg_end'][0]:.1f}.", ""]
    for name, table in results.get("step_costs", {}).items():
        lines += [f"Measured step costs ({name}; tokens: x a one-token forward): "
                  + ", ".join(f"{n}: {c:.2f}" for n, c in table), ""]
    head = ["dataset", "conc.", "reqs", "runs"]
    for n in names:
        head += [f"{n} tok/s"] + ([] if n == "none" else [f"{n} speedup", "per run", f"{n} mean acc. len"])
    head += ["A/A (none)", "per run"] + [f"{n} TPOT ms" for n in names]
    lines += ["Speedup: the median over runs of a speculative run's tokens/s over the mean of the two baseline "
              "runs just before and after it (same engine, same prompts). A/A: the same statistic for a "
              "baseline run between two baseline runs: the noise floor.", ""]
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in results["levels"]:
        cells = [row["dataset"], str(row["concurrency"]), str(row["none"]["requests"]),
                 str(row[names[-1]].get("repeats", 1))]
        for n in names:
            r = row[n]
            cells.append(f"{r['tokens_per_s']:.1f}")
            if n != "none":
                cells += [f"{r['speedup']:.2f}x", " ".join(f"{x:.2f}" for x in r.get("speedup_runs", [])),
                          str(r["mean_acceptance_length"] or "-")]
        cells += [f"{row['control']:.2f}x" if "control" in row else "-",
                  " ".join(f"{x:.2f}" for x in row.get("control_runs", []))]
        cells += [str(row[n]["mean_tpot_ms"]) for n in names]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "Per run, in order (what may explain a slow one): tok/s; the request-steps that verified drafts, and "
              "the steps; steps not left in flight (async scheduling) "
              "and their mean ms; the three slowest steps, ms; garbage collection ms; the CUDA allocator's device "
              "allocations / retries; kernels Triton compiled; the host's speed after the run (a fixed piece of "
              "pure Python, ms: higher is slower).", ""]
    for row in results["levels"]:
        for n in names:
            lines.append(f"- {row['dataset']}, {row['concurrency']}, {n}: " + "; ".join(
                run_diagnostics(run) for run in runs_of(row[n])))
    return "\n".join(lines) + "\n"


def runs_of(merged: dict) -> list[dict]:
    """A level's runs of one setup, each a dict of its own numbers (`merge_runs` keeps them as lists)."""
    per_run = merged.get("tokens_per_s_runs")
    if per_run is None:
        return [merged]
    return [{"tokens_per_s": tps, "steps": merged["steps_runs"][i], "num_drafts": merged["num_drafts_runs"][i],
             **{k: merged[k][i] for k in PER_RUN_KEYS}} for i, tps in enumerate(per_run)]


def run_diagnostics(run: dict) -> str:
    sync = run["sync_steps"]
    mean_sync = f"{1000 * run['sync_steps_s'] / sync:.2f}" if sync else "-"
    return (f"{run['tokens_per_s']:.0f} tok/s, {run['num_drafts']} drafting request-steps of {run['steps']} steps, "
            f"{sync} sync {mean_sync} ms, slowest "
            f"{'/'.join(f'{t:g}' for t in run['slowest_steps_ms'])}, gc {run['gc_ms']:g}, allocs "
            f"{run['device_allocs']}/{run['alloc_retries']}, compiled {run['kernels_compiled']}, "
            f"host probe {run['host_probe_ms']:g} ms")


if __name__ == "__main__":
    sys.exit(main())
