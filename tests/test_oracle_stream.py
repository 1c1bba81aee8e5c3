"""The access stream: token hashing, which blocks are reads and writes, next uses, trace order."""

from __future__ import annotations

import numpy as np
import pytest

from kmesh_trace.errors import KmeshTraceError
from kmesh_trace.oracle.policies.base import reference_accesses
from kmesh_trace.oracle.stream import (NEVER, AccessStream, RequestBlocks, chain_block_hashes, engine_geometry,
                                       next_uses, num_cached_blocks, num_computed_tokens, pool_capacity,
                                       requests_from_rows, token_block_hashes)
from kmesh_trace.oracle.workload import request_blocks
from kmesh_trace.trace import open_trace
from kmesh_trace.writer import TraceWriter


def test_chain_hashes_identify_whole_prefixes():
    a = chain_block_hashes([1, 2, 3, 4, 5, 6], 2, 3)
    b = chain_block_hashes([1, 2, 9, 9, 5, 6], 2, 3)
    assert a[0] == b[0] and a[1] != b[1]
    assert a[2] != b[2]  # same tokens, different ancestor: a different block
    assert a == chain_block_hashes([1, 2, 3, 4, 5, 6, 7], 2, 3)  # stable, and only full blocks
    assert all(0 <= h < 2**64 for h in a)


def test_generated_blocks_stop_before_the_last_sampled_token():
    prompt = list(range(10))  # 2 full blocks of 4, 2 tokens over
    # 6 generated tokens: KV exists for 10 + 5 = 15 tokens -> 3 full blocks, one of them from generation.
    p, o = token_block_hashes(prompt, [100, 101, 102, 103, 104, 105], 4)
    assert len(p) == 2 and len(o) == 1
    # 7 generated tokens: 16 tokens of KV -> the 4th block completes.
    p, o = token_block_hashes(prompt, [100, 101, 102, 103, 104, 105, 106], 4)
    assert len(o) == 2
    assert o == chain_block_hashes(prompt + [100, 101, 102, 103, 104, 105, 106], 4, 4)[2:]
    # No output: the prompt's full blocks only.
    assert token_block_hashes(list(range(8)), [], 4)[1] == []


def _import_reqs():
    # Hash-list trace, 4-token blocks: partial last blocks, and a prompt that fills its last block.
    return [
        RequestBlocks(0, "a", 9, 3, [1, 2, 3]),  # 2 full (both eligible) + 1 partial
        RequestBlocks(1, "b", 8, 3, [1, 2]),  # 2 full, only the first eligible (8 - 1) // 4 = 1
        RequestBlocks(2, "c", 12, 0, [1, 5, 6]),  # 3 full, 2 eligible
    ]


def test_stream_reads_writes_and_next_uses_exactly():
    s = AccessStream.from_requests(_import_reqs(), 4)
    uniq = {1: 0, 2: 1, 5: 2, 6: 3}
    assert s.obj.tolist() == [uniq[h] for h in (1, 2, 1, 2, 1, 5, 6)]
    assert s.eligible.tolist() == [True, True, True, False, True, True, False]
    assert s.req_start.tolist() == [0, 2, 4, 7]
    assert s.num_reads.tolist() == [3, 2, 3]  # the partial block counts as a read
    # Block 2's next access (in request b) is past its eligible reads: a free recompute, so NEVER.
    assert s.next_use.tolist() == [2, NEVER, 4, NEVER, NEVER, NEVER, NEVER]


def test_stream_matches_plain_reference_and_scan_on_random_requests():
    rng = np.random.default_rng(7)
    for _ in range(50):
        reqs = _random_token_requests(rng, bs=2)
        s = AccessStream.from_requests(reqs, 2)
        flat = [a for acc in reference_accesses(reqs, 2) for a in acc]
        assert [e for _, e in flat] == s.eligible.tolist()
        ids = [h for h, _ in flat]
        for t in range(len(flat)):
            later = [u for u in range(t + 1, len(flat)) if ids[u] == ids[t]]
            want = later[0] if later and flat[later[0]][1] else NEVER
            assert s.next_use[t] == want


