"""The held-out acceptance estimate of `specserve train-draft`: greedy chain drafting simulated on
conversations the head never trains on.

For every start row m whose next k rows m..m+k-1 predict assistant tokens, the chain of k drafts
that would start after the context x_0..x_m is replayed from the head's training-time test: draft
d + 1 is the head's argmax at row m + d of depth d (mapped through the draft vocabulary to a target
id), and it is accepted while it equals the target's argmax at that row and every draft before it
was accepted. The mean acceptance length is 1 + E[accepted] (the engine's
`mean_acceptance_length`: a verification yields the accepted drafts plus one token of the target's).

It is an estimate: the context is the data's text (teacher-forced), whereas when serving, drafts
continue the target's own greedy text, which a head tends to predict better.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from specserve.spec_decode.eagle_head import EagleHead
from specserve.spec_decode.train_data import Sequence
from specserve.spec_decode.train_target import TargetFeatures


@dataclass(slots=True)
class Acceptance:
    depth: int  # k
    num_chains: int
    per_position: list[float]  # position d: the share of chains that accepted at least d + 1 drafts

    @property
    def mean_acceptance_length(self) -> float:
        return 1.0 + sum(self.per_position)

    def per_position_str(self) -> str:
        return " ".join(f"{p:.2f}" for p in self.per_position)

    def as_dict(self) -> dict:
        return {"k": self.depth, "mean_acceptance_length": round(self.mean_acceptance_length, 4),
                "per_position": [round(p, 4) for p in self.per_position], "num_chains": self.num_chains}


class EvalSet:
    """Held-out sequences with the target's hidden states and argmax, computed once on first use."""

    def __init__(self, sequences: list[Sequence], features: TargetFeatures) -> None:
        self.sequences = sequences
        self.features = features
        self._items: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]] | None = None

    def items(self) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]:
        """Per sequence (ids [N], hidden [N, h], target argmax [N], labels [N] bool)."""
        if self._items is None:
            device = self.features.device
            self._items = [(*self.features.greedy(s), torch.from_numpy(s.labels).to(device))
                           for s in self.sequences]
        return self._items


@torch.no_grad()
def acceptance(head: EagleHead, eval_set: EvalSet, depth: int,
               autocast: contextlib.AbstractContextManager | None = None) -> Acceptance:
    was_training = head.training
    head.eval()
    num_chains, reached = 0, torch.zeros(depth, dtype=torch.float64)
    for ids, hidden, target_argmax, labels in eval_set.items():
        num_starts = ids.shape[0] - depth + 1
        if num_starts <= 0:
            continue
        with autocast or contextlib.nullcontext():
            outputs = head.train_forward(ids, hidden, depth)
        # chain from start m, step d: row m + d at depth d
        match = torch.stack([head.draft_vocab[head.compute_logits(g[d:d + num_starts]).argmax(dim=-1)]
                             == target_argmax[d:d + num_starts] for d, g in enumerate(outputs)])
        valid = torch.stack([labels[d:d + num_starts] for d in range(depth)]).all(dim=0)
        accepted = match[:, valid].long().cumprod(dim=0)  # [depth, chains]: 1 while every draft so far matched
        num_chains += int(valid.sum())
        reached += accepted.sum(dim=1).double().cpu()
    head.train(was_training)
    per_position = (reached / max(1, num_chains)).tolist()
    return Acceptance(depth, num_chains, per_position)
