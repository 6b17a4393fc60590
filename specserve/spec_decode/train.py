"""`specserve train-draft`: train an EAGLE-style draft head (eagle_head.py) on the target's own
hidden states over chat data.

Per step: one ragged target forward over its conversations through a ModelExecutor (exactly the
hidden states the engine hands the head when serving), the target's next-token distribution at
every assistant row as the label (its log-softmax over the full vocabulary, of logits / T at
--label-temperature T, read at the draft vocabulary's columns: the mass outside is dropped), then
the head's training-time test over `ttt_depth` chain depths on all the step's conversations packed end to end (one
`EagleHead.train_forward`: the step's operator count does not grow with its batch). The loss of
depth d is the soft cross-entropy between the two at the rows j >= d that predict an assistant
token, averaged over the step's rows, weighted 0.8 ** d. The target is frozen; only the head
learns (AdamW, linear warm-up then cosine decay, gradient clipping at 1.0).

A run is reproducible from its seed: the data order of every epoch is a seeded permutation, and a
checkpoint (training_state.pt) holds the head, the optimizer, the step, the RNG states and the
order, so `--resume` continues exactly where the run stopped.
"""
from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TextIO

import numpy as np
import torch
from torch import nn

from specserve.spec_decode import train_data
from specserve.config import is_head_dir
from specserve.spec_decode import fuse_target_layers
from specserve.spec_decode.eagle_head import (FUSE_PARAMS, WEIGHTS, EagleHead, default_aux_layers, head_config,
                                               load_head, packed_positions, save_head, target_weights)
from specserve.spec_decode.train_eval import Acceptance, EvalSet, acceptance
from specserve.spec_decode.train_target import REGENERATED_FILE, TargetFeatures, load_target, regenerate

logger = logging.getLogger(__name__)

STATE_FILE = "training_state.pt"
SUMMARY_FILE = "training.json"
DEPTH_WEIGHT = 0.8
DEFAULT_DRAFT_VOCAB_SIZE = 8192
DEFAULT_MAX_LEN = 2048
INITS = ("last-layer", "random")
SAVE_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
# what a resumed run must share with the checkpoint for its data order and schedule to continue
_RUN_OPTIONS = ("max_len", "max_conversations", "eval_conversations", "draft_vocab_size", "ttt_depth", "lr",
                "warmup_steps", "batch_size", "epochs", "max_steps", "seed", "init", "fuse_layers", "regenerate",
                "regenerate_max_tokens", "regenerate_turns", "label_temperature")


