"""The pool of KV cache blocks: reference counts, an O(1) LRU free queue, and the prefix-cache index.

Invariants:
- a block is in the free queue iff its ref_cnt is 0;
- a freed block keeps its hash (and stays findable through `cached`) until it is evicted, i.e. taken
  from the head of the free queue for reuse;
- `cached[hash]` maps to blocks whose `block_hash` is that hash and whose `token_ids` are the tokens
  it was computed for (a hash hit is confirmed by comparing the tokens).
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from specserve.cache.hashing import BlockHash


@dataclass(slots=True, eq=False)
class KVCacheBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHash | None = None
    token_ids: tuple[int, ...] | None = None  # the tokens its hash covers (collision check)
    prev_free: KVCacheBlock | None = None
    next_free: KVCacheBlock | None = None

    def __repr__(self) -> str:
        return f"KVCacheBlock(id={self.block_id}, ref={self.ref_cnt}, cached={self.block_hash is not None})"


class FreeBlockQueue:
    """Intrusive doubly linked list of free blocks: evict from the head, free to the tail, O(1) removal."""

    def __init__(self, blocks: Sequence[KVCacheBlock]) -> None:
        self._head = KVCacheBlock(-1)
        self._tail = KVCacheBlock(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.num_free = 0
        for b in blocks:
            self.append(b)

    def append(self, block: KVCacheBlock) -> None:
        last = self._tail.prev_free
        last.next_free = block
        block.prev_free = last
        block.next_free = self._tail
        self._tail.prev_free = block
        self.num_free += 1

    def remove(self, block: KVCacheBlock) -> None:
        assert block.prev_free is not None and block.next_free is not None, "block is not free"
        block.prev_free.next_free = block.next_free
        block.next_free.prev_free = block.prev_free
        block.prev_free = block.next_free = None
        self.num_free -= 1

    def popleft(self) -> KVCacheBlock:
        block = self._head.next_free
        assert block is not self._tail, "no free blocks"
        self.remove(block)
        return block

    def __iter__(self):
        b = self._head.next_free
        while b is not self._tail:
            yield b
            b = b.next_free


@dataclass
class BlockPoolStats:
    num_evictions: int = 0
    num_cow_copies: int = 0


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"the KV cache needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.cached: dict[BlockHash, dict[int, KVCacheBlock]] = {}
        self.stats = BlockPoolStats()

    @property
    def num_free_blocks(self) -> int:
        return self.free_queue.num_free

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.free_queue.num_free

    def usage(self) -> float:
        return self.num_used_blocks / self.num_blocks

    def get_new_blocks(self, n: int) -> list[KVCacheBlock]:
        """Take `n` blocks from the LRU head (evicting their cached hashes), each with ref_cnt 1."""
        if n > self.free_queue.num_free:
            raise ValueError(f"cannot allocate {n} blocks, only {self.free_queue.num_free} free")
        out = []
        for _ in range(n):
            block = self.free_queue.popleft()
            self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def _evict(self, block: KVCacheBlock) -> None:
        if block.block_hash is None:
            return
        same = self.cached.get(block.block_hash)
        if same is not None and same.pop(block.block_id, None) is not None:
            self.stats.num_evictions += 1
            if not same:
                del self.cached[block.block_hash]
        block.block_hash = None
        block.token_ids = None

    def get_cached_block(self, block_hash: BlockHash, token_ids: Sequence[int]) -> KVCacheBlock | None:
        """A block holding exactly `token_ids` under `block_hash`, or None (a hash collision is a miss)."""
        same = self.cached.get(block_hash)
        if not same:
            return None
        wanted = tuple(token_ids)
        for block in same.values():
            if block.token_ids == wanted:
                return block
        return None

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on blocks found in the cache (removing free ones from the free queue)."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1

    def cache_block(self, block: KVCacheBlock, block_hash: BlockHash, token_ids: Sequence[int]) -> None:
        """Index a full block of verified tokens. A block already cached keeps its first hash."""
        if not self.enable_caching or block.block_hash is not None:
            return
        block.block_hash = block_hash
        block.token_ids = tuple(token_ids)
        self.cached.setdefault(block_hash, {})[block.block_id] = block

    def free_blocks(self, ordered: Iterable[KVCacheBlock]) -> None:
        """Drop one reference on each block; those reaching 0 join the free queue in the given order
        (callers pass a request's blocks tail-first, so its tail is evicted first)."""
        for block in ordered:
            assert block.ref_cnt > 0, f"double free of block {block.block_id}"
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if not self.enable_caching:
                    block.block_hash = None
                self.free_queue.append(block)

    def reset_prefix_cache(self) -> None:
        for block in self.free_queue:
            self._evict(block)
