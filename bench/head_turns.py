"""An EAGLE head's acceptance per turn of multi-turn conversations: held-out ShareGPT conversations
answered by the target itself for several turns (`train-draft --regenerate-turns`'s code), then the
head's held-out estimate (train_eval: every start, and as served) over each turn's answer alone,
and the share of each answer's tokens that end a 4-gram seen earlier in the conversation (text the
target copies from its context). Answers to later turns read longer contexts and follow prompts
that replied to another model's answer: does a head trained on first answers draft them worse?

    python bench/head_turns.py --conversations 48 --turns 3 --out bench/results/head_turns_cpu_v5
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from prompts import SHAREGPT, _member, iter_json_array  # noqa: E402

from specserve.spec_decode import fuse_target_layers, train_data  # noqa: E402
from specserve.spec_decode.eagle_head import load_head, shipped_head  # noqa: E402
from specserve.spec_decode.train import build_head  # noqa: E402
from specserve.spec_decode.train_eval import _served, chain_hits, every_start  # noqa: E402
from specserve.spec_decode.train_target import TargetFeatures, load_target, regenerate  # noqa: E402


def held_out(skip: int, count: int, turns: int) -> list[list[dict]]:
    """ShareGPT records from `skip` on (the benchmark's held-out ones start at 8000) with at least
    `turns` answers and a first prompt of at most 4000 characters, as OpenAI messages."""
    text = _member(*SHAREGPT).decode("utf-8", errors="replace")
    convs = []
    for i, record in enumerate(iter_json_array(text)):
        if i < skip:
            continue
        messages = train_data._messages(record)
        if messages is None or messages[0]["role"] != "user":
            continue
        answers = [j for j, m in enumerate(messages) if m["role"] == "assistant"]
        if len(answers) >= turns and sum(len(m["content"]) for m in messages[:answers[0]]) <= 4000:
            convs.append(messages[:answers[turns - 1] + 1])
            if len(convs) == count:
                break
    return convs


REPEAT_N = 4


def _repeats(ids: list[int]) -> np.ndarray:
    """Per position j: do the REPEAT_N tokens ending at j occur earlier in the sequence (ending before
    j)? Text a model copies from its context (an earlier answer, the prompt) is easy to draft."""
    seen, out = set(), np.zeros(len(ids), dtype=bool)
    for j in range(REPEAT_N - 1, len(ids)):
        gram = tuple(ids[j - REPEAT_N + 1:j + 1])
        out[j] = gram in seen
        seen.add(gram)
    return out


@torch.no_grad()
def quantize(head, kind: str) -> None:
    """int8: the head's weights as a chain step reads them when served with speculative_config
    quantization int8 (`EagleHead.use_int8_weights`, its int8 rows at any row count); fp8: each weight
    matrix (the linear layers, the draft LM head's rows) rounded per output row to e4m3 and back, in
    place (not served: an estimate)."""
    if kind == "int8":
        head.use_int8_weights()
        for module in head.modules():  # the estimate's dense forward over whole answers: the int8 rows too,
            if hasattr(module, "max_int8_rows"):  # as a chain step (a few rows) reads them when served
                module.max_int8_rows = 1 << 62
        return
    def rounded(w: torch.Tensor) -> torch.Tensor:
        w32 = w.float()
        scale = w32.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / 448  # e4m3's largest finite value
        return ((w32 / scale).to(torch.float8_e4m3fn).float() * scale).to(w.dtype)

    for module in head.modules():
        if isinstance(module, torch.nn.Linear):
            module.weight.copy_(rounded(module.weight))
    head._lm_head.copy_(rounded(head._lm_head))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--head", default=None, help="a head directory (default: the one shipped for the default model)")
    ap.add_argument("--target", default="default")
    ap.add_argument("--conversations", type=int, default=48)
    ap.add_argument("--turns", type=int, default=2)
    ap.add_argument("--skip", type=int, default=8000, help="the first ShareGPT record to read")
    ap.add_argument("--max-tokens", type=int, default=128, help="the longest regenerated answer")
    ap.add_argument("--max-len", type=int, default=2048)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--weights", choices=["as-is", "int8", "fp8"], default="as-is",
                    help="the head's weights (its layer, fc, fuse and draft LM head): int8 as served with "
                    "speculative_config quantization int8, or fp8 e4m3 per output row (rounded and back: an estimate)")
    ap.add_argument("--regenerated", default=None,
                    help="a .json of the answered conversations: read if it exists, else written after answering")
    ap.add_argument("--out", default=None, help="a path without suffix: .json and .md are written")
    args = ap.parse_args()
    device = torch.device(args.device)
    loaded = load_target(args.target, device, args.dtype, args.max_len)
    head_dir = args.head or shipped_head(loaded.path)
    saved = load_head(head_dir, dtype=torch.float32, device=torch.device("cpu"), max_positions=1)
    fuse_target_layers(loaded, saved.aux_layers)
    head = build_head(loaded, saved.draft_vocab, args.max_len, head_dir, device, 0, saved.aux_layers).eval()
    if args.weights != "as-is":
        quantize(head, args.weights)

    t0 = time.monotonic()
    cache = Path(args.regenerated) if args.regenerated else None
    if cache is not None and cache.is_file():
        answered = json.loads(cache.read_text())
        num_convs = len(answered)  # the conversations asked are not known: as many as were answered
    else:
        convs = held_out(args.skip, args.conversations, args.turns)
        num_convs = len(convs)
        answered = regenerate(loaded.path, args.dtype, device, args.max_len, args.max_tokens, {"eval": convs},
                              lambda text: print(text, flush=True), args.turns)["eval"]
        if cache is not None:
            cache.write_text(json.dumps(answered))
    regen_s = time.monotonic() - t0
    seqs = [s for s in train_data.render_all(loaded.tokenizer, answered, args.max_len) if s is not None]
    features = TargetFeatures(loaded, device, args.max_len, head.draft_vocab.to(device))
    # per turn: answers, served chains / accepted, chains / accepted, answer tokens / repeats
    per_turn = [[0, 0, 0, 0, 0, 0, 0] for _ in range(args.turns)]
    k = args.k
    for seq in seqs:
        ids, hidden, argmax = features.greedy(seq)
        with torch.no_grad():
            hit = chain_hits(head, head.train_forward(ids, hidden, k), argmax)
        labels = seq.labels
        repeats = _repeats(ids.tolist())
        edges = np.flatnonzero(np.diff(np.concatenate([[0], labels.astype(np.int8), [0]])))
        for turn, (a, b) in enumerate(zip(edges[::2], edges[1::2])):
            only = np.zeros_like(labels)
            only[a:b] = True
            chains, accepted = _served(hit, only, k)
            starts, reached = every_start(hit, only, k)
            row = per_turn[turn]
            row[0] += 1
            row[1], row[2] = row[1] + chains, row[2] + accepted
            row[3], row[4] = row[3] + starts, row[4] + int(reached.sum())
            row[5], row[6] = row[5] + int(b - a), row[6] + int(repeats[a:b].sum())
    rows = [{"turn": t + 1, "answers": n, "served_chains": c,
             "served_mean_acceptance_length": round(1 + acc / max(1, c), 4),
             "chains": s, "mean_acceptance_length": round(1 + r / max(1, s), 4),
             "tokens": m, "repeated_share": round(rep / max(1, m), 4)}
            for t, (n, c, acc, s, r, m, rep) in enumerate(per_turn)]
    result = {"command": " ".join(["python", *sys.argv]), "head": str(head_dir), "weights": args.weights,
              "target": loaded.path,
              "dtype": args.dtype, "device": args.device, "k": k, "max_tokens": args.max_tokens,
              "conversations": num_convs, "regenerated": len(answered), "regenerate_s": round(regen_s, 1),
              "turns": rows}
    lines = [f"`{result['command']}`", "",
             f"head {head_dir} (weights {args.weights}), target {Path(loaded.path).name}, {args.dtype} on "
             f"{args.device}, k = {k}, answers of at "
             f"most {args.max_tokens} tokens; {num_convs} held-out conversations with {args.turns}+ answers, "
             f"{len(answered)} answered ({regen_s:.0f} s)", "",
             "| turn | answers | served mean acceptance length (chains) | every start (chains) | tokens repeating "
             f"a {REPEAT_N}-gram seen before |", "|---|---|---|---|---|"]
    lines += [f"| {r['turn']} | {r['answers']} | {r['served_mean_acceptance_length']:.3f} ({r['served_chains']}) | "
              f"{r['mean_acceptance_length']:.3f} ({r['chains']}) | {r['repeated_share']:.1%} of {r['tokens']} |"
              for r in rows]
    print("\n".join(lines))
    if args.out:
        Path(args.out).with_suffix(".json").write_text(json.dumps(result, indent=1))
        Path(args.out).with_suffix(".md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