@dataclass
class TrainConfig:
    """The options of `specserve train-draft` (flag names with underscores)."""
    target: str | None  # HF dir / .gguf / hub id; None or "default": the default model
    data: str  # a JSON / JSONL file of conversations, or "sharegpt"
    out: str
    max_len: int | None = None  # None: 2048, or the target's context length if it is shorter
    max_conversations: int | None = None
    eval_conversations: int = 64
    draft_vocab_size: int | None = None  # None: 8192, or the whole vocabulary if it is smaller
    ttt_depth: int = 4
    lr: float = 1e-3
    warmup_steps: int | None = None  # None: 3% of the steps
    batch_size: int = 8
    epochs: int = 1
    max_steps: int | None = None  # cap on the planned steps (the schedule's length)
    max_minutes: float | None = None  # stop taking steps after this long (this invocation), then save
    stop_after_steps: int | None = None  # take at most this many steps in this invocation, then save
    eval_every: int = 100
    save_every: int = 200
    seed: int = 0
    init: str = "last-layer"  # or a head directory to start from
    fuse_layers: str = "auto"  # target layers the head fuses: auto (where the target can), none, or "2,15"
    device: str = "auto"
    dtype: str = "auto"
    threads: int | None = None
    save_dtype: str = "bfloat16"  # the saved head's weights (the checkpoint keeps fp32 ones)
    resume: bool = False
    regenerate: bool = False  # train on the target's own answers to the data's prompts
    regenerate_max_tokens: int = 512
    regenerate_turns: int = 1  # answers per conversation: the data's first prompt, then its next user turns
    label_temperature: float = 1.0  # the label: softmax(target logits / T); 0: the target's argmax, one-hot

    def __post_init__(self) -> None:
        for name in ("ttt_depth", "batch_size", "epochs", "eval_every", "save_every", "regenerate_turns"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(self, name)}")
        for name in ("max_len", "max_conversations", "max_steps", "stop_after_steps", "threads", "draft_vocab_size",
                     "regenerate_max_tokens"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be at least 1, got {value}")
        if self.eval_conversations < 0 or (self.warmup_steps is not None and self.warmup_steps < 0):
            raise ValueError("--eval-conversations and --warmup-steps cannot be negative")
        if not self.label_temperature >= 0 or math.isinf(self.label_temperature):
            raise ValueError(f"--label-temperature must be a finite number >= 0, got {self.label_temperature}")
        if not self.lr > 0 or (self.max_minutes is not None and not self.max_minutes > 0):
            raise ValueError("--lr and --max-minutes must be positive")
        if self.save_dtype not in SAVE_DTYPES:
            raise ValueError(f"--save-dtype {self.save_dtype!r}: choose {', '.join(SAVE_DTYPES)}")
        if self.init not in INITS and not is_head_dir(self.init):
            raise ValueError(f"--init {self.init!r}: choose {' or '.join(INITS)}, or give a head directory "
                             "(made by `specserve train-draft`)")
        parse_fuse_layers(self.fuse_layers, 1 << 30)  # the format; the range once the target is known
        if self.regenerate_turns > 1 and not self.regenerate:
            raise ValueError("--regenerate-turns applies to --regenerate (the target answering the data's prompts)")
        if self.ttt_depth > 16:
            raise ValueError(f"--ttt-depth {self.ttt_depth}: at most 16 (the engine drafts at most 16 tokens)")


def train(cfg: TrainConfig, command: list[str] | None = None, stream: TextIO | None = None) -> dict:
    """Train a head into cfg.out; returns the summary also written to cfg.out/training.json."""
    t_start = time.monotonic()
    stream = stream or sys.stderr
    out = Path(cfg.out)
    state_path = out / STATE_FILE
    if cfg.resume and not state_path.is_file():
        raise ValueError(f"--resume: {out} holds no checkpoint ({STATE_FILE})")
    if not cfg.resume and state_path.exists():
        raise ValueError(f"{out} already holds a training checkpoint: give --resume to continue it, "
                         "or another --out")
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    device = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if cfg.device == "auto" else cfg.device)
    data_path = train_data.resolve_data_path(cfg.data)  # a missing file fails before the model loads
    loaded = load_target(cfg.target, device, cfg.dtype, cfg.max_len)
    vocab_size = loaded.arch.vocab_size
    max_len = cfg.max_len or min(DEFAULT_MAX_LEN, loaded.arch.max_position_embeddings)

    # the layers the head fuses, checked against the target before the data is prepared (which may
    # take the target minutes to answer with --regenerate)
    aux_layers = parse_fuse_layers(cfg.fuse_layers, loaded.arch.num_layers)
    if cfg.fuse_layers == "auto" and not hasattr(loaded.model, "aux_layers"):
        aux_layers = ()  # not a Llama-family target: the head reads its final hidden state alone
        print(f"train-draft: {loaded.arch.architecture} cannot return its layers' outputs: the head reads "
              "the final hidden state alone (--fuse-layers none)", file=stream, flush=True)
    fuse_target_layers(loaded, aux_layers)

    data = _prepare_data(cfg, data_path, loaded, max_len, device, stream)
    if cfg.init not in INITS:  # a head to start from brings its own draft vocabulary
        data.draft_vocab = load_head(cfg.init, dtype=torch.float32, device=torch.device("cpu"),
                                     max_positions=1).draft_vocab.tolist()
        data.coverage = train_data.coverage(train_data.label_counts(data.train), data.draft_vocab)
    train_seqs, eval_seqs, draft_vocab, coverage = data.train, data.eval, data.draft_vocab, data.coverage
    identity = {"target": Path(loaded.path).name, "vocab_size": vocab_size, "hidden_size": loaded.arch.hidden_size,
                "intermediate_size": loaded.arch.intermediate_size, "num_heads": loaded.arch.num_heads,
                "draft_vocab_size": len(draft_vocab), "data": train_data.fingerprint(train_seqs)}

    head = build_head(loaded, torch.tensor(draft_vocab), max_len, cfg.init, device, cfg.seed, aux_layers)
    optimizer = torch.optim.AdamW(head.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.0)
    steps_per_epoch = math.ceil(len(train_seqs) / cfg.batch_size)
    total_steps = cfg.epochs * steps_per_epoch if cfg.max_steps is None else \
        min(cfg.max_steps, cfg.epochs * steps_per_epoch)
    warmup = cfg.warmup_steps if cfg.warmup_steps is not None else max(1, round(0.03 * total_steps))
    batches = _batches(len(train_seqs), cfg.batch_size, cfg.epochs, cfg.seed)[:total_steps]
    step, history, elapsed_before = 0, [], 0.0
    if cfg.resume:
        state = torch.load(state_path, map_location="cpu", weights_only=True)
        _check_resume(state, identity, cfg, out)
        head.load_state_dict(state["head"])
        optimizer.load_state_dict(state["optimizer"])
        torch.set_rng_state(state["rng"])
        if device.type == "cuda" and state.get("cuda_rng") is not None:
            torch.cuda.set_rng_state(state["cuda_rng"], device)
        step, history, elapsed_before, batches = state["step"], state["history"], state["elapsed_s"], state["order"]

    features = TargetFeatures(loaded, device, max_len, torch.tensor(draft_vocab, device=device), cfg.batch_size,
                              cfg.label_temperature)
    eval_set = EvalSet(eval_seqs, features) if eval_seqs else None
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else contextlib.nullcontext()

    def save() -> None:
        out.mkdir(parents=True, exist_ok=True)
        save_head(head, out, extra={"ttt_depth": cfg.ttt_depth, "draft_vocab_coverage": round(coverage, 4)})
        _cast_weights(out / WEIGHTS, SAVE_DTYPES[cfg.save_dtype])
        state = {"step": step, "head": head.state_dict(), "optimizer": optimizer.state_dict(),
                 "rng": torch.get_rng_state(), "cuda_rng": torch.cuda.get_rng_state(device)
                 if device.type == "cuda" else None, "order": batches, "history": history,
                 "elapsed_s": elapsed_before + time.monotonic() - t_start, "identity": identity,
                 "options": {k: getattr(cfg, k) for k in _RUN_OPTIONS}}
        tmp = state_path.with_suffix(".tmp")
        torch.save(state, tmp)
        os.replace(tmp, state_path)

    def evaluate() -> Acceptance:
        nonlocal eval_seconds
        t0 = time.monotonic()
        result = acceptance(head, eval_set, cfg.ttt_depth, autocast)
        eval_seconds += time.monotonic() - t0
        return result

    bar = ProgressBar(total_steps, step, stream)
    bar.message(f"train-draft: {len(train_seqs)} conversations ({data.stats()['train_tokens']} tokens) for "
                f"training, {len(eval_seqs)} held out; draft vocabulary {len(draft_vocab)} tokens "
                f"covering {coverage:.1%} of assistant tokens; {total_steps} steps on {device}")
    estimate, estimate_step = None, -1
    t_loop, eval_seconds, num_tokens, stop_reason = time.monotonic(), 0.0, 0, "done"
    # with --max-minutes the schedule also follows the clock: the learning rate reaches 0 when the
    # steps or this invocation's minutes run out, whichever comes first
    step_seconds = None if cfg.max_minutes is None else max(1.0, cfg.max_minutes * 60 - (t_loop - t_start))
    steps_this_run = 0
    while step < total_steps:
        if cfg.max_minutes is not None and time.monotonic() - t_start > cfg.max_minutes * 60:
            stop_reason = "time"
            break
        if cfg.stop_after_steps is not None and steps_this_run >= cfg.stop_after_steps:
            stop_reason = "stop_after_steps"
            break
        head.train()
        try:
            loss_sum, batch_tokens = _accumulate(head, features, [train_seqs[i] for i in batches[step]], autocast,
                                                 cfg.ttt_depth)
        except KeyboardInterrupt:  # the step is dropped whole: the checkpoint stays one of a step boundary
            optimizer.zero_grad(set_to_none=True)
            stop_reason = "interrupted"
            break
        nn.utils.clip_grad_norm_(head.parameters(), 1.0)
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(step, cfg.lr, warmup, total_steps,
                                        0.0 if step_seconds is None else (time.monotonic() - t_loop) / step_seconds)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1
        steps_this_run += 1
        num_tokens += batch_tokens
        history.append(round(loss_sum, 5))
        stats = {"loss": f"{loss_sum:.4f}",
                 "tok/s": f"{num_tokens / (time.monotonic() - t_loop - eval_seconds):.0f}"}
        if eval_set is not None and step % cfg.eval_every == 0 and step < total_steps:
            estimate, estimate_step = evaluate(), step
            stats["accept"] = f"{estimate.mean_acceptance_length:.2f}"
            bar.message(f"step {step}: held-out mean acceptance length {estimate.mean_acceptance_length:.3f} "
                        f"(k={cfg.ttt_depth}, every start; per position {estimate.per_position_str()}), "
                        f"{estimate.served_mean_acceptance_length:.3f} as served")
        bar.update(step, stats)
        if step % cfg.save_every == 0 and step < total_steps:
            save()
    train_time = time.monotonic() - t_loop - eval_seconds
    bar.close()
    if eval_set is not None and estimate_step != step:
        estimate = evaluate()
    save()
    summary = {
        "command": command, "target": loaded.path, "device": str(device), "target_dtype": str(loaded.dtype),
        "stopped": stop_reason, "steps": step, "planned_steps": total_steps, "steps_this_run": steps_this_run,
        "final_loss": history[-1] if history else None, "loss_history": history,
        "time_s": round(elapsed_before + time.monotonic() - t_start, 1),
        "tokens_per_s": round(num_tokens / train_time, 1) if train_time > 0 and num_tokens else None,
        "data": data.stats(),
        "draft_vocab": {"size": len(draft_vocab), "coverage": round(coverage, 4)},
        "acceptance": estimate.as_dict() if estimate is not None else None,
        "options": asdict(cfg),
    }
    (out / SUMMARY_FILE).write_text(json.dumps(summary, indent=2) + "\n")
    return summary


