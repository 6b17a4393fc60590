"""Invariants of a KVCacheManager and its BlockPool, checked by the unit and state-machine tests."""
from __future__ import annotations

from collections import Counter

from specserve.cache.kv_cache_manager import KVCacheManager


def check_invariants(kv: KVCacheManager) -> None:
    """Ref counts = references held by requests; free + used = total; free queue = blocks with ref 0;
    every hash-index entry is a block holding that hash and the tokens it was registered with."""
    pool = kv.pool
    held = Counter(b.block_id for blocks in kv.req_blocks.values() for b in blocks)
    for block in pool.blocks:
        assert block.ref_cnt == held[block.block_id], (block, held[block.block_id])
    assert sum(b.ref_cnt for b in pool.blocks) == sum(len(t) for t in kv.req_blocks.values())

    free = list(pool.free_queue)
    assert len(free) == pool.num_free_blocks == len({b.block_id for b in free})
    assert {b.block_id for b in free} == {b.block_id for b in pool.blocks if b.ref_cnt == 0}
    assert pool.num_free_blocks + pool.num_used_blocks == pool.num_blocks
    assert pool.num_used_blocks == len(held)

    num_indexed = 0
    for block_hash, same in pool.cached.items():
        assert same, "no empty buckets"
        for block_id, block in same.items():
            num_indexed += 1
            assert block is pool.blocks[block_id]
            assert block.block_hash == block_hash
            assert block.token_ids is not None and len(block.token_ids) == kv.block_size
            assert block.extra_keys is not None
            assert 0 <= block.parent_content_id < block.content_id
    assert num_indexed == pool.num_cached_blocks
    for block in pool.blocks:
        if block.block_hash is None:
            assert block.content_id == 0 and block.token_ids is None
        else:
            assert pool.cached[block.block_hash][block.block_id] is block

    for req_id, blocks in kv.req_blocks.items():
        num_cached = kv.req_num_cached.get(req_id, 0)
        assert num_cached <= len(blocks)
        assert all(b.is_cached for b in blocks[:num_cached]), f"{req_id}: registered prefix"
