"""The one loader (`Workload.from_trace`): one engine or every engine merged, declared parents from the
lineage table for every analysis (the fleet included), lineage edges by kind, and the column-wise path
a hash-only trace takes without RequestBlocks."""

from __future__ import annotations

import numpy as np

from kmesh_trace.oracle.families import families
from kmesh_trace.oracle.workload import Workload
from kmesh_trace.parts import open_parts
from kmesh_trace.trace import open_trace
from kmesh_trace.writer import TraceWriter


def _trace(path, *, declared_row: bool = True):
    """a, x, b with b extending a; b declares no parent_id, only a declared lineage row names a."""
    with TraceWriter(path, "e0", {"block_size": 4, "num_usable_blocks": 8}) as w:
        w.write("invocations", {"request_id": ["a", "x", "b"], "seq": [0, 1, 2], "num_prompt_tokens": [9, 9, 13],
                                "prompt_block_hashes": [[1, 2, 3], [7, 8, 9], [1, 2, 5, 6]],
                                "arrival_ns": [0, 1, 2], "finish_ns": [10, 11, 12]})
        if declared_row:
            w.write("lineage", {"child_request_id": ["b", "b"], "parent_request_id": ["a", "a"],
                                "declared_parent_id": ["a", None], "edge_kind": ["declared", "exact_prefix"]})
    return path


def test_every_analysis_and_the_fleet_read_declared_parents_from_the_lineage_table(tmp_path):
    t = open_trace(_trace(tmp_path / "t"))
    one, merged = Workload.from_trace(t), Workload.from_trace(t, merged=True)
    assert [r.parent_index for r in one.requests] == [r.parent_index for r in merged.requests] == [None, None, 0]
    # The fleet's families are the declared ones (before the one loader, the fleet ignored the table).
    assert families(merged, "auto") == (["root:0", "root:1", "root:0"], "declared")
    plain = Workload.from_trace(open_trace(_trace(tmp_path / "u", declared_row=False)), merged=True)
    assert families(plain, "auto")[1] == "inferred"


def test_lineage_edges_by_kind_location_and_partition(tmp_path):
    path = _trace(tmp_path / "t")
    w = Workload.from_trace(open_parts(str(path)), "e0")
    assert (w.lineage("exact_prefix"), w.lineage("content"), w.engine) == ({2: 0}, None, "e0")
    assert w.location == str(path) and w.num_usable_blocks == 8 and w.timed


def test_a_hash_only_trace_is_flattened_without_requests_into_the_same_stream(tmp_path):
    t = open_trace(_trace(tmp_path / "t"))
    flat, full = Workload.from_trace(t, requests=False), Workload.from_trace(t)
    assert flat.requests is None and full.requests is not None
    for name in ("obj", "eligible", "next_use", "req_start", "num_prompt_tokens", "num_reads"):
        assert np.array_equal(getattr(flat.stream, name), getattr(full.stream, name)), name
    assert flat.stock_tokens is None and full.stock_tokens is None


def _curves(workload: Workload, window: str = "all") -> dict:
    from kmesh_trace.oracle.headroom_curve import headroom_curve

    return headroom_curve(workload, window=window, processes=1).to_dict()


def _hash_only(path, *, timed: bool, n: int = 300, seed: int = 0):
    """n hash-only requests drawn from a few shared prefixes (timed: every one has a finish time)."""
    rng = np.random.default_rng(seed)
    ids, tokens, hashes, arrival, finish, out = [], [], [], [], [], []
    for i in range(n):
        stem = int(rng.integers(0, 6))
        k = int(rng.integers(1, 9))
        ids.append(f"r{i}")
        tokens.append(4 * k - int(rng.integers(0, 4)))
        hashes.append([stem * 100 + j for j in range(k)])
        arrival.append(i * 10)
        finish.append(i * 10 + int(rng.integers(1, 60)) if timed else None)
        out.append(int(rng.integers(0, 9)))
    with TraceWriter(path, "e0", {"block_size": 4, "num_usable_blocks": 12}) as w:
        w.write("invocations", {"request_id": ids, "seq": list(range(n)), "num_prompt_tokens": tokens,
                                "num_output_tokens": out, "prompt_block_hashes": hashes, "arrival_ns": arrival,
                                "finish_ns": finish})
    return path


def test_the_vllm_curve_of_the_columns_is_the_vllm_curve_of_the_requests(tmp_path):
    # Without RequestBlocks the pool model reads the requests' columns (output tokens, times): same curves.
    for timed in (True, False):
        t = open_trace(_hash_only(tmp_path / f"t{timed}", timed=timed, seed=int(timed)))
        flat, full = Workload.from_trace(t, requests=False), Workload.from_trace(t)
        assert flat.requests is None and flat.timed is full.timed is timed
        for name in ("num_output_tokens", "arrival_ns", "finish_ns"):
            assert np.array_equal(getattr(flat.columns, name), getattr(full.columns, name)), name
        for window in ("all", "last-half"):
            a, b = _curves(flat, window), _curves(full, window)
            assert a == b and a["curves"]["vllm"]["hit_blocks"][-1] > 0


def test_a_request_listed_twice_is_refused_without_requests_too(tmp_path):
    import pytest

    from kmesh_trace.errors import KmeshTraceError

    with TraceWriter(tmp_path / "t", "e0", {"block_size": 4}) as w:
        w.write("invocations", {"request_id": ["a", "a"], "seq": [0, 1], "num_prompt_tokens": [9, 9],
                                "prompt_block_hashes": [[1, 2, 3], [1, 2, 3]], "arrival_ns": [0, 1]})
    t = open_trace(tmp_path / "t")
    for requests in (True, False):
        with pytest.raises(KmeshTraceError, match="'a' appears twice"):
            Workload.from_trace(t, requests=requests)
