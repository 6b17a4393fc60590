"""KVCacheManager, exact cases: which blocks a request reuses, the num_tokens - 1 cap, salts, forced
hash collisions, copy-on-write and fork, eviction order, counters."""
from __future__ import annotations

import pytest

from specserve.cache.kv_cache_manager import KVCacheManager
from tests.cache.invariants import check_invariants

BS = 4


def admit(kv: KVCacheManager, req_id: str, tokens: list[int], salt: str | None = None,
          num_new: int | None = None, run_forward: bool = True) -> int:
    """What the scheduler does at admission: look up, allocate, register the scheduled full blocks;
    then (run_forward) end the step, as the engine does, so the registered blocks count as computed."""
    hits, num_hit = kv.get_computed_blocks(req_id, tokens, salt)
    num_new = len(tokens) - num_hit if num_new is None else num_new
    assert kv.allocate_slots(req_id, num_hit, num_new, hits)
    kv.record_prefix_lookup(len(tokens), num_hit)
    kv.cache_blocks(req_id, tokens, min(num_hit + num_new, len(tokens)), salt)
    check_invariants(kv)
    if run_forward:
        assert kv.take_copies() == []
    return num_hit


def test_prefix_hit_reuses_the_same_block_ids():
    kv = KVCacheManager(8, BS)
    a = list(range(10, 20))  # 10 tokens: 2 full blocks + 2 tokens
    assert admit(kv, "a", a) == 0
    assert kv.block_ids("a") == [0, 1, 2]
    assert kv.pool.num_cached_blocks == 2  # only full blocks are registered
    kv.forget("a")  # free queue now: 3..7, then a's blocks tail first: 2, 1, 0

    b = a[:8] + [99, 98, 97]
    assert admit(kv, "b", b) == 8
    assert kv.block_ids("b") == [0, 1, 3]  # the two hits, then the LRU head
    assert kv.prefix_stats.hits == 8 and kv.prefix_stats.queries == 21 and kv.prefix_stats.requests == 2
    assert kv.pool.stats.num_evictions == 0
    kv.forget("b")
    check_invariants(kv)
    assert kv.pool.num_used_blocks == 0


def test_hit_is_capped_at_num_tokens_minus_one_and_written_in_place_when_unshared():
    kv = KVCacheManager(8, BS)
    a = list(range(8))  # exactly two full blocks
    admit(kv, "a", a)
    kv.forget("a")
    hits, num_hit = kv.get_computed_blocks("b", a)
    assert [h.block_id for h in hits] == [0, 1] and num_hit == 7
    assert kv.allocate_slots("b", 7, 1, hits)
    assert kv.block_ids("b") == [0, 1]  # nobody else holds block 1: recompute the last token into it
    assert kv.take_copies() == [] and kv.pool.stats.num_cow_copies == 0
    check_invariants(kv)


def test_hit_on_a_block_another_request_holds_copies_it_before_writing():
    kv = KVCacheManager(8, BS)
    a = list(range(8))
    admit(kv, "a", a)  # a holds blocks 0, 1 (registered)
    hits, num_hit = kv.get_computed_blocks("b", a)
    assert num_hit == 7
    assert kv.allocate_slots("b", 7, 1, hits)
    assert kv.block_ids("b") == [0, 2]
    assert kv.take_copies() == [(1, 2)]
    assert kv.pool.stats.num_cow_copies == 1
    assert [b.ref_cnt for b in kv.pool.blocks[:3]] == [2, 1, 1]
    kv.cache_blocks("b", a, 8)  # the private copy is registered again (a duplicate entry)
    assert kv.pool.num_cached_blocks == 3
    check_invariants(kv)


