"""The vLLM block-pool model's rules, one small exact case each (the real-pool comparison is in
test_blockpool_vllm.py)."""

from __future__ import annotations

import pytest

from kmesh_trace.errors import KmeshTraceError
from kmesh_trace.oracle.blockpool import HoldPolicy, PoolModel, simulate_pool
from kmesh_trace.oracle.stream import RequestBlocks, token_block_hashes


def req(i: int, prompt: list[int], num_out: int = 1, output: list[int] | None = None, *, bs: int = 4,
        arrival: int | None = None, finish: int | None = None, parent: int | None = None) -> RequestBlocks:
    ph, oh = token_block_hashes(prompt, output, bs)
    return RequestBlocks(i, f"r{i}", len(prompt), num_out, ph, oh if output else [], arrival, finish,
                         parent_index=parent)


A = list(range(100, 109))  # 9 tokens: 2 full 4-token blocks + 1


def test_free_queue_order_after_one_request():
    # 9 prompt tokens + 1 output: 9 computed tokens -> 3 blocks (1, 2, 3), 2 of them cached.
    # Freed tail first: the unhashed block 3 goes to the head, hashed 2 then 1 to the tail.
    res = simulate_pool([req(0, A)], block_size=4, num_usable_blocks=8)
    assert res.free_queue == [3, 4, 5, 6, 7, 8, 2, 1]
    assert (res.hit_tokens, res.num_evictions, res.admitted) == ([0], [0], [True])


def test_repeat_hits_capped_before_last_token_and_touch_leaves_queue():
    # The repeat hits both full blocks (8 tokens; the 9th is computed), reuses head block 3.
    res = simulate_pool([req(0, A), req(1, A)], block_size=4, num_usable_blocks=8)
    assert res.hit_tokens == [0, 8]
    assert res.free_queue == [3, 4, 5, 6, 7, 8, 2, 1]
    # An 8-token prompt can hit at most one block: the last token must be computed.
    res = simulate_pool([req(0, A[:8]), req(1, A[:8])], block_size=4, num_usable_blocks=8)
    assert res.hit_tokens == [0, 4]


def test_eviction_pops_head_and_counts_only_cached_blocks():
    other = list(range(500, 517))  # 17 tokens + 1 output -> 5 blocks
    res = simulate_pool([req(0, A), req(1, other), req(2, A)], block_size=4, num_usable_blocks=6)
    # r1 takes 3, 4, 5, 6 (uncached) and 2 (cached by r0): one eviction. r0's block 1 survives, so
    # r2 hits it and stops at its first miss (block 2's hash is gone); r2's new blocks are the
    # unhashed head block 2 and r1's cached tail block 6: one eviction.
    assert res.num_evictions == [0, 1, 1]
    assert res.hit_tokens == [0, 0, 4]


def test_duplicate_hashes_lookup_returns_oldest_surviving_block():
    pool = PoolModel(8)
    h = 12345
    assert pool.allocate([None, h, h]) == ([1, 2, 3], 0)  # vLLM caches the same hash twice
    assert pool.lookup([h], 1) == [2]
    pool.free_blocks([1])
    pool.free_blocks([3, 2])  # hashed: appended in this order
    assert pool.free_queue() == [1, 4, 5, 6, 7, 8, 3, 2]
    blocks, evicted = pool.allocate([None] * 7)  # through block 3: one eviction, block 2 still cached
    assert (blocks[-1], evicted) == (3, 1)
    assert pool.lookup([h], 1) == [2]


def test_unknown_generated_block_is_cached_under_a_private_key():
    # 4 prompt tokens + 5 outputs: 8 computed tokens -> 2 full blocks; the second is generated and
    # its tokens are unknown, yet vLLM caches it: it must go to the LRU tail, not the head.
    res = simulate_pool([req(0, A[:4], num_out=5)], block_size=4, num_usable_blocks=4)
    assert res.free_queue == [3, 4, 2, 1]
    res = simulate_pool([req(0, A[:4], num_out=5), req(1, A[:4] + [1, 2, 3, 4, 9])], block_size=4, num_usable_blocks=4)
    assert res.hit_tokens == [0, 4]  # the private block never matches