@dataclass
class _Data:
    path: Path
    num_read: int  # usable conversations in the file
    num_skipped: int  # of those picked for training, the ones the chat template refused or left no answer
    train: list[train_data.Sequence]
    eval: list[train_data.Sequence]
    draft_vocab: list[int]
    coverage: float  # the share of the training data's assistant tokens in draft_vocab

    def stats(self) -> dict:
        return {"path": str(self.path), "conversations_read": self.num_read,
                "train_conversations": len(self.train), "train_skipped": self.num_skipped,
                "train_tokens": sum(len(s.token_ids) for s in self.train),
                "train_assistant_tokens": sum(s.num_label_rows for s in self.train),
                "eval_conversations": len(self.eval)}


def _prepare_data(cfg: TrainConfig, path: Path, loaded, max_len: int, device: torch.device,
                  stream: TextIO) -> _Data:
    """The held-out split from the end of the data, the training conversations before it (both
    answered anew by the target with --regenerate), rendered; the draft vocabulary from the
    training data's assistant tokens."""
    saved = train_data.read_regenerated(path)
    if saved is not None:  # another run's regenerated.json: its own split, already the target's answers
        if cfg.regenerate:
            raise ValueError(f"{path} holds answers a --regenerate run made already: leave --regenerate off")
        train_convs, eval_convs = saved[0][:cfg.max_conversations], saved[1]
        num_read = len(saved[0]) + len(saved[1])
        if not train_convs:
            raise ValueError(f"{path} has no training conversations")
        print(f"train-draft: {path} is a regenerated.json: {len(train_convs)} answers to train on, its "
              f"{len(eval_convs)} held-out ones for the estimate (--eval-conversations does not apply)",
              file=stream, flush=True)
    else:
        conversations = train_data.read_conversations(path)
        num_read, num_eval = len(conversations), cfg.eval_conversations
        if len(conversations) <= num_eval:
            raise ValueError(f"{path} has {len(conversations)} usable conversations: not enough for "
                             f"--eval-conversations {num_eval} held out and some to train on")
        train_convs = conversations[:len(conversations) - num_eval][:cfg.max_conversations]
        eval_convs = conversations[len(conversations) - num_eval:]
    num_selected = len(train_convs)
    if cfg.regenerate:
        train_convs, eval_convs = _regenerated(cfg, loaded, max_len, device, stream, train_convs, eval_convs)
    rendered = train_data.render_all(loaded.tokenizer, train_convs, max_len)
    train_seqs = [s for s in rendered if s is not None]
    if not train_seqs:
        raise ValueError(f"no usable conversations in {path}: none of {len(train_convs)} has an assistant "
                         "turn the target's chat template renders")
    held_out = train_data.render_all(loaded.tokenizer, eval_convs, max_len)
    vocab_size = loaded.arch.vocab_size
    size = cfg.draft_vocab_size or min(DEFAULT_DRAFT_VOCAB_SIZE, vocab_size)
    draft_vocab, coverage = train_data.draft_vocabulary(train_data.label_counts(train_seqs), size, vocab_size,
                                                        loaded.eos_token_ids)
    return _Data(path, num_read, num_selected - len(train_seqs), train_seqs,
                 [s for s in held_out if s is not None], draft_vocab, coverage)