def test_salts_never_share_blocks():
    kv = KVCacheManager(16, BS)
    tokens = list(range(9))
    admit(kv, "plain", tokens)
    admit(kv, "t1", tokens, salt="tenant-1")
    assert kv.get_computed_blocks("x", tokens, "tenant-2")[1] == 0
    assert kv.get_computed_blocks("y", tokens, "tenant-1")[1] == 8
    assert kv.get_computed_blocks("z", tokens, None)[1] == 8
    assert set(kv.get_computed_blocks("y2", tokens, "tenant-1")[0]).isdisjoint(
        kv.get_computed_blocks("z2", tokens, None)[0])


def test_extra_keys_change_every_hash_and_are_fixed_before_the_first_request():
    tokens = list(range(8))
    h1 = KVCacheManager(4, BS, extra_keys=("target", "bf16")).block_hashes("r", tokens, None, 2)
    kv2 = KVCacheManager(4, BS, extra_keys=("target", "bf16"))
    kv2.add_extra_keys("draft", "bf16")
    h2 = kv2.block_hashes("r", tokens, None, 2)
    assert h1[0] != h2[0] and h1[1] != h2[1]
    with pytest.raises(ValueError, match="before the first request"):
        kv2.add_extra_keys("late")


def test_forced_hash_collisions_never_serve_wrong_kv():
    kv = KVCacheManager(16, BS, hash_fn=lambda data: b"\x00" * 16)  # every block collides
    x, y, z, w = [1] * BS, [2] * BS, [3] * BS, [4] * BS
    admit(kv, "a", x + y + [9])  # blocks: X, Y(after X)
    admit(kv, "e", z + w + [9])  # blocks: Z, W(after Z)
    # same second block Y, same (constant) hash, but computed after X, not Z: only Z is reused
    hits, num_hit = kv.get_computed_blocks("b", z + y + [9])
    assert [h.block_id for h in hits] == kv.block_ids("e")[:1] and num_hit == BS
    # different tokens under the same hash: a miss
    assert kv.get_computed_blocks("c", w + y + [9])[1] == 0
    # the real prefixes are still found
    assert kv.get_computed_blocks("d", x + y + [5])[0] == kv.req_blocks["a"][:2]


def test_fork_shares_the_partial_block_and_the_first_writer_copies_it():
    kv = KVCacheManager(8, BS)
    prompt = list(range(6))
    admit(kv, "p", prompt)  # blocks 0 (full, registered), 1 (2 tokens)
    kv.fork("p", "c", 6)
    assert kv.block_ids("c") == [0, 1]
    assert [b.ref_cnt for b in kv.pool.blocks[:2]] == [2, 2]
    check_invariants(kv)
    assert kv.allocate_slots("c", 6, 1)  # the child writes token 6 into block 1 first: copy
    assert kv.block_ids("c") == [0, 2] and kv.take_copies() == [(1, 2)]
    assert kv.allocate_slots("p", 6, 1)  # the parent is now the only owner of block 1: in place
    assert kv.block_ids("p") == [0, 1] and kv.take_copies() == []
    assert [b.ref_cnt for b in kv.pool.blocks[:3]] == [2, 1, 1]
    assert kv.pool.stats.num_cow_copies == 1
    check_invariants(kv)
    kv.forget("p")
    kv.forget("c")
    check_invariants(kv)
    assert kv.pool.num_used_blocks == 0


def test_fork_at_a_block_boundary_needs_no_copy_and_copies_every_shared_block_written():
    kv = KVCacheManager(8, BS)
    prompt = list(range(8))
    admit(kv, "p", prompt)
    kv.fork("p", "c", 8)
    assert kv.allocate_slots("c", 8, 1) and kv.take_copies() == []
    kv.fork("p", "d", 8)  # regenerate-style fork: recompute the last 5 tokens (blocks 0 and 1 shared)
    assert kv.allocate_slots("d", 3, 5)
    assert kv.block_ids("d") == [3, 4] and kv.take_copies() == [(0, 3), (1, 4)]
    assert kv.req_num_cached["d"] == 0
    check_invariants(kv)
    with pytest.raises(ValueError):
        kv.fork("p", "c", 4)  # c exists
    with pytest.raises(ValueError):
        kv.fork("p", "e", 9)  # p has no block for token 8