def test_stream_ids_and_next_uses_from_the_linear_build_equal_unique_and_the_vectorised_next_uses():
    """from_arrays numbers objects and finds next uses without sorting the stream (oracle/stream_index.py): the
    same ids as np.unique's inverse, the same next uses as `next_uses`, on hashes with many repeats and none."""
    rng = np.random.default_rng(11)
    for trial in range(300):
        n = int(rng.integers(0, 2000))
        hashes = rng.integers(0, int(rng.integers(1, 2 * n + 2)), n).astype(np.uint64) * np.uint64(2**40 + 7)
        eligible = rng.random(n) < 0.7
        s = AccessStream.from_arrays(16, hashes, eligible, np.array([0, n]), np.array([16 * n]), np.array([n]))
        uniq, inverse = np.unique(hashes, return_inverse=True)
        assert s.obj.dtype == np.int32 and np.array_equal(s.obj, inverse) and s.num_objects == len(uniq), trial
        assert np.array_equal(s.next_use, next_uses(inverse.astype(np.int32), eligible)), trial


def test_tile_keeps_copies_independent():
    s = AccessStream.from_requests(_import_reqs(), 4)
    t = s.tile(3)
    assert len(t) == 3 * len(s) and t.num_objects == 3 * s.num_objects
    assert t.req_start.tolist() == [0, 2, 4, 7, 9, 11, 14, 16, 18, 21]
    fresh = AccessStream.from_arrays(4, t.obj.astype(np.uint64), t.eligible, t.req_start, t.num_prompt_tokens,
                                     t.num_reads)
    assert fresh.next_use.tolist() == t.next_use.tolist()


def _random_token_requests(rng, bs, n_req=None, vocab=2, max_prompt=7, max_out=3):
    rows = []
    for i in range(n_req or int(rng.integers(1, 6))):
        p = int(rng.integers(1, max_prompt + 1))
        o = int(rng.integers(0, max_out + 1))
        rows.append({"request_id": str(i), "num_prompt_tokens": p, "num_output_tokens": o,
                     "prompt_token_ids": rng.integers(0, vocab, p).tolist(),
                     "output_token_ids": rng.integers(0, vocab, o).tolist()})
    return requests_from_rows(rows, bs)


def test_request_blocks_orders_by_arrival_then_seq(tmp_path):
    with TraceWriter(tmp_path / "t", "e0", {"block_size": 2, "num_usable_blocks": 10}) as w:
        w.write("invocations", {
            "request_id": ["r0", "r1", "r2", "r3"], "seq": [0, 1, 2, 3],
            "caller_request_id": ["c0", "c1", "c2", "c3"],
            "parent_id": [None, None, "c3", None],
            "num_prompt_tokens": [4, 5, 3, 2], "num_output_tokens": [1, 2, 1, 1],
            "prompt_token_ids": [[1, 2, 3, 4], [1, 2, 3, 4, 5], [7, 7, 7], [9, 9]],
            "output_token_ids": [[5], [6, 6], [1], [0]],
            "arrival_ns": [30, 10, 20, 10], "finish_ns": [40, 15, 25, 12],
            "num_cached_tokens": [2, 0, 0, 0],
        })
    reqs = request_blocks(open_trace(tmp_path / "t"))
    assert [r.request_id for r in reqs] == ["r1", "r3", "r2", "r0"]
    assert [r.index for r in reqs] == [0, 1, 2, 3]
    assert reqs[2].parent_index == 1  # c3 is r3, now at index 1
    assert reqs[3].stock_cached_tokens == 2
    # r1: 5 prompt + 2 output -> KV for 6 tokens: blocks 0, 1 from the prompt, block 2 from generation.
    assert len(reqs[0].prompt_hashes) == 2 and len(reqs[0].output_hashes) == 1
    assert reqs[3].prompt_hashes == reqs[0].prompt_hashes  # same first 4 tokens


