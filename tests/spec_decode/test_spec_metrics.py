"""The engine's speculative decoding counters (specserve/spec_decode/metrics.py): the acceptance at each
draft position, exact also where adaptive k drafted fewer than the cap."""
from __future__ import annotations

from types import SimpleNamespace

from specserve.spec_decode.metrics import SpecDecodingStats


def step(verifications: list[tuple[int, int]]):
    """A step's scheduler and runner outputs: one request per (drafts, accepted)."""
    scheduled = [SimpleNamespace(request=SimpleNamespace(request_id=f"r{i}"), spec_token_ids=[7] * k)
                 for i, (k, _) in enumerate(verifications)]
    accepted = {f"r{i}": a for i, (_, a) in enumerate(verifications)}
    return SimpleNamespace(scheduled=scheduled), SimpleNamespace(num_accepted=accepted)


def test_the_acceptance_at_a_position_counts_the_drafts_judged_there():
    """Two verifications of 4 drafts accepting all 4, two of 6 accepting 4 and 5: the 5th draft was
    judged twice and accepted once (0.5). From the tail sums alone it reads 1 of 4 (0.25): a
    verification that accepted its 4 drafts of 4 counted as one that stopped before a 5th, which is how
    adaptive k's shorter drafts made later positions look worse than they were."""
    stats = SpecDecodingStats(6)
    stats.observe(*step([(4, 4), (4, 4), (6, 4), (6, 5), (0, 0)]))
    d = stats.as_dict()
    assert d["spec_decode_num_drafts"] == 4
    assert d["spec_decode_num_accepted_tokens_per_pos"] == [4, 4, 4, 4, 1, 0]
    assert d["spec_decode_num_judged_tokens_per_pos"] == [4, 4, 4, 4, 2, 1]
    assert d["spec_decode_acceptance_per_position"] == [1.0, 1.0, 1.0, 1.0, 0.5, 0.0]
    tail = d["spec_decode_num_accepted_tokens_per_pos"]
    assert tail[4] / tail[3] == 0.25


def test_a_rejection_is_judged_and_nothing_after_it():
    stats = SpecDecodingStats(4)
    stats.observe(*step([(4, 0), (4, 1), (2, 2)]))  # the third judged its 2 drafts and had no 3rd
    assert stats.judged_per_pos == [3, 2, 0, 0]
    assert stats.accepted_per_pos == [2, 1, 0, 0]
    assert stats.acceptance_per_position() == [2 / 3, 0.5, None, None]
