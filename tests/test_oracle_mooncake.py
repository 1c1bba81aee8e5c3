"""The simulators on the public Mooncake traces (../shared/datasets; skipped when absent)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

from kmesh_trace.oracle.headroom import headroom
from kmesh_trace.oracle.policies import Workload
from kmesh_trace.oracle.policies.belady import belady_hits, belady_reference
from kmesh_trace.oracle.policies.infinite import infinite_hits, infinite_reference
from kmesh_trace.oracle.policies.lru import lru_hits, lru_reference
from kmesh_trace.oracle.workload import request_blocks
from kmesh_trace.trace import open_trace

pytestmark = pytest.mark.shared_data

CAPACITIES = (1, 16, 128, 1024, 8192, 65536)


@pytest.fixture(scope="module", params=["conversation_trace.jsonl", "synthetic_trace.jsonl"])
def mooncake(request, tmp_path_factory):
    root = os.environ.get("KMESH_DATASETS") or Path(__file__).resolve().parents[1].parent / "shared" / "datasets"
    src = Path(root) / "mooncake" / request.param
    if not src.is_file():
        pytest.skip(f"Mooncake trace not found at {src} (set KMESH_DATASETS to the public datasets directory)")
    from kmesh_trace.datasets.importers.mooncake import import_mooncake

    out = tmp_path_factory.mktemp("mooncake") / "trace"
    import_mooncake(src, out)
    trace = open_trace(out)
    reqs = request_blocks(trace)
    return src, trace, reqs, Workload(512, reqs)


def _plain_repeats(src) -> int:
    """Eligible prompt block reads whose hash an earlier request's full blocks already held."""
    seen: set[int] = set()
    n = 0
    with open(src) as f:
        for line in f:
            rec = json.loads(line)
            hashes, p = rec["hash_ids"], rec["input_length"]
            n += sum(1 for h in hashes[:(p - 1) // 512] if h in seen)
            seen.update(hashes[:p // 512])
    return n


def test_infinite_is_the_plain_count_of_repeated_hashes(mooncake):
    src, _, reqs, w = mooncake
    want = _plain_repeats(src)
    assert int(infinite_hits(w.stream).sum()) == want == sum(infinite_reference(reqs, 512))
    assert int(w.stream.num_reads.sum()) == sum(len(r.prompt_hashes) for r in reqs)


def test_fast_equals_reference_and_belady_dominates_lru(mooncake):
    _, _, reqs, w = mooncake
    inf = int(infinite_hits(w.stream).sum())
    previous = 0
    for cap in CAPACITIES:
        lru, ev = lru_hits(w.stream, cap)
        assert (lru.tolist(), ev) == lru_reference(reqs, 512, cap)
        bel = belady_hits(w.stream, cap)[0]
        assert bel.tolist() == belady_reference(reqs, 512, cap)
        assert lru.sum() <= bel.sum() <= inf
        assert bel.sum() >= previous  # the optimum never loses hits with more room
        previous = bel.sum()


def test_belady_bounds_the_pool_model_and_headroom_is_positive(mooncake):
    _, trace, _, w = mooncake
    res = headroom(trace, [1024, 8192], ["lru", "vllm", "belady"])
    by = {(r.policy, r.capacity_blocks): r for r in res.results}
    for cap in (1024, 8192):
        assert by["vllm", cap].hit_blocks <= by["belady", cap].hit_blocks
    assert res.stock_source == "vllm" and res.headroom_capacity_blocks == 1024
    assert res.headroom_tokens == by["vllm", 1024].prefill_tokens - by["belady", 1024].prefill_tokens > 0


def test_one_pass_curves_equal_the_replays_at_sampled_capacities(mooncake):
    from kmesh_trace.oracle.curves import belady_curve, lru_curve

    _, _, _, w = mooncake
    lru, bel = lru_curve(w.stream), belady_curve(w.stream)
    half = w.stream.num_requests // 2
    lru_w, bel_w = lru_curve(w.stream, half), belady_curve(w.stream, half)
    caps = sorted({*CAPACITIES, 3, 777, bel.max_level - 1, bel.max_level, lru.max_level - 1, lru.max_level})
    for c in caps:
        lh, bh = lru_hits(w.stream, c)[0], belady_hits(w.stream, c)[0]
        assert lru.hit_blocks([c])[0] == lh.sum() and bel.hit_blocks([c])[0] == bh.sum(), c
        assert lru_w.hit_blocks([c])[0] == lh[half:].sum() and bel_w.hit_blocks([c])[0] == bh[half:].sum(), c
    # Flat from the deepest level on: every reuse a cache of that size can serve.
    assert bel.hit_blocks([bel.max_level])[0] == bel.hit_blocks([10**9])[0] == belady_hits(w.stream, 10**9)[0].sum()


def test_column_wise_stream_equals_the_stream_of_request_blocks(mooncake):
    from kmesh_trace.oracle.workload import Workload

    _, trace, _, w = mooncake
    flat = Workload.from_trace(trace, requests=False)  # hash-only: flattened column-wise, no RequestBlocks
    s, stock = flat.stream, flat.stock_tokens
    assert stock is None
    for name in ("obj", "eligible", "next_use", "req_start", "num_prompt_tokens", "num_reads"):
        assert np.array_equal(getattr(s, name), getattr(w.stream, name)), name
    assert s.num_objects == w.stream.num_objects
