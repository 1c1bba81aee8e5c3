"""Capture-fitness audit: one clean trace and one trace per planted defect, with exact findings.

The traces are written in code (tests/capture_traces.py: the clean story and the writer).
"""

from __future__ import annotations

import json

import pytest
from kmesh_trace.audit.capture import audit_capture
from capture_traces import META, clean_events, clean_invocations, clean_lineage, write_trace  # tests/ is on sys.path


def summary(result) -> list[tuple]:
    return [(p.code, p.severity, p.count, p.locations) for p in result.problems]


def test_clean_trace_has_no_findings(tmp_path):
    r = audit_capture(write_trace(tmp_path / "t"))
    assert summary(r) == []
    assert r.exit_code == 0
    assert r.verdict == {"headroom": {"qualified": True, "blocked_by": []},
                         "retention_pressure": {"qualified": True, "blocked_by": []}}
    assert r.rows == {"invocations": 3, "lineage": 2, "block_events": 18, "transfers": 0, "steps": 0}
    d = r.to_dict()
    assert d["engines"] == ["e0"] and d["problems"] == []


def _edit(events, i, **kw):
    events[i] = {**events[i], **kw}
    return events


@pytest.mark.parametrize("name, events, expected", [
    ("negative ref count", lambda: _edit(clean_events(), 5, ref_cnt=-1),
     [("negative_ref_cnt", "blocking", 1, ["block_events:e0:5"])]),
    ("free of a never-allocated block", lambda: clean_events()[:6] + [
        {"event": "freed", "block_id": 6, "ref_cnt": 0, "block_hash": None, "request_id": "r0"}] + clean_events()[6:],
     [("free_unallocated", "blocking", 1, ["block_events:e0:6"])]),
    ("double free", lambda: clean_events()[:6] + [
        {"event": "freed", "block_id": 1, "ref_cnt": 0, "block_hash": 101, "request_id": "r0"}] + clean_events()[6:],
     [("free_unallocated", "blocking", 1, ["block_events:e0:6"])]),
    ("eviction of an uncached block", lambda: clean_events()[:9] + [
        {"event": "evicted", "block_id": 3, "ref_cnt": 1, "block_hash": 103, "request_id": "r1"}] + clean_events()[9:],
     [("evict_uncached", "blocking", 1, ["block_events:e0:9"])]),
    ("touch of a never-allocated block", lambda: _edit(clean_events(), 7, block_id=5),
     # r1's free of block 2 then finds block 2 unreferenced (its touch went to block 5).
     [("touch_unallocated", "blocking", 1, ["block_events:e0:7"]),
      ("free_unallocated", "blocking", 1, ["block_events:e0:11"])]),
    ("duplicate resident hash", lambda: _edit(clean_events(), 15, block_hash=101),
     [("duplicate_resident_hash", "warning", 1, ["block_events:e0:15"])]),
    ("allocation of a block still cached", lambda: [e for i, e in enumerate(clean_events()) if i != 13],
     [("allocated_while_cached", "blocking", 1, ["block_events:e0:13"])]),
    ("non-monotonic clock", lambda: _edit(clean_events(), 4, ts_ns=105),
     [("clock_not_monotonic", "blocking", 1, ["block_events:e0:4"])]),
])
def test_planted_block_event_defect(tmp_path, name, events, expected):
    r = audit_capture(write_trace(tmp_path / "t", events=events()))
    assert summary(r) == expected, name
    blocking = [p for p in expected if p[1] == "blocking"]
    assert r.exit_code == (3 if blocking else 0)
    want = sorted({p[0] for p in blocking})
    assert r.verdict["headroom"] == {"qualified": not want, "blocked_by": want}


def test_cached_token_mismatch(tmp_path):
    inv = clean_invocations()
    inv[1]["num_cached_tokens"] = 4
    r = audit_capture(write_trace(tmp_path / "t", invocations=inv))
    assert summary(r) == [("cached_tokens_mismatch", "blocking", 1, ["invocations:e0:r1 (4 != 8)"])]
    assert r.exit_code == 3


SLIDING = {"kind": "sliding_window", "block_size": 4, "sliding_window": 4}
FULL = {"kind": "full_attention", "block_size": 4}


