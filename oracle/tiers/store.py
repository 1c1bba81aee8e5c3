"""The lower-tier store: an LRU over chunk keys, the one store every tier and every write policy uses.

A chunk is `chunk_blocks` consecutive blocks, keyed by the chained hash of its last block (equal keys
mean an equal whole prefix); it exists only once all its blocks are full. The store holds
`capacity_blocks // chunk_blocks` chunks. `put` is its only way in: a write-through tier puts a
request's chunks, an on-evict tier the blocks the tier above let go (`pass_through`: a tier without
room hands them on unchanged), the simple-cpu connector its stores without refreshing.
"""

from __future__ import annotations

from typing import Iterable

from kmesh_trace.oracle.lru_store import LruStore

__all__ = ["TierStore"]


class TierStore:
    """Chunk keys, least recently used first. Read `lru` for membership; change it only through the
    methods (they keep `num_stores`)."""

    __slots__ = ("lru", "capacity", "chunk", "num_stores")

    def __init__(self, num_chunks: int, chunk_blocks: int = 1):
        self.lru = LruStore()  # chunk keys, least recent first
        self.capacity = num_chunks
        self.chunk = chunk_blocks
        self.num_stores = 0

    def put(self, keys: Iterable, *, refresh: bool = True, pass_through: bool = False) -> list:
        """Store each key in order (one already held is refreshed, unless `refresh` is False) and return
        the keys that leave: those the LRU evicts, or, in a store of no capacity, every key when
        `pass_through` (an on-evict tier hands what it cannot hold to the next) and none otherwise."""
        cap = self.capacity
        if cap <= 0:
            return list(keys) if pass_through else []
        left, stored = self.lru.put(keys, cap, refresh=refresh)
        self.num_stores += stored
        return left

    def refresh(self, key) -> None:
        """A load that keeps the chunk makes it the most recently used."""
        self.lru.touch(key)

    def discard(self, key) -> None:
        """A read-once load removes the chunk (it may already be gone)."""
        self.lru.pop(key, None)

    def chunk_key(self, chain: list, j: int):
        """Key of the chunk holding block j of a hash chain, or None while that chunk is incomplete."""
        if self.chunk == 1:
            return chain[j]
        end = (j // self.chunk + 1) * self.chunk - 1
        return chain[end] if end < len(chain) else None
