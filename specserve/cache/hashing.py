"""Chained block hashes for the prefix cache.

hash(block i) = xxh3_128(hash(block i-1), token ids of block i, extra keys). The extra keys carry the
model identity (target and draft) and the request's optional `cache_salt`, so blocks of different
models or tenants never match. The hash function is injectable so tests can force collisions.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from array import array

import xxhash

BlockHash = bytes
HashFn = Callable[[bytes], BlockHash]
NONE_HASH: BlockHash = b"\x00" * 16


def xxh3_128(data: bytes) -> BlockHash:
    return xxhash.xxh3_128_digest(data)


def encode_extra_keys(extra_keys: Sequence[Any]) -> bytes:
    return repr(tuple(extra_keys)).encode()


def hash_block(parent: BlockHash, token_ids: Sequence[int], extra: bytes,
               hash_fn: HashFn = xxh3_128) -> BlockHash:
    data = parent + array("q", token_ids).tobytes() + extra
    return hash_fn(data)


def hash_full_blocks(token_ids: Sequence[int], block_size: int, extra: bytes, start_block: int,
                     parent: BlockHash, hash_fn: HashFn = xxh3_128) -> list[BlockHash]:
    """Hashes of the full blocks of `token_ids` from `start_block` on, chained from `parent`."""
    hashes = []
    for b in range(start_block, len(token_ids) // block_size):
        parent = hash_block(parent, token_ids[b * block_size:(b + 1) * block_size], extra, hash_fn)
        hashes.append(parent)
    return hashes
