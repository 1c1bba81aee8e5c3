"""The one LRU of the Python references (`kmesh_trace.oracle.lru_store`): recency order, and `put`."""

from __future__ import annotations

import random
from collections import OrderedDict

from kmesh_trace.oracle.lru_store import LruStore


def test_put_keeps_recency_and_says_what_leaves():
    s = LruStore()
    assert s.put([1, 2, 3], 3) == ([], 3)
    assert s.put([1, 4], 3) == ([2], 1)  # 1 refreshed, so 2 is the least recently used
    assert list(s) == [3, 1, 4]
    assert s.put([3], 3, refresh=False) == ([], 0) and list(s) == [3, 1, 4]  # held: neither refreshed nor stored
    s.touch(3)
    assert list(s) == [1, 4, 3] and s.pop_oldest() == 1 and list(s) == [4, 3]


def test_put_is_the_evict_then_insert_lru_one_key_at_a_time():
    """What `put` returns equals the textbook LRU (evict the head when full, then append), key by key."""
    rng = random.Random(7)
    keys = [rng.randrange(40) for _ in range(2000)]
    for cap in (1, 2, 5, 17, 64):
        ref: OrderedDict = OrderedDict()
        left_ref = []
        for k in keys:
            if k in ref:
                ref.move_to_end(k)
                continue
            if len(ref) == cap:
                left_ref.append(ref.popitem(last=False)[0])
            ref[k] = None
        s = LruStore()
        left, _ = s.put(keys, cap)
        assert left == left_ref and list(s) == list(ref)


def test_the_free_queue_is_one_too():
    s = LruStore.fromkeys(range(1, 5))
    assert isinstance(s, LruStore) and s.pop_oldest() == 1 and list(s) == [2, 3, 4]
