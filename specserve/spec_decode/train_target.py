"""The target's side of `specserve train-draft`: loading it, and its hidden states and next-token
distributions over one conversation at a time, computed as the engine computes them (our model
through a ModelExecutor over a KV cache sized for one sequence), so the head trains on exactly the
hidden states it is given when serving.
"""
from __future__ import annotations

import gc
import math
import time

import numpy as np
import torch

from specserve.engine.executor import ModelExecutor
from specserve.models.layers.attention import get_attention_backend
from specserve.models.loader import LoadedModel, load_model
from specserve.spec_decode.eagle_head import upload
from specserve.spec_decode.train_data import Sequence

REGENERATED_FILE = "regenerated.json"

BLOCK_SIZE = 16


def load_target(target: str | None, device: torch.device, dtype: str, max_len: int | None) -> LoadedModel:
    """`target` as `specserve serve` takes it (a HF dir, a .gguf, a hub id); None or "default": the
    default model. It must be unquantized and have a tokenizer; max_len (None: its own context
    length) must fit its positions."""
    if target in (None, "default"):
        from specserve.models.default_model import ensure_default_model

        target = str(ensure_default_model())
    loaded = load_model(target, dtype=dtype, device=device, max_positions=max_len)
    if loaded.quantization:
        raise ValueError(f"target {target} is quantized ({loaded.quantization}): train-draft needs the float "
                         "weights (the head is trained on the hidden states of the model it will draft for)")
    if max_len is not None and max_len > loaded.arch.max_position_embeddings:
        raise ValueError(f"--max-len {max_len} exceeds the target's {loaded.arch.max_position_embeddings} positions")
    if loaded.tokenizer is None:
        raise ValueError(f"target {target} has no tokenizer: train-draft renders conversations with its chat template")
    loaded.model.requires_grad_(False)
    return loaded


