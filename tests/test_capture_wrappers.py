"""The writer-side expansion of batch records (capture/wrappers.py): batches expand to the rows a
sequential reading gives, and a dropped batch leaves a gap of exactly its events.

The expansion is checked against rows built the plain way (one row per block, as a sequential
reading of the pool gives them) on a real vLLM BlockPool."""

from __future__ import annotations

import pytest


def _pool():
    pytest.importorskip("vllm")
    from vllm.v1.core.block_pool import BlockPool

    return BlockPool(num_gpu_blocks=9, enable_caching=True, hash_block_size=4)


def test_batch_records_expand_to_the_rows_a_sequential_reading_gives(tmp_path):
    """Allocate, cache, free, allocate again (evicting), touch: every row, seq and free count."""
    from kmesh_trace.capture import wrappers
    from kmesh_trace.capture.recorder import Recorder
    from vllm.v1.core.kv_cache_utils import make_block_hash_with_group_id

    pool = _pool()
    rec = Recorder(tmp_path / "t", config={"flush_interval_s": 3600})
    wrappers.install_pool(rec, pool, 0)
    rec.ctx_req = "r"
    a = pool.get_new_blocks(3)
    key = make_block_hash_with_group_id(b"\x00" * 24 + (7).to_bytes(8, "big"), 0)
    pool.cached_block_hash_to_block.insert(key, a[0])  # as cache_full_blocks would
    a[0]._block_hash = key
    pool.free_blocks(reversed(a))
    pool.touch([a[0]])  # a prefix hit on the cached block: leaves the free queue
    b = pool.get_new_blocks(7)  # takes every other free block, evicting none (a[0] is in use)
    pool.free_blocks([a[0]])
    c = pool.get_new_blocks(1)  # the only free block left is a[0]: evicted, then allocated
    expanded = rec.block_expander.expand(rec.block_events.drain())
    got = [(r[0], r[3], r[4], r[5], r[6] is not None, r[9]) for r in expanded]
    ids = lambda bs: [x.block_id for x in bs]  # noqa: E731
    want = [(i, "allocated", bid, 1, False, 7 - i) for i, bid in enumerate(ids(a))]
    want += [(3, "freed", a[2].block_id, 0, False, 6), (4, "freed", a[1].block_id, 0, False, 7),
             (5, "freed", a[0].block_id, 0, True, 8), (6, "touched", a[0].block_id, 1, True, 7)]
    want += [(7 + i, "allocated", bid, 1, False, 6 - i) for i, bid in enumerate(ids(b))]
    want += [(14, "freed", a[0].block_id, 0, True, 1), (15, "evicted", a[0].block_id, 0, True, 0),
             (16, "allocated", c[0].block_id, 1, False, 0)]
    assert got == want
    rec.close()


def test_a_dropped_batch_leaves_a_gap_of_exactly_its_events_and_null_blocks_take_no_seq(tmp_path):
    from kmesh_trace.capture import wrappers
    from kmesh_trace.capture.recorder import Recorder
    from kmesh_trace.trace import open_trace

    pool = _pool()
    rec = Recorder(tmp_path / "t", config={"flush_interval_s": 3600, "max_buffered_events": 4})
    wrappers.install_pool(rec, pool, 0)
    a = pool.get_new_blocks(3)  # 3 events: buffered
    b = pool.get_new_blocks(2)  # 2 more would make 5 > 4: dropped, counted, seqs 3-4 left as a gap
    rec.flush()
    pool.free_blocks([pool.null_block] + a)  # the null block is not an event of the pool
    rec.close()
    t = open_trace(tmp_path / "t")
    assert t.frame("block_events").sort("seq")["seq"].to_list() == [0, 1, 2, 5, 6, 7]
    (meta,) = t.engines.values()
    assert meta["num_dropped_events"]["block_events"] == 2 and meta["complete"] is True
    assert len(b) == 2