def _regenerated(cfg: TrainConfig, loaded, max_len: int, device: torch.device, stream: TextIO,
                 train_convs: list[list[dict]], eval_convs: list[list[dict]]) -> tuple[list, list]:
    """--regenerate: the target's own answers, made once per --out (kept in regenerated.json, which
    --resume reads back, so a resumed run trains on the same text)."""
    path = Path(cfg.out) / REGENERATED_FILE
    if cfg.resume and path.is_file():
        saved = json.loads(path.read_text())
        return saved["train"], saved["eval"]
    out = regenerate(loaded.path, cfg.dtype, device, max_len, cfg.regenerate_max_tokens,
                     {"train": train_convs, "eval": eval_convs}, lambda text: print(text, file=stream, flush=True),
                     cfg.regenerate_turns)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out))
    return out["train"], out["eval"]


def _accumulate(head: EagleHead, features: TargetFeatures, seqs: list[train_data.Sequence], autocast,
                depth: int, labelled: tuple | None = None) -> tuple[float, int]:
    """One target forward and one head forward + backward over the step's conversations, packed end
    to end. Returns (the step's loss, its tokens)."""
    ids, hidden, target_logp = labelled if labelled is not None else features.labelled_batch(seqs)
    with autocast:
        loss = batch_loss(head, ids, hidden, target_logp, seqs, depth)
    loss.backward()
    return loss.item(), len(ids)


