"""Per-request block tables over the block pool: allocation, prefix-cache lookup, copy-on-write, fork.

Pure bookkeeping (no torch). A request's block table is append-only except for copy-on-write, which
swaps a shared block for a private copy; the model runner performs the copies listed by
`take_copies()` before the forward that writes into them.

Contract with the scheduler and runner: blocks are registered in the hash index (`cache_blocks`) when
the tokens that fill them are scheduled, not after the forward. This is safe because within one
forward every layer writes the KV of all the step's tokens before any request attends, so a request
admitted in the same step that hits those blocks reads KV written in that same forward (and any
draft model that keeps KV in the same block ids must follow the same rule). Only tokens that are
known (prompt, verified output) are ever registered, never draft tokens.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from specserve.cache.block_pool import NO_PARENT, BlockPool, KVCacheBlock
from specserve.cache.hashing import NONE_HASH, BlockHash, HashFn, encode_extra_keys, hash_blocks, xxh3_128


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(slots=True)
class PrefixCacheStats:
    requests: int = 0  # admissions looked up (a preempted request counts again when re-admitted)
    queries: int = 0  # tokens looked up
    hits: int = 0  # tokens found (and not computed)

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


class KVCacheManager:
    """Block tables of all requests over one BlockPool.

    `extra_keys` is the model identity folded into every block hash (the engine passes target
    path / dtype / quantization; a draft model adds its own with `add_extra_keys`). `hash_fn` is
    injectable so tests can force collisions.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True,
                 extra_keys: Sequence[Any] = (), hash_fn: HashFn = xxh3_128) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks, enable_caching)
        self.hash_fn = hash_fn
        self._extra_keys = tuple(extra_keys)
        self.req_blocks: dict[str, list[KVCacheBlock]] = {}
        self.req_hashes: dict[str, list[BlockHash]] = {}  # memoised hashes of full blocks
        self.req_num_cached: dict[str, int] = {}  # leading blocks of the table already registered
        self.prefix_stats = PrefixCacheStats()
        self._copies: list[tuple[int, int]] = []
        # blocks registered while scheduling the coming forward: readable by that forward, but their
        # KV does not exist yet, so they cannot be the source of a copy (cleared by take_copies)
        self._uncomputed: set[int] = set()

    @property
    def extra_keys(self) -> tuple[Any, ...]:
        return self._extra_keys

    def add_extra_keys(self, *keys: Any) -> None:
        """Fold more identity (e.g. the draft model's path and dtype) into every block hash."""
        if self.pool.cached or self.req_hashes:
            raise ValueError("extra keys must be set before the first request")
        self._extra_keys += keys

    # -- hashing ---------------------------------------------------------------------------------
    def _extra(self, cache_salt: str | None) -> bytes:
        return encode_extra_keys(self._extra_keys + (("salt", cache_salt) if cache_salt else ()))

    def block_hashes(self, req_id: str, token_ids: Sequence[int], cache_salt: str | None,
                     num_blocks: int) -> list[BlockHash]:
        """Hashes of the first `num_blocks` full blocks of `token_ids` (memoised per request;
        `token_ids` only ever grows for a request)."""
        hashes = self.req_hashes.setdefault(req_id, [])
        if len(hashes) < num_blocks:
            parent = hashes[-1] if hashes else NONE_HASH
            hashes += hash_blocks(token_ids, self.block_size, len(hashes), num_blocks, parent,
                                  self._extra(cache_salt), self.hash_fn)
        return hashes[:num_blocks]

    # -- admission -------------------------------------------------------------------------------
    def get_computed_blocks(self, req_id: str, token_ids: Sequence[int],
                            cache_salt: str | None = None) -> tuple[list[KVCacheBlock], int]:
        """The longest cached prefix of `token_ids` in full blocks, and how many of its tokens to reuse.

        The reuse is capped at len(token_ids) - 1: the last token must be computed to get logits. When
        the whole prompt is cached in full blocks, all of them are returned and the last token is
        recomputed into the last one (copied first by `allocate_slots` if another request holds it),
        unless that block is only being computed by the coming forward: then it cannot be copied yet
        and the whole last block is recomputed instead. Takes no references; pass the blocks to
        `allocate_slots`.
        """
        if not self.enable_caching:
            return [], 0
        bs = self.block_size
        extra = self._extra(cache_salt)
        hits: list[KVCacheBlock] = []
        parent = NO_PARENT
        for b, h in enumerate(self.block_hashes(req_id, token_ids, cache_salt, len(token_ids) // bs)):
            block = self.pool.get_cached_block(h, token_ids[b * bs:(b + 1) * bs], parent, extra)
            if block is None:
                break
            hits.append(block)
            parent = block.content_id
        if hits and len(hits) * bs == len(token_ids) and hits[-1].block_id in self._uncomputed:
            hits.pop()
        return hits, min(len(hits) * bs, len(token_ids) - 1)

    def record_prefix_lookup(self, num_tokens: int, num_hit_tokens: int) -> None:
        """Count one admitted lookup (the scheduler calls this once the request got its blocks)."""
        if self.enable_caching:
            self.prefix_stats.requests += 1
            self.prefix_stats.queries += num_tokens
            self.prefix_stats.hits += num_hit_tokens

    def allocate_slots(self, req_id: str, num_computed_tokens: int, num_new_tokens: int,
                       computed_blocks: Sequence[KVCacheBlock] = ()) -> bool:
        """Make room for tokens [num_computed_tokens, num_computed_tokens + num_new_tokens).

        `computed_blocks` (prefix-cache hits, at admission only) are appended first. A block the new
        tokens will be written into is replaced by a private copy first (copy-on-write) when another
        request also holds it, or when it is in the hash index under other content than this request's
        own registered prefix (a fork that shares part of a full cached block): indexed blocks are
        never overwritten with different tokens. Afterwards the blocks this request writes have
        ref_cnt 1. Returns False, changing nothing, when the pool has too few free blocks.
        """
        assert num_computed_tokens >= 0 and num_new_tokens >= 0
        blocks = self.req_blocks.get(req_id, [])
        assert not (blocks and computed_blocks), "prefix hits are only taken at admission"
        table = list(computed_blocks) if computed_blocks else blocks
        # blocks [0, num_own) hold this request's own tokens in full (rewriting one is a no-op)
        num_own = len(table) if computed_blocks else self.req_num_cached.get(req_id, 0)
        bs = self.block_size
        end = num_computed_tokens + num_new_tokens
        num_needed = max(0, cdiv(end, bs) - len(table))
        # a prefix hit not yet referenced counts the reference allocate_slots is about to take
        pending = 1 if computed_blocks else 0
        cow = [] if num_new_tokens == 0 else [
            i for i in range(num_computed_tokens // bs, min(cdiv(end, bs), len(table)))
            if table[i].ref_cnt + pending > 1 or (table[i].is_cached and i >= num_own)]
        num_free_hits = sum(1 for b in computed_blocks if b.ref_cnt == 0)
        if num_needed + len(cow) + num_free_hits > self.pool.num_free_blocks:
            return False
        if computed_blocks:
            self.pool.touch(computed_blocks)
            blocks = self.req_blocks[req_id] = list(computed_blocks)
            self.req_num_cached[req_id] = len(blocks)
        else:
            blocks = self.req_blocks.setdefault(req_id, blocks)
        for i in cow:
            self._copy_on_write(req_id, i)
        if num_needed:
            blocks.extend(self.pool.get_new_blocks(num_needed))
        return True

    def _copy_on_write(self, req_id: str, index: int) -> None:
        blocks = self.req_blocks[req_id]
        src = blocks[index]
        (dst,) = self.pool.get_new_blocks(1)
        # An unshared source (an indexed block) goes back to the free queue, still indexed; the copy
        # reads it before anything of this step's forward can write it.
        self.pool.free_blocks([src])
        blocks[index] = dst
        self._copies.append((src.block_id, dst.block_id))
        self.pool.stats.num_cow_copies += 1
        # The copy is private and not indexed; it is registered again once its tokens are known.
        self.req_num_cached[req_id] = min(self.req_num_cached.get(req_id, 0), index)

    def take_copies(self) -> list[tuple[int, int]]:
        """(src, dst) block copies the runner must perform before the next forward, in order. Called
        once per step when scheduling is done: the forward that follows computes every block
        registered until now."""
        copies, self._copies = self._copies, []
        self._uncomputed.clear()
        return copies

    # -- progress --------------------------------------------------------------------------------
    def cache_blocks(self, req_id: str, token_ids: Sequence[int], num_tokens: int,
                     cache_salt: str | None = None) -> None:
        """Register the request's full blocks among its first `num_tokens` tokens in the hash index.

        `num_tokens` counts only known tokens (prompt and verified output) whose KV is computed or
        is being computed by the coming forward; never draft tokens.
        """
        if not self.enable_caching:
            return
        bs = self.block_size
        num_full = num_tokens // bs
        start = self.req_num_cached.get(req_id, 0)
        if num_full <= start:
            return
        blocks = self.req_blocks[req_id]
        assert num_full <= len(blocks) and num_tokens <= len(token_ids)
        hashes = self.block_hashes(req_id, token_ids, cache_salt, num_full)
        extra = self._extra(cache_salt)
        parent = blocks[start - 1].content_id if start else NO_PARENT
        assert not start or parent, "the blocks before the first unregistered one are registered"
        for b in range(start, num_full):
            block = blocks[b]
            if not block.is_cached:
                self.pool.cache_block(block, hashes[b], token_ids[b * bs:(b + 1) * bs], parent, extra)
                self._uncomputed.add(block.block_id)
            parent = block.content_id
        self.req_num_cached[req_id] = num_full

    def free(self, req_id: str) -> None:
        """Release a request's blocks, tail first (so its tail is evicted before its prefix)."""
        blocks = self.req_blocks.pop(req_id, [])
        if self._copies and blocks:  # a copy into a block it no longer owns is moot
            mine = {b.block_id for b in blocks if b.ref_cnt == 1}
            self._copies = [c for c in self._copies if c[1] not in mine]
        self.pool.free_blocks(reversed(blocks))
        self.req_num_cached.pop(req_id, None)

    def forget(self, req_id: str) -> None:
        """Drop everything about a finished request (its memoised hashes too)."""
        self.free(req_id)
        self.req_hashes.pop(req_id, None)

    def fork(self, parent_id: str, child_id: str, num_tokens: int) -> None:
        """Give `child_id` the blocks holding the parent's first `num_tokens` tokens, by reference
        (the partially filled last block too). Whichever of them writes into a shared block next gets
        a private copy first (copy-on-write in `allocate_slots`)."""
        if child_id in self.req_blocks:
            raise ValueError(f"{child_id!r} already holds blocks")
        blocks = self.req_blocks.get(parent_id)
        if blocks is None:
            raise ValueError(f"{parent_id!r} holds no blocks to fork")
        n = cdiv(num_tokens, self.block_size)
        if not 0 < n <= len(blocks):
            raise ValueError(f"cannot fork {num_tokens} tokens of {parent_id!r} ({len(blocks)} blocks)")
        shared = blocks[:n]
        self.pool.touch(shared)
        self.req_blocks[child_id] = list(shared)
        num_full = num_tokens // self.block_size
        self.req_hashes[child_id] = list(self.req_hashes.get(parent_id, [])[:num_full])
        self.req_num_cached[child_id] = min(self.req_num_cached.get(parent_id, 0), num_full)

    def reset_prefix_cache(self) -> int:
        """Forget every cached block no request holds (benchmarks, tests); returns how many."""
        return self.pool.reset_prefix_cache()

    # -- queries ---------------------------------------------------------------------------------
    def block_ids(self, req_id: str) -> list[int]:
        return [b.block_id for b in self.req_blocks.get(req_id, ())]
