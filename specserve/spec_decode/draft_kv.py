"""Which positions hold a proposer's own KV entries (a draft model's, an EAGLE head's) when the
proposer runs over the target's block ids but not in every step.

A proposer with its own KV writes it lazily: only for requests about to draft, catching up over
everything the target computed since the proposer last ran for them. Per request, `computed[req_id]`
= n: the proposer's entries are valid for positions [0, n). Steps the proposer sits out for a request
make the blocks the target wrote *stale* for the proposer (per block id, `stale[block_id]`), and a
write by the proposer makes them fresh. A request new to the proposer (admitted, re-admitted after
preemption, forked) trusts its prefix-cache hit only up to the first stale block and recomputes from
there. Rejected drafts need no cleanup: n = min(n, verified) and their slots are written again.

Invariant: every target write of a position is followed, in the same step, by a proposer write of it
(fresh) or a stale mark on its block, so a block the prefix cache finds is stale unless the proposer's
entries there are valid.
"""
from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from specserve.engine.outputs import ScheduledRequest


class DraftEntries:
    def __init__(self, block_size: int, num_blocks: int) -> None:
        self.block_size = block_size
        self.computed: dict[str, int] = {}  # req_id -> n: entries valid for positions [0, n)
        self.stale = np.zeros(num_blocks, dtype=bool)

    def forget(self, req_id: str) -> None:
        """A finished or preempted request (a preempted one starts over from its prefix hits)."""
        self.computed.pop(req_id, None)

    def follow_copies(self, copies: list[tuple[int, int]]) -> None:
        """Copy-on-write copied blocks src -> dst (the proposer's KV with the target's)."""
        for src, dst in copies:
            self.stale[dst] = self.stale[src]

    def valid(self, s: ScheduledRequest, verified: int) -> int:
        """Positions whose entries are valid, up to the target's verified end."""
        done = self.computed.get(s.request.request_id)
        return min(self._trusted_prefix(s) if done is None else done, verified)

    def fall_behind(self, steps: Iterable[tuple[ScheduledRequest, int]]) -> None:
        """The proposer does not run for these requests this step (each with the target's verified end):
        the blocks the target wrote are stale. Only this step's positions are marked (the invariant
        above: earlier ones were marked, or written by the proposer, in their own step), in one write."""
        blocks: list[int] = []
        for s, verified in steps:
            done = self.valid(s, verified)
            self.computed[s.request.request_id] = done
            blocks += self._blocks(s.block_ids, max(done, s.start), verified)
        if blocks:
            self.stale[blocks] = True

    def behind(self, s: ScheduledRequest) -> int:
        """Entries the proposer would compute if the request drafted after this step: every position it
        lacks up to the step's end, and the newest token's."""
        end = s.start + s.num_tokens
        return end + 1 - self.valid(s, end)

    def written(self, s: ScheduledRequest, start: int, end: int) -> None:
        """The proposer wrote valid entries [start, end) for this request (and nothing valid past them)."""
        self.computed[s.request.request_id] = end
        self.mark(s.block_ids, start, end, stale=False)

    def mark(self, block_ids: list[int], start: int, end: int, stale: bool) -> None:
        self.stale[self._blocks(block_ids, start, end)] = stale

    def _blocks(self, block_ids: list[int], start: int, end: int) -> list[int]:
        """The blocks that hold positions [start, end) (none when the range is empty)."""
        return block_ids[start // self.block_size:-(-end // self.block_size)] if end > start else []

    def _trusted_prefix(self, s: ScheduledRequest) -> int:
        """A request new to the proposer starts at its prefix hit, short of the first stale block."""
        n = -(-s.start // self.block_size)
        stale = np.flatnonzero(self.stale[s.block_ids[:n]])
        return min(s.start, int(stale[0]) * self.block_size) if len(stale) else s.start
