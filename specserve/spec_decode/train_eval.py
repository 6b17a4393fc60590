"""The held-out acceptance estimate of `specserve train-draft`: greedy chain drafting simulated on
conversations the head never trains on.

For every start row m whose next k rows m..m+k-1 predict assistant tokens, the chain of k drafts
that would start after the context x_0..x_m is replayed from the head's training-time test: draft
d + 1 is the head's argmax at row m + d of depth d (mapped through the draft vocabulary to a target
id), and it is accepted while it equals the target's argmax at that row and every draft before it
was accepted. The mean acceptance length is 1 + E[accepted] (the engine's
`mean_acceptance_length`: a verification yields the accepted drafts plus one token of the target's).

Served: the engine does not start a chain at every row. It drafts from the newest token, and after
a verification that accepted a drafts the next chain starts a + 1 rows on, right after the token
the target put in place of a rejected draft, where the text tends to be harder to predict. So the
estimate also replays the engine's own visits over each answer (the first chain at the answer's
second token, as after a prefill, then start + accepted + 1, k drafts or what is left of the
answer): `served_mean_acceptance_length`. On the target's own greedy text, that is what a greedy
request at k gets (measured equal to the engine's count, to within the prefix cache's zero-hidden
entries, on the default model: 1.79 replayed vs 1.78 served). It is lower than the every-start
figure (2.09 vs 1.78 there).

Both are estimates on the data's text (teacher-forced): held-out answers of a few hundred tokens
are easier than the first tokens of an answer, so chat prompts served with short limits score lower.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import numpy as np
import torch

from specserve.spec_decode.eagle_head import EagleHead
from specserve.spec_decode.train_data import Sequence
from specserve.spec_decode.train_target import TargetFeatures


@dataclass(slots=True)
class Acceptance:
    depth: int  # k
    num_chains: int
    per_position: list[float]  # position d: the share of chains that accepted at least d + 1 drafts
    served_mean_acceptance_length: float = 1.0  # over the chains the engine would start (module doc)
    num_served_chains: int = 0

    @property
    def mean_acceptance_length(self) -> float:
        return 1.0 + sum(self.per_position)

    def per_position_str(self) -> str:
        return " ".join(f"{p:.2f}" for p in self.per_position)

    def as_dict(self) -> dict:
        return {"k": self.depth, "mean_acceptance_length": round(self.mean_acceptance_length, 4),
                "per_position": [round(p, 4) for p in self.per_position], "num_chains": self.num_chains,
                "served_mean_acceptance_length": round(self.served_mean_acceptance_length, 4),
                "num_served_chains": self.num_served_chains}


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
    served_chains, served_accepted = 0, 0
    for ids, hidden, target_argmax, labels in eval_set.items():
        if ids.shape[0] < depth:
            continue
        with autocast or contextlib.nullcontext():
            outputs = head.train_forward(ids, hidden, depth)
        hit = chain_hits(head, outputs, target_argmax)
        labels = labels.cpu().numpy()
        chains, accepted = every_start(hit, labels, depth)
        num_chains += chains
        reached += torch.from_numpy(accepted).double()
        chains, total = _served(hit, labels, depth)
        served_chains += chains
        served_accepted += total
    head.train(was_training)
    per_position = (reached / max(1, num_chains)).tolist()
    return Acceptance(depth, num_chains, per_position, 1.0 + served_accepted / max(1, served_chains), served_chains)


def chain_hits(head: EagleHead, outputs: list[torch.Tensor], target_argmax: torch.Tensor) -> np.ndarray:
    """hit[d, j] [depth, N] bool: at row j, the head's depth-d draft (`outputs`: its training-time test
    forward, one [N, h] per depth) is the target's token (`target_argmax` [N])."""
    return torch.stack([head.draft_vocab[head.compute_logits(g).argmax(dim=-1)] == target_argmax
                        for g in outputs]).cpu().numpy()


def every_start(hit: np.ndarray, labels: np.ndarray, depth: int) -> tuple[int, np.ndarray]:
    """(chains, drafts reached per position [depth]) of a chain started at every row m whose rows
    m..m+depth-1 all predict assistant tokens (`labels`): step d of the chain from m is row m + d at
    depth d, and position d counts the chains whose drafts up to d all matched."""
    num_starts = hit.shape[1] - depth + 1
    if num_starts <= 0:
        return 0, np.zeros(depth, dtype=np.int64)
    match = np.stack([hit[d, d:d + num_starts] for d in range(depth)])
    valid = np.stack([labels[d:d + num_starts] for d in range(depth)]).all(axis=0)
    accepted = np.cumprod(match[:, valid], axis=0)  # [depth, chains]: 1 while every draft so far matched
    return int(valid.sum()), accepted.sum(axis=1)


def _served(hit: np.ndarray, labels: np.ndarray, depth: int) -> tuple[int, int]:
    """(chains, accepted drafts) of the engine's visits over each answer (each run of label rows
    [a, b)): the first chain at row a + 1, then start + accepted + 1; a chain of at most depth
    drafts and the rows left in the answer."""
    chains = accepted = 0
    edges = np.flatnonzero(np.diff(np.concatenate([[0], labels.astype(np.int8), [0]])))
    for a, b in zip(edges[::2], edges[1::2]):
        m = a + 1
        while m < b:
            n = 0
            while n < min(depth, b - m) and hit[n, m + n]:
                n += 1
            chains, accepted = chains + 1, accepted + n
            m += n + 1
    return chains, accepted