def test_known_generated_block_is_hit_by_a_child():
    out = [7, 7, 7, 7, 7]
    res = simulate_pool([req(0, A[:4], 5, out), req(1, A[:4] + out + [9])], block_size=4, num_usable_blocks=8)
    assert res.hit_tokens == [0, 8]


def test_timed_replay_pins_running_requests_and_defers():
    big = list(range(600, 611))  # 11 tokens + 1 output -> 3 blocks
    reqs = [req(0, A, arrival=0, finish=100), req(1, big, arrival=10, finish=50),
            req(2, A, arrival=20, finish=30)]
    res = simulate_pool(reqs, block_size=4, num_usable_blocks=4)
    # r1 does not fit next to running r0 (3 + 3 > 4): it waits for r0's finish and evicts r0's
    # second block; r2 (arriving while r1 runs) finds r0's first block but must wait for r1 too.
    assert res.timed and res.num_deferred == 2
    assert (res.hit_tokens, res.num_evictions) == ([0, 0, 4], [0, 1, 1])
    # With room for both, r2 hits r0's blocks while r0 still runs (shared, ref_cnt 2).
    res = simulate_pool(reqs, block_size=4, num_usable_blocks=12)
    assert (res.num_deferred, res.hit_tokens) == (0, [0, 0, 8])
    assert sorted(res.free_queue) == list(range(1, 13))


def test_request_larger_than_the_pool_is_not_admitted():
    res = simulate_pool([req(0, list(range(40)))], block_size=4, num_usable_blocks=8)
    assert res.admitted == [False]
    assert res.prefill_tokens == 40
    assert res.free_queue == list(range(1, 9))


def test_hold_released_under_pressure_is_unused():
    other = list(range(500, 521))  # 21 tokens + 1 -> 6 blocks
    child = A[:8] + [1, 2, 3]
    reqs = [req(0, A), req(1, other), req(2, child, parent=0)]
    policy = HoldPolicy(release_after={0: 1}, parent_of={2: 0})
    res = simulate_pool(reqs, block_size=4, num_usable_blocks=7, holds=policy)
    (h,) = res.holds
    # r1 needs 6 of the 5 unheld free blocks: the hold goes, tail first, and r1 evicts block 2.
    assert (h.status, h.num_blocks, h.release_reason, h.unused, h.held_block_steps) == ("taken", 2, "pressure", True, 2)
    assert res.hit_tokens == [0, 0, 4]
    res = simulate_pool(reqs, block_size=4, num_usable_blocks=9, holds=policy)
    (h,) = res.holds
    assert (h.release_reason, h.num_children_served, res.hit_tokens) == ("children", 1, [0, 0, 8])


def test_hold_caps_refuse():
    reqs = [req(0, A), req(1, A[:8] + [1], parent=0)]
    for cap, status in ((dict(max_held_blocks=1), "refused_blocks"), (dict(max_families=0), "refused_families"),
                        (dict(max_held_blocks=2), "taken")):
        res = simulate_pool(reqs, block_size=4, num_usable_blocks=8,
                          holds=HoldPolicy(release_after={0: 1}, parent_of={1: 0}, **cap))
        assert [h.status for h in res.holds] == [status]


def test_bad_arguments_raise():
    with pytest.raises(KmeshTraceError, match="times"):
        simulate_pool([req(0, A)], block_size=4, num_usable_blocks=8,
                    holds=HoldPolicy(release_after={}, parent_of={}, expiry_ns=5))
    with pytest.raises(KmeshTraceError, match="times"):
        simulate_pool([req(0, A)], block_size=4, num_usable_blocks=8, timed=True)
    with pytest.raises(KmeshTraceError, match="positive"):
        simulate_pool([req(0, A)], block_size=4, num_usable_blocks=0)