class TargetFeatures:
    """Per sequence: the target's hidden states (the output of its final norm, what
    `ModelExecutor.forward` returns) and its log-probabilities / argmax at the label rows."""

    def __init__(self, loaded: LoadedModel, device: torch.device, max_len: int, draft_vocab: torch.Tensor,
                 max_batch: int = 1, label_temperature: float = 1.0) -> None:
        num_blocks = max_batch * -(-max_len // BLOCK_SIZE)  # `labelled_batch` takes up to max_batch sequences
        self.executor = ModelExecutor(loaded.model, get_attention_backend("auto", device), device, loaded.dtype,
                                      BLOCK_SIZE, num_blocks)
        self.device = device
        self.draft_vocab = draft_vocab  # [Vd] target ids, on device
        self.label_temperature = label_temperature
        # the head learns in fp32 on the CPU (bf16 autocast on CUDA takes any input dtype)
        self.hidden_dtype = torch.float32 if device.type == "cpu" else loaded.dtype

    def _forward(self, token_ids: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        n = len(token_ids)
        ids = upload(token_ids.astype(np.int64), self.device)
        hidden = self.executor.forward_tokens(ids, [n], [n], [list(range(-(-n // BLOCK_SIZE)))])
        return ids, hidden

    def labelled(self, seq: Sequence) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(ids [N], hidden [N, h], target log-probs [R, Vd] at the R label rows, draft columns)."""
        return self.labelled_batch([seq])

    def labelled_batch(self, seqs: list[Sequence]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`labelled` of the sequences packed end to end (ids [T], hidden [T, h], log-probs at the
        label rows in order), from one ragged target forward over all of them: a step's target
        launches are paid once, not per sequence."""
        lens = [len(s.token_ids) for s in seqs]
        tables, first = [], 0
        for n in lens:
            tables.append(list(range(first, first + -(-n // BLOCK_SIZE))))
            first += len(tables[-1])
        with torch.inference_mode():
            ids = upload(np.concatenate([s.token_ids for s in seqs]).astype(np.int64), self.device)
            hidden = self.executor.forward_tokens(ids, lens, lens, tables)
            rows = upload(np.flatnonzero(np.concatenate([s.labels for s in seqs])), self.device)
            logp = self.label_logp(self.executor.compute_logits(hidden[rows]))
        # out of inference mode: tensors autograd may use
        return ids.clone(), hidden.to(self.hidden_dtype, copy=True), logp.clone()

    def label_logp(self, logits: torch.Tensor) -> torch.Tensor:
        """The labels' log-probabilities at the draft columns: log softmax(logits / T) over the full
        vocabulary (T = label_temperature; the mass outside the draft vocabulary is dropped), or at T = 0
        the target's argmax as a one-hot label (0 at it, -inf elsewhere: a row whose argmax is outside the
        draft vocabulary teaches nothing)."""
        if self.label_temperature == 0:  # built at the draft columns only, not over the full vocabulary
            hit = self.draft_vocab == logits.argmax(dim=-1, keepdim=True)
            return torch.zeros(hit.shape, device=hit.device).masked_fill_(~hit, -math.inf)
        return torch.log_softmax(logits.float() / self.label_temperature, dim=-1)[:, self.draft_vocab]

    def greedy(self, seq: Sequence) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(ids [N], hidden [N, h], target argmax [N]: -1 except at label rows)."""
        with torch.inference_mode():
            ids, hidden = self._forward(seq.token_ids)
            labels = torch.from_numpy(seq.labels).to(self.device)
            argmax = torch.full_like(ids, -1)
            argmax[labels] = self.executor.compute_logits(hidden[labels]).argmax(dim=-1)
        return ids.clone(), hidden.to(self.hidden_dtype, copy=True), argmax.clone()


def regenerate(target: str, dtype: str, device: torch.device, max_len: int, max_tokens: int,
               splits: dict[str, list[list[dict]]], message, turns: int = 1) -> dict[str, list[list[dict]]]:
    """Each conversation answered by the target itself, greedy, at most max_tokens per answer, through
    our engine: the text the head drafts when serving. Its turns before the first answer get the
    target's answer; with `turns` > 1, the data's next user turns are put after that answer and the
    target answers them too, up to `turns` answers (the data's own answers are never read). A
    conversation ends at the first turn whose prompt leaves less than max_tokens of room in max_len
    (one that ends before its first answer is dropped) and after an empty answer (left out); an answer
    cut at max_tokens stays in the context of the next turn, as a served conversation goes on after
    a reply cut at its max_tokens."""
    from specserve import LLM, SamplingParams

    # throughput work: twice the serving default of requests in flight on a GPU
    llm = LLM(target, dtype=dtype, device=str(device), max_model_len=max_len,
              max_num_seqs=512 if device.type == "cuda" else 256)
    answered: dict[str, list[list[dict] | None]] = {name: [None] * len(convs) for name, convs in splits.items()}
    # the conversations still going: (split, index, the messages so far, where the data's next turns start)
    going = [(name, i, [], 0) for name, convs in splits.items() for i in range(len(convs))]
    num_tokens, t0 = 0, time.monotonic()
    try:
        tokenizer = llm.tokenizer
        for turn in range(turns):
            prompts, owners = [], []
            for name, i, so_far, pos in going:
                messages = splits[name][i]
                nxt = next((j for j in range(pos, len(messages)) if messages[j]["role"] == "assistant"), None)
                if nxt is None or nxt == pos:  # no further answer in the data, or no prompt before it
                    continue
                context = so_far + messages[pos:nxt]
                try:
                    text = tokenizer.apply_chat_template(context, tokenize=False, add_generation_prompt=True)
                except Exception:  # jinja refuses it (e.g. roles that do not alternate)
                    continue
                ids = tokenizer.encode(text, add_special_tokens=False)
                if len(ids) + max_tokens <= max_len:
                    prompts.append({"prompt_token_ids": ids})
                    owners.append((name, i, context, nxt + 1))
            if not prompts:
                break
            of_turns = "" if turns == 1 else f" to turn {turn + 1} (of at most {turns})"
            message(f"train-draft: regenerating {len(prompts)} answers{of_turns} with the target (greedy, at most "
                    f"{max_tokens} tokens each) on {device}")
            outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens), use_tqdm=True)
            going = []
            for (name, i, context, pos), o in zip(owners, outputs):
                answer = o.outputs[0]
                num_tokens += len(answer.token_ids)
                if not answer.text.strip():
                    continue
                answered[name][i] = context + [{"role": "assistant", "content": answer.text}]
                going.append((name, i, answered[name][i], pos))
    finally:
        llm.shutdown()
        del llm
        gc.collect()  # the engine's KV cache goes back before the head trains
        if device.type == "cuda":
            torch.cuda.empty_cache()
    message(f"train-draft: {num_tokens} tokens regenerated in {time.monotonic() - t0:.0f} s")
    return {name: [c for c in convs if c is not None] for name, convs in answered.items()}
