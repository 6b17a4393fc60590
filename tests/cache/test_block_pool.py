"""BlockPool: ref counts, the LRU free queue, the hash index, eviction counting."""
from __future__ import annotations

import pytest

from specserve.cache.block_pool import NO_PARENT, BlockPool


def cache(pool: BlockPool, block, tag: int, parent: int = NO_PARENT) -> None:
    pool.cache_block(block, bytes([tag]) * 16, (tag,) * 4, parent, b"x")


def free_ids(pool: BlockPool) -> list[int]:
    return [b.block_id for b in pool.free_queue]


def test_fresh_pool_hands_out_blocks_in_id_order():
    pool = BlockPool(4)
    assert [b.block_id for b in pool.get_new_blocks(3)] == [0, 1, 2]
    assert pool.num_free_blocks == 1 and pool.num_used_blocks == 3
    assert all(b.ref_cnt == 1 for b in pool.blocks[:3])


def test_freed_blocks_keep_their_hash_and_are_evicted_in_lru_order():
    pool = BlockPool(4)
    blocks = pool.get_new_blocks(4)
    for i, b in enumerate(blocks):
        cache(pool, b, i + 1)
    pool.free_blocks(reversed(blocks))  # tail first, as a request frees its table
    assert free_ids(pool) == [3, 2, 1, 0]
    assert pool.num_cached_blocks == 4
    for i in range(4):  # still findable while free
        assert pool.get_cached_block(bytes([i + 1]) * 16, (i + 1,) * 4, NO_PARENT, b"x") is blocks[i]

    (first,) = pool.get_new_blocks(1)
    assert first.block_id == 3 and not first.is_cached
    assert pool.stats.num_evictions == 1
    assert pool.get_cached_block(bytes([4]) * 16, (4,) * 4, NO_PARENT, b"x") is None

    pool.touch([blocks[0]])  # a hit on a free block takes it out of the queue, hash kept
    assert free_ids(pool) == [2, 1] and blocks[0].ref_cnt == 1 and blocks[0].is_cached
    pool.free_blocks([blocks[0]])  # ...and freeing it again makes it the most recently used
    assert free_ids(pool) == [2, 1, 0]
    assert [b.block_id for b in pool.get_new_blocks(2)] == [2, 1]
    assert pool.stats.num_evictions == 3


def test_evictions_count_only_cached_blocks():
    pool = BlockPool(3)
    blocks = pool.get_new_blocks(3)
    cache(pool, blocks[0], 7)
    pool.free_blocks(blocks)
    pool.get_new_blocks(2)  # blocks 0 (cached) and 1 (never cached)
    assert pool.stats.num_evictions == 1
    assert pool.num_cached_blocks == 0 and not pool.cached


def test_ref_counts_and_shared_blocks():
    pool = BlockPool(2)
    (b,) = pool.get_new_blocks(1)
    pool.touch([b])
    pool.touch([b])
    assert b.ref_cnt == 3 and pool.num_free_blocks == 1
    pool.free_blocks([b])
    pool.free_blocks([b])
    assert b.ref_cnt == 1 and pool.num_free_blocks == 1
    pool.free_blocks([b])
    assert b.ref_cnt == 0 and free_ids(pool) == [1, 0]
    with pytest.raises(AssertionError, match="double free"):
        pool.free_blocks([b])


def test_lookup_compares_tokens_parent_and_extra_keys():
    pool = BlockPool(3)
    a, b, c = pool.get_new_blocks(3)
    h = b"\x01" * 16  # all three under one hash: a forced collision
    pool.cache_block(a, h, (1, 2), NO_PARENT, b"m")
    pool.cache_block(b, h, (1, 2), a.content_id, b"m")
    pool.cache_block(c, h, (1, 2), NO_PARENT, b"other-salt")
    assert pool.get_cached_block(h, [1, 2], NO_PARENT, b"m") is a
    assert pool.get_cached_block(h, [1, 2], a.content_id, b"m") is b
    assert pool.get_cached_block(h, [1, 2], NO_PARENT, b"other-salt") is c
    assert pool.get_cached_block(h, [1, 3], NO_PARENT, b"m") is None
    assert pool.get_cached_block(h, [1, 2], c.content_id, b"m") is None
    assert b.content_id > a.content_id


def test_reset_prefix_cache_drops_only_free_blocks():
    pool = BlockPool(2)
    a, b = pool.get_new_blocks(2)
    cache(pool, a, 1)
    cache(pool, b, 2)
    pool.free_blocks([a])
    assert pool.reset_prefix_cache() == 1
    assert not a.is_cached and b.is_cached and pool.num_cached_blocks == 1
    assert pool.stats.num_evictions == 0


def test_pool_needs_a_block():
    with pytest.raises(ValueError):
        BlockPool(0)
