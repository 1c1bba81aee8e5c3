"""The lower tiers' one LRU store (`kmesh_trace.oracle.tiers.store`): what it keeps, refreshes and lets go."""

from __future__ import annotations

from kmesh_trace.oracle.tiers.store import TierStore


def test_the_store_is_an_lru_that_says_what_leaves():
    s = TierStore(3)
    assert s.put([1, 2, 3]) == [] and s.num_stores == 3
    assert s.put([1, 4]) == [2]  # 1 refreshed, so 2 is the least recently used
    assert list(s.lru) == [3, 1, 4] and s.num_stores == 4
    assert s.put([3], refresh=False) == [] and list(s.lru) == [3, 1, 4]  # held: not refreshed, not stored
    assert s.put([5, 6, 7, 5]) == [3, 1, 4] and list(s.lru) == [6, 7, 5]  # one batch equals one key at a time
    s.discard(6)
    s.discard(6)
    s.refresh(7)
    assert list(s.lru) == [5, 7] and s.put([8, 9]) == [5]


def test_a_store_without_room_hands_on_only_when_asked():
    s = TierStore(0)
    assert s.put([1, 2]) == [] and s.put([1, 2], pass_through=True) == [1, 2]
    assert s.num_stores == 0 and not s.lru


def test_chunk_keys_are_the_last_block_of_a_complete_chunk():
    s = TierStore(8, chunk_blocks=2)
    chain = [10, 11, 12, 13, 14]
    assert [s.chunk_key(chain, j) for j in range(5)] == [11, 11, 13, 13, None]