def test_hits_are_checked_in_every_kv_group(tmp_path):
    """r1's 8-token hit: the full group touches 2 blocks; a sliding window of 4 tokens keeps only the
    block of the hit's last 3 tokens (8 // 4 - (8 - 4 + 1) // 4 = 1), and here touched none."""
    meta = {**META, "kv_cache_groups": [FULL, SLIDING]}
    r = audit_capture(write_trace(tmp_path / "t", meta=meta))
    assert summary(r) == [("cached_tokens_mismatch", "blocking", 1,
                           ["invocations:e0:r1 group 1 (sliding_window: 0 blocks touched, 1 expected)"])]


def test_the_window_groups_touches_agree(tmp_path):
    ev = clean_events()
    g1 = [{"event": "allocated", "block_id": 4, "ref_cnt": 1, "request_id": "r0", "kv_group": 1},
          {"event": "allocated", "block_id": 5, "ref_cnt": 1, "request_id": "r0", "kv_group": 1},
          {"event": "cached", "block_id": 4, "ref_cnt": 1, "block_hash": 101, "request_id": "r0", "kv_group": 1},
          {"event": "cached", "block_id": 5, "ref_cnt": 1, "block_hash": 102, "request_id": "r0", "kv_group": 1},
          {"event": "freed", "block_id": 4, "ref_cnt": 0, "block_hash": 101, "request_id": "r0", "kv_group": 1},
          {"event": "freed", "block_id": 5, "ref_cnt": 0, "block_hash": 102, "request_id": "r0", "kv_group": 1},
          {"event": "touched", "block_id": 5, "ref_cnt": 1, "block_hash": 102, "request_id": "r1", "kv_group": 1},
          {"event": "freed", "block_id": 5, "ref_cnt": 0, "block_hash": 102, "request_id": "r1", "kv_group": 1}]
    events = ev[:6] + g1 + ev[6:]
    r = audit_capture(write_trace(tmp_path / "t", events=events, meta={**META, "kv_cache_groups": [FULL, SLIDING]}))
    assert summary(r) == []
    # Block events per group. Each row here has a time of its own (a capture stamps all rows of one pool
    # call alike), so every free before a request's last one of its group counts as early: r0's first
    # and r1's first two in group 0, r0's block 4 in group 1.
    assert r.to_dict()["kv_groups"] == {"e0": [
        {"group": 0, "kind": "full_attention", "sliding_window": None, "num_allocated": 4, "num_touched": 2,
         "num_cached": 4, "num_freed": 6, "num_evicted": 1, "num_freed_while_running": 3},
        {"group": 1, "kind": "sliding_window", "sliding_window": 4, "num_allocated": 2, "num_touched": 1,
         "num_cached": 2, "num_freed": 3, "num_evicted": 0, "num_freed_while_running": 1}]}


def test_a_group_the_metadata_does_not_list(tmp_path):
    events = _edit(clean_events(), 16, kv_group=2)
    r = audit_capture(write_trace(tmp_path / "t", events=events, meta={**META, "kv_cache_groups": [FULL, SLIDING]}))
    assert ("unknown_kv_group", "blocking", 1, ["block_events:e0:16 kv_group=2"]) in summary(r)
    r = audit_capture(write_trace(tmp_path / "u", events=_edit(clean_events(), 16, kv_group=1)))
    assert ("unknown_kv_group", "blocking", 1, ["block_events:e0:16 kv_group=1"]) in summary(r)


def test_preempted_request_is_not_compared(tmp_path):
    inv = clean_invocations()
    inv[1]["num_cached_tokens"] = 4
    inv[1]["num_preemptions"] = 1
    assert summary(audit_capture(write_trace(tmp_path / "t", invocations=inv))) == []


def test_invocation_times_out_of_order(tmp_path):
    inv = clean_invocations()
    inv[2]["first_token_ns"] = inv[2]["finish_ns"] + 1
    inv[1]["arrival_ns"] = 500  # before r0's arrival at 1000
    r = audit_capture(write_trace(tmp_path / "t", invocations=inv))
    assert [(p.code, p.count, p.locations) for p in r.problems] == [
        ("clock_not_monotonic", 1, ["invocations:e0:r1"]),
        ("clock_not_monotonic", 1, ["invocations:e0:r2"]),
    ]