def test_request_blocks_refuses_blockless_rows_and_engine_ambiguity(tmp_path):
    with pytest.raises(KmeshTraceError, match="neither prompt_token_ids nor prompt_block_hashes"):
        requests_from_rows([{"request_id": "x", "num_prompt_tokens": 3}], 2)
    for e in ("e0", "e1"):
        with TraceWriter(tmp_path / "t", e, {"block_size": 2}) as w:
            w.write("invocations", {"request_id": ["a"], "seq": [0], "num_prompt_tokens": [2],
                                    "prompt_block_hashes": [[5]]})
    with pytest.raises(KmeshTraceError, match="each with its own cache; give engine=ENGINE_ID"):
        request_blocks(open_trace(tmp_path / "t"))
    assert [r.prompt_hashes for r in request_blocks(open_trace(tmp_path / "t"), "e1")] == [[5]]


def test_a_child_finds_its_parents_generated_blocks():
    parent = {"request_id": "p", "num_prompt_tokens": 5, "num_output_tokens": 4,
              "prompt_token_ids": [1, 2, 3, 4, 5], "output_token_ids": [6, 7, 8, 9],
              "prompt_block_hashes": [11, 12]}  # tokens win over listed hashes
    child = {"request_id": "c", "parent_id": "p", "num_prompt_tokens": 10, "num_output_tokens": 1,
             "prompt_token_ids": [1, 2, 3, 4, 5, 6, 7, 8, 9, 10], "output_token_ids": [0]}
    p, c = requests_from_rows([parent, child], 4)
    # The parent's KV covers 5 + 3 tokens: block 1 (tokens 5-8) is completed by generation.
    assert len(p.prompt_hashes) == 1 and len(p.output_hashes) == 1
    assert c.prompt_hashes[:2] == p.prompt_hashes + p.output_hashes and c.parent_index == 0


def test_engine_geometry_is_the_one_place_analyses_read_block_size_and_capacity(tmp_path):
    from kmesh_trace.oracle.headroom import headroom, headroom_of_requests
    from kmesh_trace.oracle.pressure import what_if_trace
    from kmesh_trace.oracle.workload import Workload

    for e, meta in (("e0", {"block_size": 2, "num_usable_blocks": 10}), ("e1", {}), ("e2", {"block_size": 4})):
        with TraceWriter(tmp_path / "t", e, meta) as w:
            w.write("invocations", {"request_id": ["a"], "seq": [0], "num_prompt_tokens": [9],
                                    "prompt_token_ids": [list(range(9))]})
    t = open_trace(tmp_path / "t")
    assert (engine_geometry(t, "e0"), engine_geometry(t, "e2")) == ((2, 10), (4, None))
    with pytest.raises(KmeshTraceError, match="each with its own cache; give engine=ENGINE_ID"):
        engine_geometry(t)
    with pytest.raises(KmeshTraceError, match="the trace has no engine 'e9'; its engines are e0, e1, e2."):
        engine_geometry(t, "e9")
    no_block_size = r"^the trace has no block size; its engine metadata must give `block_size`\.$"
    for analysis in (engine_geometry, request_blocks, Workload.from_trace, lambda t, e: headroom(t, engine=e)):
        with pytest.raises(KmeshTraceError, match=no_block_size):
            analysis(t, "e1")
    with pytest.raises(KmeshTraceError, match=no_block_size):
        headroom_of_requests(request_blocks(t, "e0"), None, [4])
    no_capacity = r"^the trace does not record the engine's usable blocks \(imported traces cannot\); give capacity_blocks=N\.$"
    for analysis in (lambda: headroom(t, engine="e2"), lambda: what_if_trace(t, engine="e2"),
                     lambda: pool_capacity(None, None)):
        with pytest.raises(KmeshTraceError, match=no_capacity):
            analysis()
    assert (pool_capacity(7, 10), pool_capacity(None, 10)) == (7, 10)
    with pytest.raises(KmeshTraceError, match=r"^a pool capacity must be a positive block count, not 0\.$"):
        pool_capacity(0, 10)


def test_computed_tokens_exclude_the_last_sampled_token():
    assert [num_computed_tokens(10, g) for g in (0, 1, 2, 6)] == [10, 10, 11, 15]
    assert [num_cached_blocks(10, g, 4) for g in (0, 6, 7)] == [2, 3, 4]
