"""A hypothesis state machine over KVCacheManager: random admit / extend (chunks, decodes, drafts) /
fork / preempt / re-admit / finish sequences against a shadow KV cache.

Rules play the scheduler: several requests are scheduled (allocate_slots + registration of their full
blocks), then `forward` plays the runner: it takes the copies, applies them (all reads before writes),
then writes every scheduled token, and the requests advance (rejected drafts rolled back). Forks and
finishes happen between steps, as in the engine; preemption also mid-step (of unscheduled requests).
Every shadow slot holds the identity of the KV written there: (salt, the whole token prefix).

Checked after every rule: tests/cache/invariants.py (ref counts = references held, free + used =
total, hash index consistent); the blocks a request writes have ref_cnt 1 after allocate_slots and no
two requests write one block in a step; between steps every live request reads exactly its own
prefix's KV through its block table (no wrong hit under forced hash collisions, no lost or premature
copy, no shared write); indexed blocks hold the tokens they are indexed under. At the end, all
requests finish and no block is held.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from specserve.cache.hashing import xxh3_128
from specserve.cache.kv_cache_manager import KVCacheManager
from tests.cache.invariants import check_invariants

BS = 4
NUM_BLOCKS = 14
MAX_LEN = 24
MAX_LIVE = 6
PREFIXES = [[1, 2, 1, 2, 3, 1, 2, 1], [1, 2, 1, 2, 2, 2, 1, 3], [3, 3, 3, 3, 1, 2, 1, 2]]


def weak_hash(data: bytes) -> bytes:
    """Four possible hashes: most blocks collide, so the token / parent / salt checks do the work."""
    return bytes([xxh3_128(data)[0] % 4]) * 16


@dataclass
class Req:
    tokens: list[int]
    salt: str | None
    num_computed: int = 0
    running: bool = True


@dataclass
class Write:
    req_id: str
    table: list[int]  # block ids as scheduled (what the runner gets)
    start: int
    end: int  # known tokens computed: [start, end)
    drafts: list[int]
    num_accepted: int


@dataclass
class Shadow:
    slots: dict[int, tuple] = field(default_factory=dict)  # block_id * BS + offset -> KV identity

    def copy(self, copies: list[tuple[int, int]]) -> None:
        snapshot = {(src, o): self.slots.get(src * BS + o) for src, _ in copies for o in range(BS)}
        for src, dst in copies:
            for o in range(BS):
                self.slots[dst * BS + o] = snapshot[(src, o)]


class KVCacheMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.kv = KVCacheManager(NUM_BLOCKS, BS, extra_keys=("model",), hash_fn=weak_hash)
        self.reqs: dict[str, Req] = {}
        self.shadow = Shadow()
        self.scheduled: dict[str, Write] = {}
        self.next_id = 0

    # -- helpers ---------------------------------------------------------------------------------
    def _live(self, running: bool = True) -> list[str]:
        return sorted(r for r, q in self.reqs.items() if q.running == running)

    def _unscheduled(self) -> list[str]:
        return [r for r in self._live() if r not in self.scheduled]

    def _schedule(self, req_id: str, start: int, num_new: int, drafts: list[int] = (),
                  num_accepted: int = 0, hits=()) -> bool:
        """allocate_slots + registration, as Scheduler.schedule does for one request."""
        q = self.reqs[req_id]
        end = start + num_new
        free_before = self.kv.pool.num_free_blocks
        if not self.kv.allocate_slots(req_id, start, num_new + len(drafts), hits):
            event("allocation does not fit")
            assert self.kv.pool.num_free_blocks == free_before
            return False
        blocks = self.kv.req_blocks[req_id]
        for i in range(start // BS, -(-(end + len(drafts)) // BS)):
            assert blocks[i].ref_cnt == 1, f"{req_id} writes block {blocks[i].block_id}, shared"
        self.kv.cache_blocks(req_id, q.tokens, end, q.salt)
        self.scheduled[req_id] = Write(req_id, self.kv.block_ids(req_id), start, end, list(drafts),
                                       num_accepted)
        return True

    def _admit(self, req_id: str, num_new: int) -> None:
        q = self.reqs[req_id]
        hits, num_hit = self.kv.get_computed_blocks(req_id, q.tokens, q.salt)
        assert num_hit <= len(q.tokens) - 1
        if num_hit:
            event("prefix hit")
        q.running = self._schedule(req_id, num_hit, min(num_new, len(q.tokens) - num_hit), hits=hits)
        if q.running:
            self.kv.record_prefix_lookup(len(q.tokens), num_hit)
            q.num_computed = num_hit
        else:
            assert req_id not in self.kv.req_blocks

    # -- rules: scheduling -------------------------------------------------------------------------
    @precondition(lambda self: len(self.reqs) < MAX_LIVE)
    @rule(prefix=st.integers(0, len(PREFIXES)), cut=st.integers(1, 8),
          suffix=st.lists(st.integers(1, 3), max_size=8), salt=st.sampled_from([None, None, "t"]),
          chunk=st.integers(1, 16))
    def admit(self, prefix, cut, suffix, salt, chunk):
        tokens = (PREFIXES[prefix][:cut] if prefix < len(PREFIXES) else []) + suffix
        req_id = f"r{self.next_id}"
        self.next_id += 1
        self.reqs[req_id] = Req(tokens or [2], salt)
        self._admit(req_id, chunk)

    @precondition(lambda self: self._live(running=False))
    @rule(data=st.data(), chunk=st.integers(1, 16))
    def readmit(self, data, chunk):
        self._admit(data.draw(st.sampled_from(self._live(running=False))), chunk)

    @precondition(lambda self: self._unscheduled())
    @rule(data=st.data(), chunk=st.integers(1, 12), new_token=st.integers(1, 3),
          drafts=st.lists(st.integers(1, 3), max_size=3), num_accepted=st.integers(0, 3))
    def extend(self, data, chunk, new_token, drafts, num_accepted):
        """A prefill chunk, or a decode (+ drafts verified, some accepted, the rest rolled back)."""
        req_id = data.draw(st.sampled_from(self._unscheduled()))
        q = self.reqs[req_id]
        if q.num_computed < len(q.tokens):
            self._schedule(req_id, q.num_computed, min(chunk, len(q.tokens) - q.num_computed))
        elif len(q.tokens) + 1 + len(drafts) <= MAX_LEN:
            q.tokens.append(new_token)  # the token sampled last step
            if not self._schedule(req_id, q.num_computed, 1, drafts, min(num_accepted, len(drafts))):
                q.tokens.pop()

    @precondition(lambda self: self._unscheduled())
    @rule(data=st.data())
    def preempt(self, data):
        req_id = data.draw(st.sampled_from(self._unscheduled()))
        self.kv.free(req_id)
        self.reqs[req_id].running, self.reqs[req_id].num_computed = False, 0

    @rule()
    def forward(self):
        """The runner: copies first, then every scheduled write; then the requests advance."""
        copies = self.kv.take_copies()
        if copies:
            event("copy-on-write")
        self.shadow.copy(copies)
        writers: dict[int, str] = {}
        for w in self.scheduled.values():
            q = self.reqs[w.req_id]
            seq = q.tokens[:w.end] + w.drafts
            for p in range(w.start, len(seq)):
                block_id = w.table[p // BS]
                assert writers.setdefault(block_id, w.req_id) == w.req_id, "two requests write one block"
                self.shadow.slots[block_id * BS + p % BS] = (q.salt, tuple(seq[:p + 1]))
        for w in self.scheduled.values():
            q = self.reqs[w.req_id]
            q.tokens += w.drafts[:w.num_accepted]  # accepted drafts join the verified tokens
            q.num_computed = w.end + w.num_accepted
        self.scheduled.clear()

    # -- rules: between steps --------------------------------------------------------------------
    @precondition(lambda self: not self.scheduled and self._live() and len(self.reqs) < MAX_LIVE)
    @rule(data=st.data(), recompute=st.booleans())
    def fork(self, data, recompute):
        """n > 1 (share everything computed) or regenerate-from-t (share t tokens, recompute one)."""
        parent_id = data.draw(st.sampled_from(self._live()))
        p = self.reqs[parent_id]
        if p.num_computed == 0:
            return
        t = data.draw(st.integers(1, p.num_computed)) if recompute else p.num_computed
        child_id = f"r{self.next_id}"
        self.next_id += 1
        self.kv.fork(parent_id, child_id, t)
        self.reqs[child_id] = Req(p.tokens[:t], p.salt, num_computed=t - 1 if recompute else t)

    @precondition(lambda self: not self.scheduled and self._live())
    @rule(data=st.data())
    def regenerate(self, data):
        """Regenerate from token t: fork there, then drop the old branch."""
        parent_id = data.draw(st.sampled_from(self._live()))
        p = self.reqs[parent_id]
        if p.num_computed == 0:
            return
        t = data.draw(st.integers(1, p.num_computed))
        child_id = f"r{self.next_id}"
        self.next_id += 1
        self.kv.fork(parent_id, child_id, t)
        self.reqs[child_id] = Req(p.tokens[:t], p.salt, num_computed=t - 1)
        self.kv.forget(parent_id)
        del self.reqs[parent_id]

    @precondition(lambda self: not self.scheduled and self.reqs)
    @rule(data=st.data())
    def finish(self, data):
        req_id = data.draw(st.sampled_from(sorted(self.reqs)))
        self.kv.forget(req_id)
        del self.reqs[req_id]

    @precondition(lambda self: not self.scheduled)
    @rule()
    def reset_prefix_cache(self):
        self.kv.pool.reset_prefix_cache()

    # -- checks ----------------------------------------------------------------------------------
    @invariant()
    def pool_is_consistent(self):
        check_invariants(self.kv)
        assert set(self.kv.req_blocks) == set(self._live())

    @invariant()
    def every_request_reads_its_own_kv(self):
        if self.scheduled:
            return  # mid-step: copies are not performed yet
        assert not self.kv._copies
        for req_id in self._live():
            q = self.reqs[req_id]
            table = self.kv.block_ids(req_id)
            for p in range(q.num_computed):
                got = self.shadow.slots.get(table[p // BS] * BS + p % BS)
                assert got == (q.salt, tuple(q.tokens[:p + 1])), (req_id, p, got)

    @invariant()
    def indexed_blocks_hold_their_tokens(self):
        if self.scheduled:
            return
        for same in self.kv.pool.cached.values():
            for block in same.values():
                for o in range(BS):
                    kv_id = self.shadow.slots.get(block.block_id * BS + o)
                    assert kv_id is not None and kv_id[1][-1] == block.token_ids[o]
                    assert len(kv_id[1]) % BS == (o + 1) % BS

    def teardown(self):
        if self.kv.pool.stats.num_evictions:
            event("eviction")
        if any(len(same) > 1 for same in self.kv.pool.cached.values()):
            event("colliding hashes in the index")
        self.forward()
        for req_id in list(self.reqs):
            self.kv.forget(req_id)
        check_invariants(self.kv)
        assert self.kv.pool.num_used_blocks == 0 and self.kv.pool.num_free_blocks == NUM_BLOCKS
        assert all(b.ref_cnt == 0 for b in self.kv.pool.blocks)


KVCacheMachine.TestCase.settings = settings(max_examples=300, stateful_step_count=50, deadline=None,
                                            suppress_health_check=[HealthCheck.too_slow])
TestKVCacheManager = KVCacheMachine.TestCase
