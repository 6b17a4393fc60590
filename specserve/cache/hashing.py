"""Chained block hashes for the prefix cache.

hash(block i) = xxh3_128(hash(block i-1) || token ids of block i || extra keys), with hash(block -1) =
NONE_HASH. The extra keys carry the model identity (target and draft) and the request's optional
`cache_salt`, so blocks of different models or tenants never match. Hashes only index the cache; a hit
is confirmed by comparing the stored tokens, extra keys and parent link (block_pool.py), so even a
colliding hash function never serves wrong KV. The hash function is injectable so tests can force
collisions.
"""
from __future__ import annotations

from array import array
from collections.abc import Callable, Sequence
from typing import Any

import xxhash

BlockHash = bytes
HashFn = Callable[[bytes], BlockHash]
NONE_HASH: BlockHash = b"\x00" * 16


def xxh3_128(data: bytes) -> BlockHash:
    return xxhash.xxh3_128_digest(data)


def encode_extra_keys(extra_keys: Sequence[Any]) -> bytes:
    """Stable bytes for the extra keys (str / int / float / bool / None / tuples of those)."""
    return repr(tuple(extra_keys)).encode()


def hash_block(parent: BlockHash, token_ids: Sequence[int], extra: bytes,
               hash_fn: HashFn = xxh3_128) -> BlockHash:
    """The hash of one full block. Token ids are packed as int64, so with a fixed block size the
    three fields cannot run into each other."""
    return hash_fn(parent + array("q", token_ids).tobytes() + extra)


def hash_blocks(token_ids: Sequence[int], block_size: int, start_block: int, stop_block: int,
                parent: BlockHash, extra: bytes, hash_fn: HashFn = xxh3_128) -> list[BlockHash]:
    """Hashes of full blocks [start_block, stop_block) of `token_ids`, chained from `parent`
    (the hash of block start_block - 1, or NONE_HASH)."""
    assert stop_block * block_size <= len(token_ids), "only full blocks are hashed"
    hashes = []
    for b in range(start_block, stop_block):
        parent = hash_block(parent, token_ids[b * block_size:(b + 1) * block_size], extra, hash_fn)
        hashes.append(parent)
    return hashes