def test_dropped_events(tmp_path):
    r = audit_capture(write_trace(tmp_path / "t", dropped=2))
    assert summary(r) == [("dropped_events", "blocking", 2, ["engines/e0.json:num_dropped_events"])]
    assert r.verdict["retention_pressure"] == {"qualified": False, "blocked_by": ["dropped_events"]}


def test_missing_metadata_field(tmp_path):
    meta = {k: v for k, v in META.items() if k != "model"}
    r = audit_capture(write_trace(tmp_path / "t", meta=meta))
    assert summary(r) == [("missing_field", "blocking", 1, ["engines/e0.json:model"])]
    assert r.problems[0].message == "metadata field model is missing or null"


def test_missing_filled_column_blocks_retention_only(tmp_path):
    inv = clean_invocations()
    inv[0]["first_token_ns"] = None
    r = audit_capture(write_trace(tmp_path / "t", invocations=inv))
    assert summary(r) == [("missing_field", "blocking", 1, ["invocations:e0:r0"])]
    assert r.verdict == {"headroom": {"qualified": True, "blocked_by": []},
                         "retention_pressure": {"qualified": False, "blocked_by": ["missing_field"]}}


def test_incomplete_capture(tmp_path):
    path = write_trace(tmp_path / "t")
    meta_path = path / "engines" / "e0.json"
    meta = json.loads(meta_path.read_text())
    meta["complete"] = False
    meta_path.write_text(json.dumps(meta))
    assert summary(audit_capture(path)) == [("incomplete_capture", "blocking", 1, ["engines/e0.json:complete"])]


def test_an_engine_that_died_under_the_capture_is_a_warning_with_how(tmp_path):
    """A worker killed under the engine: the partition closed complete, the run did not end as planned."""
    path = write_trace(tmp_path / "t", meta={**META, "engine_died": "a worker process died"})
    r = audit_capture(path)
    assert summary(r) == [("engine_died", "warning", 1, ["engines/e0.json:engine_died"])]
    assert r.problems[0].message == ("the engine died under the capture: a worker process died; the trace holds "
                                     "what was recorded until then")
    assert r.exit_code == 0


@pytest.mark.engine
def test_real_engine_capture_is_fit(family_capture):
    """A real vLLM engine (in-process, tiny model, a pool small enough to evict) captured by the hook
    must pass every check: the audit's rules hold for what vLLM actually does, not only for fixtures."""
    trace, _ = family_capture
    r = audit_capture(trace)
    assert summary(r) == []
    assert r.verdict["retention_pressure"]["qualified"] is True
    from kmesh_trace.trace import open_trace

    kinds = dict(open_trace(trace).sql("select event, count(*) from block_events group by 1").iter_rows())
    assert kinds.get("touched", 0) > 0 and kinds.get("evicted", 0) > 0  # the checks had something to check


def test_summary_line_groups_codes():
    from kmesh_trace.audit.findings import Problem, summary

    ps = [Problem("missing_field", "blocking", 1, "x"), Problem("missing_field", "blocking", 3, "y"),
          Problem("empty_table", "blocking", 1, "z"), Problem("duplicate_resident_hash", "warning", 1, "w")]
    assert summary(ps) == "3 blocking problems: missing_field (x2), empty_table"
    assert summary(ps[3:]) == "nothing blocking (1 warning)"
    assert summary([]) == "nothing blocking"


def test_unknown_event_kind(tmp_path):
    r = audit_capture(write_trace(tmp_path / "t", events=_edit(clean_events(), 16, event="dropped")))
    assert summary(r) == [("invalid_value", "blocking", 1, ["block_events.event='dropped'"])]


def test_lineage_not_exact_prefix_and_dangling(tmp_path):
    lin = clean_lineage()
    lin[1]["num_shared_tokens"] = 9
    lin.append({**lin[0], "child_request_id": "r9"})
    r = audit_capture(write_trace(tmp_path / "t", lineage=lin))
    assert summary(r) == [("lineage_not_exact_prefix", "blocking", 1, ["lineage:e0:r1<-r0"]),
                          ("lineage_dangling", "blocking", 1, ["lineage:e0:r9<-r0"])]
    assert r.verdict["headroom"]["qualified"] is True
    assert r.verdict["retention_pressure"]["blocked_by"] == ["lineage_dangling", "lineage_not_exact_prefix"]
