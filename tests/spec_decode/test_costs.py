"""The start-up cost profile of adaptive k (specserve/spec_decode/costs.py): one slow forward does not
set a size's cost."""
from __future__ import annotations

import torch

import specserve.spec_decode.costs as costs
from specserve.spec_decode.costs import measured_costs, profile_forward


class SlowOnce:
    """An executor whose forward over N tokens takes N ms (a fake clock), except its first at 33 tokens,
    which takes three times as long (a hiccup of the machine)."""

    device, block_size = torch.device("cpu"), 16

    def __init__(self, clock: list[float]) -> None:
        self.clock, self.seen = clock, set()

    def forward_tokens(self, ids, query_lens, seq_lens, tables):
        n = ids.shape[0]
        self.clock[0] += (3e-3 if n == 33 and n not in self.seen else 1e-3) * n
        self.seen.add(n)
        return ids

    def compute_logits(self, hidden):
        return hidden


def test_one_slow_forward_does_not_set_a_sizes_cost(monkeypatch):
    clock = [0.0]
    monkeypatch.setattr(costs.time, "perf_counter", lambda: clock[0])
    times = profile_forward(SlowOnce(clock))
    assert set(times) == set(costs.PROFILE_SIZES)
    assert times[33] == 33e-3 and times[65] == 65e-3  # the best of 3, at every size
    table = measured_costs(times, compute_bound_tokens=24)
    assert table(33) == 33.0 and table(17) == 17.0