def batch_loss(head: EagleHead, ids: torch.Tensor, hidden: torch.Tensor, target_logp: torch.Tensor,
               seqs: list[train_data.Sequence], depth: int) -> torch.Tensor:
    """ids [T], hidden [T, h]: the sequences `seqs` packed end to end (the target's hidden states);
    target_logp [R, Vd] at their R label rows in order. Returns sum_d 0.8^d * the mean soft-CE at
    depth d over the label rows j >= d of each sequence (rows j < d have no chain of depth d)."""
    seq_lens = [len(s.token_ids) for s in seqs]
    outputs = head.train_forward(ids, hidden, depth, seq_lens)
    labels = np.concatenate([s.labels for s in seqs])
    local = packed_positions(seq_lens)
    label_rows = np.flatnonzero(labels)
    target_p = target_logp.exp()
    total = hidden.new_zeros((), dtype=torch.float32)
    for d, g in enumerate(outputs):
        chained = local[label_rows] >= d  # of the label rows, those that continue a chain of depth d
        if not chained.any():
            continue
        rows = torch.from_numpy(label_rows[chained]).to(g.device, non_blocking=True)
        picked = torch.from_numpy(np.flatnonzero(chained)).to(g.device, non_blocking=True)
        ce = nn.functional.cross_entropy(head.compute_logits(g[rows]), target_p[picked], reduction="sum")
        total = total + DEPTH_WEIGHT ** d * ce / int(chained.sum())
    return total


