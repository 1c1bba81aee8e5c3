"""`LruStore`: keys in recency order, least recent first; the one LRU the Python references share.

The block pool's free queue (`blockpool.PoolModel.free`: eviction order), the block-level LRU policy
(`policies/lru.py`) and every lower tier's chunk store (`tiers/store.py`) are this class. It is an
`OrderedDict` of keys to None, so membership, insertion, `move_to_end` and `popitem` stay C-level
O(1) calls in the replays' hot loops; the named methods below are the operations the references
share.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Iterable

__all__ = ["LruStore"]


class LruStore(OrderedDict):
    """Keys, least recently used first (the head), most recently used last (the tail)."""

    __slots__ = ()

    def touch(self, key) -> None:
        """Make a held key the most recently used."""
        self.move_to_end(key)

    def pop_oldest(self):
        """Remove and return the least recently used key."""
        return self.popitem(last=False)[0]

    def put(self, keys: Iterable, capacity: int, *, refresh: bool = True) -> tuple[list, int]:
        """Store each key in order in a store of `capacity` keys (> 0): a held key is made the most recently
        used (unless `refresh` is False), a new one is appended, the least recently used leaving when the
        store is full. Returns (the keys that left, in order, the number of keys stored)."""
        move, popitem = self.move_to_end, self.popitem
        left = []
        n = len(self)
        stored = 0
        for k in keys:
            if k in self:
                if refresh:
                    move(k)
                continue
            stored += 1
            self[k] = None
            if n < capacity:
                n += 1
            else:
                left.append(popitem(False)[0])
        return left, stored
