"""Per-request block tables over the block pool: allocation, prefix-cache lookup, copy-on-write, fork.

Pure bookkeeping (no torch). The model runner performs the block copies listed by `take_copies()`
before the forward that writes into them.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from specserve.cache.block_pool import BlockPool, KVCacheBlock
from specserve.cache.hashing import NONE_HASH, BlockHash, HashFn, encode_extra_keys, hash_block, xxh3_128


@dataclass
class PrefixCacheStats:
    queries: int = 0  # prompt tokens looked up
    hits: int = 0  # prompt tokens found
    requests: int = 0


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True,
                 extra_keys: Sequence[Any] = (), hash_fn: HashFn = xxh3_128) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks, enable_caching)
        self.hash_fn = hash_fn
        self._extra_keys = tuple(extra_keys)
        self.req_blocks: dict[str, list[KVCacheBlock]] = {}
        self.req_hashes: dict[str, list[BlockHash]] = {}
        self.req_num_cached: dict[str, int] = {}  # leading blocks already indexed in the pool
        self.prefix_stats = PrefixCacheStats()
        self._copies: list[tuple[int, int]] = []

    # -- hashing ---------------------------------------------------------------------------------
    def _extra(self, cache_salt: str | None) -> bytes:
        return encode_extra_keys(self._extra_keys + ((cache_salt,) if cache_salt else ()))

    def block_hashes(self, req_id: str, token_ids: Sequence[int], cache_salt: str | None,
                     num_blocks: int) -> list[BlockHash]:
        """Hashes of the first `num_blocks` full blocks of `token_ids` (memoised per request)."""
        hashes = self.req_hashes.setdefault(req_id, [])
        if len(hashes) < num_blocks:
            extra = self._extra(cache_salt)
            bs = self.block_size
            parent = hashes[-1] if hashes else NONE_HASH
            for b in range(len(hashes), num_blocks):
                parent = hash_block(parent, token_ids[b * bs:(b + 1) * bs], extra, self.hash_fn)
                hashes.append(parent)
        return hashes[:num_blocks]

    # -- admission -------------------------------------------------------------------------------
    def get_computed_blocks(self, req_id: str, token_ids: Sequence[int],
                            cache_salt: str | None = None) -> tuple[list[KVCacheBlock], int]:
        """Longest cached prefix of `token_ids` in full blocks, and how many tokens of it to reuse
        (capped at len(token_ids) - 1: the last token must be computed to get logits)."""
        if not self.enable_caching:
            return [], 0
        num_full = len(token_ids) // self.block_size
        hits: list[KVCacheBlock] = []
        for b, h in enumerate(self.block_hashes(req_id, token_ids, cache_salt, num_full)):
            block = self.pool.get_cached_block(h, token_ids[b * self.block_size:(b + 1) * self.block_size])
            if block is None:
                break
            hits.append(block)
        num_hit_tokens = min(len(hits) * self.block_size, len(token_ids) - 1)
        self.prefix_stats.requests += 1
        self.prefix_stats.queries += len(token_ids)
        self.prefix_stats.hits += num_hit_tokens
        return hits, num_hit_tokens

    def allocate_slots(self, req_id: str, num_computed_tokens: int, num_new_tokens: int,
                       computed_blocks: Sequence[KVCacheBlock] = ()) -> bool:
        """Make room for tokens [num_computed_tokens, num_computed_tokens + num_new_tokens).

        `computed_blocks` (prefix-cache hits, admission only) are appended first. If the first block
        written is shared (ref_cnt > 1) the request gets a private copy of it (copy-on-write).
        Returns False, changing nothing, when the pool has too few free blocks.
        """
        blocks = self.req_blocks.get(req_id, [])
        bs = self.block_size
        num_have = len(blocks) + len(computed_blocks)
        num_needed = max(0, -(-(num_computed_tokens + num_new_tokens) // bs) - num_have)
        first = num_computed_tokens // bs
        all_blocks = list(blocks) + list(computed_blocks)
        cow = num_new_tokens > 0 and first < num_have and (
            all_blocks[first].ref_cnt + (1 if first >= len(blocks) else 0)) > 1
        num_free_hits = sum(1 for b in computed_blocks if b.ref_cnt == 0)
        if num_needed + int(cow) + num_free_hits > self.pool.num_free_blocks:
            return False
        if computed_blocks:
            self.pool.touch(computed_blocks)
            blocks = self.req_blocks.setdefault(req_id, [])
            blocks.extend(computed_blocks)
            self.req_num_cached[req_id] = len(blocks)
        blocks = self.req_blocks.setdefault(req_id, blocks)
        if cow:
            self._copy_on_write(req_id, first)
        if num_needed:
            blocks.extend(self.pool.get_new_blocks(num_needed))
        return True

    def _copy_on_write(self, req_id: str, index: int) -> None:
        blocks = self.req_blocks[req_id]
        src = blocks[index]
        (dst,) = self.pool.get_new_blocks(1)
        self.pool.free_blocks([src])
        blocks[index] = dst
        self._copies.append((src.block_id, dst.block_id))
        self.pool.stats.num_cow_copies += 1
        # The copy is private and not indexed; it is hashed again once its tokens are verified.
        self.req_num_cached[req_id] = min(self.req_num_cached.get(req_id, 0), index)

    def take_copies(self) -> list[tuple[int, int]]:
        """(src, dst) block copies the runner must perform before the next forward."""
        copies, self._copies = self._copies, []
        return copies

    # -- progress --------------------------------------------------------------------------------
    def cache_blocks(self, req_id: str, token_ids: Sequence[int], num_verified_tokens: int,
                     cache_salt: str | None = None) -> None:
        """Index the request's full blocks of verified tokens (never speculative ones)."""
        if not self.enable_caching:
            return
        num_full = num_verified_tokens // self.block_size
        start = self.req_num_cached.get(req_id, 0)
        if num_full <= start:
            return
        blocks = self.req_blocks[req_id]
        hashes = self.block_hashes(req_id, token_ids, cache_salt, num_full)
        bs = self.block_size
        for b in range(start, num_full):
            self.pool.cache_block(blocks[b], hashes[b], token_ids[b * bs:(b + 1) * bs])
        self.req_num_cached[req_id] = num_full

    def free(self, req_id: str) -> None:
        """Release a request's blocks, tail first (so its tail is evicted before its prefix)."""
        blocks = self.req_blocks.pop(req_id, [])
        self.pool.free_blocks(reversed(blocks))
        self.req_num_cached.pop(req_id, None)

    def forget(self, req_id: str) -> None:
        """Drop everything about a finished request (its memoised hashes too)."""
        self.free(req_id)
        self.req_hashes.pop(req_id, None)

    def fork(self, parent_id: str, child_id: str) -> None:
        """Share all of the parent's blocks with a new child by reference (copy-on-write later)."""
        assert child_id not in self.req_blocks, f"{child_id} already holds blocks"
        blocks = self.req_blocks.get(parent_id, [])
        self.pool.touch(blocks)
        self.req_blocks[child_id] = list(blocks)
        self.req_hashes[child_id] = list(self.req_hashes.get(parent_id, []))
        self.req_num_cached[child_id] = self.req_num_cached.get(parent_id, 0)

    def block_ids(self, req_id: str) -> list[int]:
        return [b.block_id for b in self.req_blocks.get(req_id, ())]

    def num_blocks_of(self, req_id: str) -> int:
        return len(self.req_blocks.get(req_id, ()))
