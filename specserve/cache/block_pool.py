"""The pool of KV cache blocks: reference counts, an O(1) LRU free queue, and the prefix-cache index.

Invariants (checked by tests/cache/invariants.py after every step of the state-machine test):
- a block is in the free queue iff its ref_cnt is 0;
- a freed block keeps its hash and stays findable through the index until it is evicted, i.e. taken
  from the head of the free queue for reuse (the LRU end);
- `cached[hash][block_id]` is a block whose `block_hash` is that hash and whose `token_ids` /
  `extra_keys` / `parent_content_id` are exactly what it was computed for;
- every registration gets a fresh `content_id`, larger than its parent's. A lookup walks a request's
  blocks from the first and accepts a candidate only if it holds the same tokens and extra keys AND was
  computed after the very block matched one position earlier (its `parent_content_id`). By induction a
  hit block's KV was computed for exactly the same token prefix, whatever the hash function does.
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

from specserve.cache.hashing import BlockHash

NO_PARENT = 0  # parent_content_id of a request's first block


@dataclass(slots=True, eq=False)
class KVCacheBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHash | None = None  # set while the block is in the prefix-cache index
    token_ids: tuple[int, ...] | None = None  # the tokens it holds (collision check)
    extra_keys: bytes | None = None  # model identity + cache salt it was computed under
    content_id: int = 0  # unique per registration, 0 = not registered
    parent_content_id: int = NO_PARENT  # content_id of the block before it when it was computed
    prev_free: KVCacheBlock | None = None
    next_free: KVCacheBlock | None = None

    @property
    def is_cached(self) -> bool:
        return self.block_hash is not None

    def __repr__(self) -> str:
        return f"KVCacheBlock(id={self.block_id}, ref={self.ref_cnt}, cached={self.is_cached})"


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
        assert block.prev_free is None and block.next_free is None, "block is already free"
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

    def __iter__(self) -> Iterator[KVCacheBlock]:
        """Head (next to evict) to tail (most recently freed)."""
        b = self._head.next_free
        while b is not self._tail:
            yield b
            b = b.next_free


@dataclass(slots=True)
class BlockPoolStats:
    num_evictions: int = 0  # cached blocks dropped from the index to be reused
    num_cow_copies: int = 0  # copy-on-write block copies (counted by the KVCacheManager)


class BlockPool:
    """`num_blocks` KV blocks with ref counts, the LRU free queue and the hash index."""

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"the KV cache needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.cached: dict[BlockHash, dict[int, KVCacheBlock]] = {}
        self.stats = BlockPoolStats()
        self.num_cached_blocks = 0  # blocks in the index, held or free
        self._next_content_id = 1

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
        assert n <= self.free_queue.num_free, f"cannot allocate {n} blocks, {self.free_queue.num_free} free"
        out = []
        for _ in range(n):
            block = self.free_queue.popleft()
            if block.is_cached:
                self._uncache(block)
                self.stats.num_evictions += 1
            block.ref_cnt = 1
            out.append(block)
        return out

    def _uncache(self, block: KVCacheBlock) -> None:
        same = self.cached[block.block_hash]
        del same[block.block_id]
        if not same:
            del self.cached[block.block_hash]
        self.num_cached_blocks -= 1
        block.block_hash = block.token_ids = block.extra_keys = None
        block.content_id = 0
        block.parent_content_id = NO_PARENT

    def get_cached_block(self, block_hash: BlockHash, token_ids: Sequence[int], parent_content_id: int,
                         extra_keys: bytes) -> KVCacheBlock | None:
        """A block computed for exactly these tokens, after the block with `parent_content_id`, under
        these extra keys; None if there is none (a hash collision is a miss, never a wrong hit)."""
        same = self.cached.get(block_hash)
        if not same:
            return None
        wanted = tuple(token_ids)
        for block in same.values():
            if (block.parent_content_id == parent_content_id and block.token_ids == wanted
                    and block.extra_keys == extra_keys):
                return block
        return None

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on each block (a free one leaves the free queue but keeps its hash)."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1

    def cache_block(self, block: KVCacheBlock, block_hash: BlockHash, token_ids: Sequence[int],
                    parent_content_id: int, extra_keys: bytes) -> None:
        """Index a full block of verified tokens. A block already indexed keeps its registration (a
        request holds an indexed block only through a prefix hit or a fork: same content)."""
        assert block.ref_cnt > 0, "only a held block can be registered"
        if not self.enable_caching or block.is_cached:
            return
        block.block_hash = block_hash
        block.token_ids = tuple(token_ids)
        block.extra_keys = extra_keys
        block.parent_content_id = parent_content_id
        block.content_id = self._next_content_id
        self._next_content_id += 1
        self.cached.setdefault(block_hash, {})[block.block_id] = block
        self.num_cached_blocks += 1

    def free_blocks(self, ordered: Iterable[KVCacheBlock]) -> None:
        """Drop one reference on each block; those reaching 0 join the free queue in the given order
        (callers pass a request's blocks tail-first, so its tail is evicted before its prefix)."""
        for block in ordered:
            assert block.ref_cnt > 0, f"double free of block {block.block_id}"
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_queue.append(block)

    def reset_prefix_cache(self) -> int:
        """Drop the hashes of all free blocks (held blocks stay indexed); returns how many."""
        free_cached = [b for b in self.free_queue if b.is_cached]
        for block in free_cached:
            self._uncache(block)
        return len(free_cached)