def test_allocation_that_does_not_fit_changes_nothing():
    kv = KVCacheManager(3, BS)
    admit(kv, "a", list(range(8)))
    hits, num_hit = kv.get_computed_blocks("b", list(range(8)) + list(range(50, 58)))
    assert num_hit == 8
    assert not kv.allocate_slots("b", num_hit, 8, hits)  # needs 2 new blocks, 1 free
    assert "b" not in kv.req_blocks and kv.take_copies() == []
    check_invariants(kv)


def test_a_freed_request_is_evicted_tail_first():
    kv = KVCacheManager(4, BS)
    admit(kv, "a", list(range(16)))  # 4 full registered blocks
    kv.forget("a")
    admit(kv, "b", [7] * 4)
    assert kv.block_ids("b") == [3] and kv.pool.stats.num_evictions == 1
    assert kv.get_computed_blocks("c", list(range(16)))[1] == 12  # the first three are still there


def test_preempted_request_finds_its_own_blocks_again():
    kv = KVCacheManager(8, BS)
    tokens = list(range(11))
    admit(kv, "a", tokens)
    kv.free("a")  # preemption: blocks back to the pool, memoised hashes kept
    assert kv.get_computed_blocks("a", tokens)[1] == 8


def test_disabled_caching_never_hits_but_still_forks():
    kv = KVCacheManager(8, BS, enable_caching=False)
    tokens = list(range(8))
    admit(kv, "a", tokens)
    assert kv.pool.num_cached_blocks == 0
    assert kv.get_computed_blocks("b", tokens) == ([], 0)
    assert kv.prefix_stats.queries == 0
    kv.fork("a", "c", 7)
    assert kv.allocate_slots("c", 7, 1) and kv.take_copies() == [(1, 2)]
    check_invariants(kv)


def test_freeing_a_request_drops_its_pending_copies():
    kv = KVCacheManager(8, BS)
    admit(kv, "p", list(range(6)))
    kv.fork("p", "c", 6)
    assert kv.allocate_slots("c", 6, 1)
    kv.free("c")  # preempted in the same step: its copy is moot
    assert kv.take_copies() == []


def test_a_fork_inside_a_cached_block_copies_it_before_writing_other_tokens():
    kv = KVCacheManager(8, BS)
    admit(kv, "p", [1, 2, 1, 2, 5])  # block 0 = [1, 2, 1, 2], registered
    kv.fork("p", "c", 2)  # regenerate from token 2: c shares block 0 but only its first two tokens
    kv.forget("p")  # c is now the only owner of block 0, which is still in the index
    assert kv.allocate_slots("c", 1, 2)  # c recomputes token 1 and writes its own token 2
    assert kv.block_ids("c") == [2] and kv.take_copies() == [(0, 2)]
    assert kv.get_computed_blocks("x", [1, 2, 1, 2, 7])[0] == [kv.pool.blocks[0]]  # intact, still found
    check_invariants(kv)


def test_a_block_registered_for_the_coming_forward_is_read_but_never_copied():
    kv = KVCacheManager(8, BS)
    prompt = list(range(8))
    admit(kv, "a", prompt, run_forward=False)  # scheduled, not computed: blocks 0, 1 registered already
    hits, num_hit = kv.get_computed_blocks("b", prompt + [9])
    assert [h.block_id for h in hits] == [0, 1] and num_hit == 8  # read in the same forward: fine
    hits, num_hit = kv.get_computed_blocks("c", prompt)  # would have to copy block 1: not yet
    assert [h.block_id for h in hits] == [0] and num_hit == 4
    assert kv.allocate_slots("c", 4, 4, hits) and kv.take_copies() == []
    hits, num_hit = kv.get_computed_blocks("d", prompt)  # next step: block 1 is computed, copy it
    assert num_hit == 7 and kv.allocate_slots("d", 7, 1, hits) and kv.take_copies() == [(1, 3)]