def learning_rate(step: int, peak: float, warmup: int, total: int, time_fraction: float = 0.0) -> float:
    """Linear warm-up over `warmup` steps, then cosine decay to 0 at `total`, or earlier where the
    share of the time budget used (`time_fraction`) is ahead of the steps."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = max((step - warmup) / max(1, total - warmup), time_fraction)
    return peak * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


def parse_fuse_layers(value: str, num_layers: int) -> tuple[int, ...]:
    """--fuse-layers: none, auto (`default_aux_layers`) or comma-separated layer indices below the
    target's last layer (its output is the final hidden state the head reads anyway)."""
    if value == "none":
        return ()
    if value == "auto":
        return default_aux_layers(num_layers)
    try:
        layers = tuple(sorted({int(x) for x in value.split(",")}))
    except ValueError:
        raise ValueError(f"--fuse-layers {value!r}: none, auto, or layer indices like 2,15") from None
    if not layers or layers[0] < 0 or layers[-1] >= num_layers - 1:
        raise ValueError(f"--fuse-layers {value!r}: layer indices from 0 to {num_layers - 2} (the target has "
                         f"{num_layers} layers; the last one's output is the final hidden state)")
    return layers


def build_head(loaded, draft_vocab: torch.Tensor, max_len: int, init: str, device: torch.device,
               seed: int, aux_layers: tuple[int, ...] = ()) -> EagleHead:
    """An fp32 head attached to the target. `last-layer`: the layer starts as a copy of the target's
    last decoder layer, fc passes the embedding through and ignores the hidden state, the final norm
    is the target's: a model that already predicts from the current token. `random`: PyTorch's
    default initialisation. A head directory: its weights (and `draft_vocab`, which must be its
    draft vocabulary). Fused layers (`aux_layers`) start ignored (`init_fuse_identity`) unless
    that head fused the same ones."""
    torch.manual_seed(seed)
    target = loaded.model
    target.requires_grad_(False)
    with torch.device(device):
        head = EagleHead(head_config(loaded.arch), max_len, draft_vocab, target_name=Path(loaded.path).name,
                         aux_layers=aux_layers)
    head.float()
    if aux_layers:
        head.init_fuse_identity()
    if init not in INITS:
        start = load_head(init, dtype=torch.float32, device=device, max_positions=max_len)
        if start.cfg.hidden_size != head.cfg.hidden_size or start.cfg.vocab_size != head.cfg.vocab_size:
            raise ValueError(f"--init {init}: that head was trained for hidden size {start.cfg.hidden_size} and "
                             f"{start.cfg.vocab_size} tokens, the target has {head.cfg.hidden_size} and "
                             f"{head.cfg.vocab_size}")
        weights = start.state_dict()
        if start.aux_layers != head.aux_layers:  # fusing other layers: fuse starts afresh
            weights = {k: v for k, v in weights.items() if not k.startswith(FUSE_PARAMS)}
        missing, unexpected = head.load_state_dict(weights, strict=False)
        if unexpected or any(not k.startswith(FUSE_PARAMS) for k in missing):
            raise ValueError(f"--init {init}: its weights do not fit this head ({missing + unexpected})")
    elif init == "last-layer":
        with torch.no_grad():
            last = dict(target.layers[-1].named_parameters())
            for name, p in head.layers[0].named_parameters():
                p.copy_(last[name].float())
            h = loaded.arch.hidden_size
            head.fc.weight.zero_()
            head.fc.weight[:, :h].copy_(torch.eye(h))
            head.norm.weight.copy_(target.norm.weight.float())
    head.attach(*target_weights(loaded, device, loaded.dtype))
    # the head learns in fp32 (autocast gives bf16 matmuls on CUDA); the target's rows stay frozen
    head._lm_head = head._lm_head.float()
    return head


