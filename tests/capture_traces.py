"""In-code capture traces for the audit tests, written with the real TraceWriter (real Parquet), as a
capture would. The clean story, block size 4, engine e0:
  r0 (8 prompt tokens) allocates blocks 1 and 2 and caches them (hashes 101, 102), then frees them;
  r1 (12 prompt tokens: r0's prompt + output + 2) hits both (touches 1 and 2: 8 cached tokens),
     allocates block 3, caches 103; lineage has r1 <- r0 twice: declared and exact_prefix (10 tokens);
  r2 (8 prompt tokens, new content) needs a block: 3 is evicted (103) and re-allocated, cached as 201;
  finally the prefix cache is cleared.
"""

from __future__ import annotations

from kmesh_trace.writer import TraceWriter

BLOCK = 4
META = {
    "engine_index": 0, "engine": "vllm 0.32.0", "model": "tiny", "block_size": BLOCK, "num_usable_blocks": 8,
    "null_block_id": 0,
}


def clean_events() -> list[dict]:
    ev = []

    def e(event, block, ref, h=None, req=None):
        ev.append({"event": event, "block_id": block, "ref_cnt": ref, "block_hash": h, "request_id": req})

    e("allocated", 1, 1, req="r0"); e("allocated", 2, 1, req="r0")
    e("cached", 1, 1, 101, "r0"); e("cached", 2, 1, 102, "r0")
    e("freed", 2, 0, 102, "r0"); e("freed", 1, 0, 101, "r0")
    e("touched", 1, 1, 101, "r1"); e("touched", 2, 1, 102, "r1"); e("allocated", 3, 1, req="r1")
    e("cached", 3, 1, 103, "r1")
    e("freed", 3, 0, 103, "r1"); e("freed", 2, 0, 102, "r1"); e("freed", 1, 0, 101, "r1")
    e("evicted", 3, 0, 103, "r2"); e("allocated", 3, 1, req="r2"); e("cached", 3, 1, 201, "r2")
    e("freed", 3, 0, 201, "r2")
    e("cleared", None, None)
    return ev


def clean_invocations() -> list[dict]:
    rows = []
    for i, (rid, n, cached) in enumerate((("r0", 8, 0), ("r1", 12, 8), ("r2", 8, 0))):
        t0 = 1_000 * (i + 1)
        rows.append({
            "request_id": rid, "seq": i, "num_prompt_tokens": n, "num_output_tokens": 2,
            "prompt_token_ids": {"r0": list(range(8)), "r1": list(range(8)) + [7, 7, 50, 51], "r2": list(range(100, 108))}[rid],
            "output_token_ids": [7, 7], "arrival_ns": t0, "first_scheduled_ns": t0 + 10, "first_token_ns": t0 + 20,
            "finish_ns": t0 + 30, "status": "finished", "num_cached_tokens": cached, "num_preemptions": 0,
        })
    return rows


def clean_lineage() -> list[dict]:
    return [
        {"child_request_id": "r1", "parent_request_id": "r0", "declared_parent_id": "r0", "family_id": "f",
         "edge_kind": "declared", "num_shared_tokens": 10},
        {"child_request_id": "r1", "parent_request_id": "r0", "declared_parent_id": None, "family_id": "f",
         "edge_kind": "exact_prefix", "num_shared_tokens": 10},
    ]


def write_trace(path, events=None, invocations=None, meta=None, dropped=0, lineage=None):
    events = clean_events() if events is None else events
    cols = {k: [e.get(k) for e in events] for k in ("event", "block_id", "ref_cnt", "block_hash", "request_id")}
    cols["seq"] = list(range(len(events)))
    cols["ts_ns"] = [e.get("ts_ns", 100 + 10 * i) for i, e in enumerate(events)]
    cols["kv_group"] = [e.get("kv_group", None if e["event"] == "cleared" else 0) for e in events]
    invocations = clean_invocations() if invocations is None else invocations
    with TraceWriter(path, engine_id="e0", metadata=dict(META if meta is None else meta)) as w:
        w.write("invocations", {k: [r.get(k) for r in invocations] for k in invocations[0]})
        w.write("block_events", cols)
        lineage = clean_lineage() if lineage is None else lineage
        if lineage:
            w.write("lineage", {k: [e[k] for e in lineage] for k in lineage[0]})
        if dropped:
            w.count_dropped("block_events", dropped)
    return path