def _cast_weights(path: Path, dtype: torch.dtype) -> None:
    """Store the saved head's float tensors in `dtype` (bf16 halves the file; the head serves in the
    target's dtype anyway)."""
    if dtype == torch.float32:
        return
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(path))
    save_file({k: v.to(dtype) if v.is_floating_point() else v for k, v in tensors.items()}, str(path))


def _batches(num: int, batch_size: int, epochs: int, seed: int) -> list[list[int]]:
    """The data order: per epoch a seeded permutation cut into batches (the last one may be short)."""
    out = []
    for epoch in range(epochs):
        perm = torch.randperm(num, generator=torch.Generator().manual_seed(seed * 1000 + epoch)).tolist()
        out += [perm[i:i + batch_size] for i in range(0, num, batch_size)]
    return out


def _check_resume(state: dict, identity: dict, cfg: TrainConfig, out: Path) -> None:
    theirs = state["identity"]
    for key in ("target", "vocab_size", "hidden_size", "intermediate_size", "num_heads", "draft_vocab_size"):
        if theirs.get(key) != identity[key]:
            raise ValueError(f"--resume: the checkpoint in {out} is for another target or shape ({key} "
                             f"{theirs.get(key)!r}, this run {identity[key]!r})")
    if theirs.get("data") != identity["data"]:
        raise ValueError(f"--resume: the checkpoint in {out} was trained on other data (or other --max-len / "
                         "--max-conversations): the data order would not continue")
    # checkpoints from before fused heads fused none; from before --regenerate-turns, one turn; from
    # before --label-temperature, the target's distribution as it is
    options = {"fuse_layers": "none", "regenerate_turns": 1, "label_temperature": 1.0, **state["options"]}
    changed = [f"--{k.replace('_', '-')} {getattr(cfg, k)} (checkpoint: {v})" for k, v in options.items()
               if getattr(cfg, k) != v]
    if changed:
        raise ValueError(f"--resume continues the same run; these options differ from the checkpoint's: "
                         f"{', '.join(changed)}")


class ProgressBar:
    """A tqdm bar on a terminal; plain lines (about 20 per run, and every message) elsewhere."""

    def __init__(self, total: int, initial: int, stream: TextIO) -> None:
        from tqdm import tqdm

        self.stream, self.total = stream, total
        self.every = max(1, total // 20)
        self.bar = tqdm(total=total, initial=initial, desc="train-draft", unit="step", file=stream,
                        dynamic_ncols=True) if stream.isatty() else None

    def update(self, step: int, stats: dict[str, str]) -> None:
        if self.bar is not None:
            self.bar.set_postfix(stats, refresh=False)
            self.bar.update(1)
        elif step % self.every == 0 or step == self.total:
            self.message(f"step {step}/{self.total} " + " ".join(f"{k} {v}" for k, v in stats.items()))

    def message(self, text: str) -> None:
        if self.bar is not None:
            self.bar.write(text, file=self.stream)
        else:
            print(text, file=self.stream, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
