"""The Perfetto export: exact slices, counters, instants and transfer lanes from a trace built in code,
validated against the trace-event format; the validator itself; the `export perfetto` command."""

from __future__ import annotations

import gzip
import json
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kmesh_trace.apps.perfetto import PHASES, _lanes, build_trace_events, export_perfetto, validate_trace_events
from kmesh_trace.trace import open_trace
from kmesh_trace.writer import TraceWriter

B = 5_000_000_000  # an arbitrary monotonic clock reading
T0 = B - 1000  # the earliest time in the fixture: a block event, not a request


def _us(ns: int) -> float:
    return (ns - T0) / 1000


# request_id, seq, family, parent, arrival, first_scheduled, first_token, finish, status
REQUESTS = [
    ("r0", 0, "A", None, B, B + 1000, B + 501_500, B + 2_000_000, "finished"),
    ("r1", 1, "A", "r0", B + 2_100_000, B + 2_100_000, B + 2_300_000, B + 3_000_000, "finished"),
    ("r2", 2, None, None, B + 500, B + 1_000_000, B + 1_200_000, B + 1_900_000, "length_capped"),
    ("r3", 3, None, None, B + 3_500_000, None, None, None, None),  # never scheduled: no slice
    ("r4", 4, "B", None, B + 100, B + 200, None, B + 900, "aborted"),  # aborted in prefill: queued only
    ("r5", 5, "B", None, B + 10, B + 5000, B + 4000, B + 6000, "finished"),  # first token before scheduling
]

# The slices the export must draw: (request, phase, ts_us, dur_us). r5's prefill ends before it
# starts and its decode would overlap its queued slice: both are skipped, not invented.
EXPECTED_SLICES = {
    ("r0", "queued", _us(B), 1.0), ("r0", "prefill", _us(B + 1000), 500.5), ("r0", "decode", _us(B + 501_500), 1498.5),
    ("r1", "queued", _us(B + 2_100_000), 0.0), ("r1", "prefill", _us(B + 2_100_000), 200.0),
    ("r1", "decode", _us(B + 2_300_000), 700.0),
    ("r2", "queued", _us(B + 500), 999.5), ("r2", "prefill", _us(B + 1_000_000), 200.0),
    ("r2", "decode", _us(B + 1_200_000), 700.0),
    ("r4", "queued", _us(B + 100), 0.1),
    ("r5", "queued", _us(B + 10), 4.99),
}

# seq, ts_ns, event, block_id, block_hash, num_free_blocks
BLOCK_EVENTS = [
    (0, B - 1000, "allocated", 1, None, 9),
    (1, B - 1000, "allocated", 2, None, 8),  # same instant: one sample, the last value
    (2, B + 10, "touched", 2, 7, 8),  # unchanged: no sample
    (3, B + 20, "held", 1, None, 8),
    (4, B + 20, "held", 2, None, 8),
    (5, B + 30, "released", 1, None, 8),
    (6, B + 40, "evicted", 3, 2**64 - 1, 7),
    (7, B + 50, "freed", 1, None, None),
    (8, B + 60, "cleared", None, None, 10),
]

# request_id, direction, start, finish, status
TRANSFERS = [
    ("r1", "load", B + 2_000_000, B + 2_100_000, "ok"),
    ("r2", "load", B + 2_050_000, B + 2_150_000, "ok"),  # overlaps r1's load: second lane
    ("r0", "store", B + 2_000_000, B + 2_010_000, "ok"),
    ("r3", "load", B + 3_600_000, None, "incomplete"),  # never finished: skipped
]


def _write(root, engine_id="e0", shift=0, metadata=None):
    with TraceWriter(root, engine_id, metadata={"block_size": 32, "num_usable_blocks": 10, **(metadata or {})}) as w:
        cols = ["request_id", "seq", "family_id", "parent_id", "arrival_ns", "first_scheduled_ns", "first_token_ns",
                "finish_ns", "status"]
        rows = [dict(zip(cols, r)) for r in REQUESTS]
        for r in rows:
            for c in ("arrival_ns", "first_scheduled_ns", "first_token_ns", "finish_ns"):
                r[c] = None if r[c] is None else r[c] + shift
        w.write("invocations", {
            **{c: [r[c] for r in rows] for c in cols},
            "num_prompt_tokens": [64] * len(rows),
            "num_output_tokens": [8] * len(rows),
            "num_cached_tokens": [0, 64, 32, None, 0, 0],
        })
        w.write("block_events", {
            "seq": [e[0] for e in BLOCK_EVENTS], "ts_ns": [e[1] + shift for e in BLOCK_EVENTS],
            "event": [e[2] for e in BLOCK_EVENTS], "block_id": [e[3] for e in BLOCK_EVENTS],
            "block_hash": [e[4] for e in BLOCK_EVENTS], "num_free_blocks": [e[5] for e in BLOCK_EVENTS],
        })
        w.write("transfers", {
            "request_id": [t[0] for t in TRANSFERS], "direction": [t[1] for t in TRANSFERS],
            "start_ns": [t[2] + shift for t in TRANSFERS], "finish_ns": [None if t[3] is None else t[3] + shift for t in TRANSFERS],
            "status": [t[4] for t in TRANSFERS], "connector": ["ExampleConnector"] * len(TRANSFERS),
            "num_tokens": [64] * len(TRANSFERS),
        })


@pytest.fixture
def trace(tmp_path):
    _write(tmp_path / "t")
    return open_trace(tmp_path / "t")


def _names(events):
    """(pid, tid) -> thread name and pid -> process name, from the metadata events."""
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    procs = {e["pid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    return procs, threads


def _request_slices(events):
    procs, threads = _names(events)
    return {(e["args"]["request_id"], e["name"], e["ts"], e["dur"]) for e in events
            if e["ph"] == "X" and e["name"] in {p for p, _, _ in PHASES}}


def test_request_slices_match_invocations_exactly(trace):
    events = build_trace_events(trace)
    assert validate_trace_events({"traceEvents": events}) == []
    got = _request_slices(events)
    assert len(got) == len([e for e in events if e["ph"] == "X" and e["name"] in ("queued", "prefill", "decode")])
    assert got == EXPECTED_SLICES
    # And straight from the invocations table: every drawn slice is a pair of its columns.
    inv = {r["request_id"]: r for r in trace.frame("invocations").iter_rows(named=True)}
    for rid, phase, ts, dur in got:
        _, start_col, end_col = next(p for p in PHASES if p[0] == phase)
        assert ts == (inv[rid][start_col] - T0) / 1000
        assert dur == (inv[rid][end_col] - inv[rid][start_col]) / 1000


def test_families_become_processes_and_requests_threads(trace):
    events = build_trace_events(trace)
    procs, threads = _names(events)
    assert sorted(procs.values()) == ["KV pool", "family A", "family B", "unrelated"]
    by_name = {v: k for k, v in procs.items()}
    sort_index = {e["pid"]: e["args"]["sort_index"] for e in events if e.get("name") == "process_sort_index"}
    # The pool first, then families in order of their first request, unrelated requests last.
    assert sorted(procs.values(), key=lambda n: sort_index[by_name[n]]) == ["KV pool", "family A", "family B", "unrelated"]
    request_threads = {name: pid for (pid, _), name in threads.items() if pid != by_name["KV pool"]}
    assert request_threads == {"r0": by_name["family A"], "r1 (parent r0)": by_name["family A"], "r2": by_name["unrelated"],
                               "r3": by_name["unrelated"], "r4": by_name["family B"], "r5": by_name["family B"]}
    decode_r1 = next(e for e in events if e["ph"] == "X" and e["name"] == "decode" and e["args"]["request_id"] == "r1")
    assert decode_r1["args"] == {"request_id": "r1", "family_id": "A", "parent_id": "r0", "status": "finished",
                                 "num_prompt_tokens": 64, "num_cached_tokens": 64, "num_output_tokens": 8,
                                 "parent_request_id": "r0"}


def test_lineage_edges_are_flow_arrows_from_parent_end_to_child_arrival(trace):
    events = build_trace_events(trace)
    _, threads = _names(events)
    flows = [e for e in events if e["ph"] in ("s", "f")]
    start, finish = flows  # the one edge, r0 -> r1
    assert start["id"] == finish["id"] and start["cat"] == finish["cat"] == "lineage"
    assert threads[(start["pid"], start["tid"])] == "r0" and threads[(finish["pid"], finish["tid"])] == "r1 (parent r0)"
    # It leaves from just inside r0's decode (its finish) so it binds to it, and lands at r1's arrival.
    assert start["ts"] == pytest.approx(_us(B + 2_000_000) - 0.001) and finish["ts"] == _us(B + 2_100_000)
    assert finish["bp"] == "e" and start["args"] == {"parent_request_id": "r0", "child_request_id": "r1"}


def test_pool_counters_instants_and_transfer_lanes(trace):
    events = build_trace_events(trace)
    procs, threads = _names(events)
    counters = [(e["name"], e["ts"], e["args"]["blocks"]) for e in events if e["ph"] == "C"]
    assert counters == [
        ("free", 0.0, 8), ("free", _us(B + 40), 7), ("free", _us(B + 60), 10),
        ("held", _us(B + 20), 2), ("held", _us(B + 30), 1),
    ]
    instants = [(e["name"], e["ts"], e["args"]) for e in events if e["ph"] == "i"]
    assert instants == [
        ("evicted", _us(B + 40), {"block_id": 3, "block_hash": "ffffffffffffffff"}),
        ("prefix cache cleared", _us(B + 60), {}),
    ]
    transfers = sorted((threads[(e["pid"], e["tid"])], e["name"], e["ts"], e["dur"]) for e in events
                       if e["ph"] == "X" and e["name"].split()[0] in ("load", "store"))
    assert transfers == [
        ("load transfers", "load r1", _us(B + 2_000_000), 100.0),
        ("load transfers (2)", "load r2", _us(B + 2_050_000), 100.0),
        ("store transfers", "store r0", _us(B + 2_000_000), 10.0),
    ]


def test_transfer_lanes_are_fewest_and_never_overlap():
    assert _lanes([(0, 10), (1, 5), (2, 3), (3, 4), (5, 20), (10, 11), (11, 12)]) == [0, 1, 2, 2, 1, 0, 0]
    assert _lanes([(0, 10), (4, 4), (4, 4), (4, 6)]) == [0, 1, 1, 1]  # zero-length transfers share a lane
    rng = random.Random(7)
    for _ in range(200):
        iv = sorted((s, s + rng.randrange(1, 20)) for s in (rng.randrange(0, 50) for _ in range(rng.randrange(1, 30))))
        lanes = _lanes(iv)
        for i, (s1, e1) in enumerate(iv):
            for j in range(i):
                assert lanes[i] != lanes[j] or iv[j][1] <= s1  # same lane: the earlier one ends before the next starts
        depth = max(sum(1 for s, e in iv if s <= t < e) for t in range(80))
        assert len(set(lanes)) == max(depth, 1)


def test_export_file_streams_valid_json_and_summary(trace, tmp_path):
    summary = export_perfetto(trace, tmp_path / "t.json")
    obj = json.loads((tmp_path / "t.json").read_text())
    assert validate_trace_events(obj) == []
    assert obj["displayTimeUnit"] == "ns"
    assert obj["otherData"]["t0_ns"] == T0
    assert obj["traceEvents"] == build_trace_events(trace)
    assert {k: v for k, v in summary.items() if k not in ("path", "num_bytes")} == {
        "num_events": len(obj["traceEvents"]), "engines": ["e0"], "clock": "monotonic",
        "num_requests": 6, "num_request_slices": 11, "num_skipped_slices": 2, "num_families": 2,
        "num_free_block_samples": 3, "num_held_block_samples": 2, "num_evictions": 1, "num_clears": 1,
        "num_transfers": 3, "num_skipped_transfers": 1, "num_lineage_flows": 1,
    }
    export_perfetto(trace, tmp_path / "t.json.gz")
    with gzip.open(tmp_path / "t.json.gz", "rt") as f:
        assert json.load(f) == obj


def test_two_engines_are_separate_groups_on_one_wall_clock(tmp_path):
    # Engine e1's monotonic clock reads 7 s more than e0's at the same wall instant, and its
    # requests ran 7 s later on its own clock: on the wall clock they coincide.
    _write(tmp_path / "t", "e0", metadata={"wall_anchor_ns": 10**18, "mono_anchor_ns": 0})
    _write(tmp_path / "t", "e1", shift=7 * 10**9, metadata={"wall_anchor_ns": 10**18, "mono_anchor_ns": 7 * 10**9})
    trace = open_trace(tmp_path / "t")
    events = build_trace_events(trace)
    assert validate_trace_events(events) == []
    procs, _ = _names(events)
    assert sorted(procs.values()) == sorted(f"engine {e}: {n}" for e in ("e0", "e1")
                                            for n in ("KV pool", "family A", "family B", "unrelated"))
    by_engine = {}
    for e in events:
        if e["ph"] == "X" and e["name"] in ("queued", "prefill", "decode"):
            engine = procs[e["pid"]].split(":")[0].removeprefix("engine ")
            by_engine.setdefault(engine, set()).add((e["args"]["request_id"], e["name"], e["ts"], e["dur"]))
    assert by_engine["e0"] == by_engine["e1"] == EXPECTED_SLICES


def test_empty_trace_exports_only_the_pool(tmp_path):
    TraceWriter(tmp_path / "t", "e0").close()
    events = build_trace_events(open_trace(tmp_path / "t"))
    assert validate_trace_events(events) == []
    assert [(e["ph"], e["name"]) for e in events] == [("M", "process_name"), ("M", "process_sort_index")]


@pytest.mark.parametrize("events, problem", [
    ([{"name": "a", "ph": "X", "ts": 0, "pid": 1, "tid": 1}], "needs a non-negative numeric dur"),
    ([{"name": "a", "ph": "X", "ts": 0, "dur": -1, "pid": 1, "tid": 1}], "needs a non-negative numeric dur"),
    ([{"name": "a", "ph": "X", "ts": 0, "dur": 1, "pid": 1}], "has no integer tid"),
    ([{"ph": "X", "ts": 0, "dur": 1, "pid": 1, "tid": 1}], "has no name"),
    ([{"name": "a", "ph": "X", "dur": 1, "pid": 1, "tid": 1}], "has no finite numeric ts"),
    ([{"name": "a", "ph": "Q", "ts": 0, "pid": 1, "tid": 1}], "unknown phase 'Q'"),
    ([{"name": "a", "ph": "B", "ts": 0, "pid": 1, "tid": 1}], "begins (B) but never ends (E)"),
    ([{"ph": "E", "ts": 0, "pid": 1, "tid": 1}], "ends a slice that never began"),
    ([{"name": "a", "ph": "X", "ts": 5, "dur": 1, "pid": 1, "tid": 1},
      {"name": "b", "ph": "X", "ts": 4, "dur": 0, "pid": 1, "tid": 1}], "goes back in time"),
    ([{"name": "a", "ph": "X", "ts": 0, "dur": 5, "pid": 1, "tid": 1},
      {"name": "b", "ph": "X", "ts": 3, "dur": 5, "pid": 1, "tid": 1}], "overlaps the slice before it"),
    ([{"name": "c", "ph": "C", "ts": 0, "pid": 1, "args": {"n": "x"}}], "needs args with numeric values"),
    ([{"name": "c", "ph": "C", "ts": 2, "pid": 1, "args": {"n": 1}},
      {"name": "c", "ph": "C", "ts": 1, "pid": 1, "args": {"n": 2}}], "goes back in time"),
    ([{"name": "thread_name", "ph": "M", "pid": 1, "args": {"name": "x"}}], "has no integer tid"),
    ([{"name": "process_sort_index", "ph": "M", "pid": 1, "args": {}}], "has no args.sort_index"),
    ([{"name": "e", "ph": "i", "s": "x", "ts": 0, "pid": 1, "tid": 1}], "instant scope 'x'"),
])
def test_validator_reports_each_broken_rule(events, problem):
    problems = validate_trace_events({"traceEvents": events})
    assert len(problems) == 1 and problem in problems[0], problems


def test_validator_accepts_nesting_balanced_pairs_and_other_tracks():
    events = [
        {"name": "outer", "ph": "X", "ts": 0, "dur": 10, "pid": 1, "tid": 1},
        {"name": "inner", "ph": "X", "ts": 2, "dur": 8, "pid": 1, "tid": 1},  # ends with its parent: nested
        {"name": "next", "ph": "X", "ts": 10, "dur": 1, "pid": 1, "tid": 1},  # starts as the parent ends
        {"name": "other", "ph": "X", "ts": 1, "dur": 1, "pid": 1, "tid": 2},  # another track may start earlier
        {"name": "b", "ph": "B", "ts": 0, "pid": 2, "tid": 1}, {"ph": "E", "ts": 1, "pid": 2, "tid": 1},
        # 0.1 + 0.2 > 0.3 in floats, yet these touch exactly in nanoseconds, as viewers compare them.
        {"name": "q", "ph": "X", "ts": 0.1, "dur": 0.2, "pid": 3, "tid": 1},
        {"name": "p", "ph": "X", "ts": 0.3, "dur": 1, "pid": 3, "tid": 1},
    ]
    assert validate_trace_events(events) == []
    assert validate_trace_events({"events": []}) == ["the JSON object has no traceEvents list"]
    assert validate_trace_events({"traceEvents": [], "displayTimeUnit": "s"}) == ["displayTimeUnit is 's'; it must be 'ms' or 'ns'"]


_JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=3),
                     lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3), inner, max_size=3),
                     max_leaves=8)
_EVENT = st.fixed_dictionaries({}, optional={
    "name": _JSON | st.sampled_from(["thread_name", "process_sort_index"]), "ph": _JSON | st.sampled_from(list("XBEiCM")),
    "ts": _JSON, "dur": _JSON, "pid": _JSON | st.integers(0, 2), "tid": _JSON | st.integers(0, 2), "args": _JSON, "s": _JSON,
})


@settings(max_examples=300, deadline=None)
@given(st.lists(_EVENT | _JSON, max_size=6))
def test_validator_never_raises_on_malformed_input(events):
    assert isinstance(validate_trace_events({"traceEvents": events}), list)


def test_cli_export_perfetto(trace, tmp_path, cli):
    res = cli(["export", "perfetto", str(trace.path), "--out", str(tmp_path / "x.json"), "--json"])
    assert res.exit_code == 0, res.output
    summary = json.loads(res.stdout)
    assert summary["num_request_slices"] == 11 and summary["path"] == str(tmp_path / "x.json")
    assert validate_trace_events(json.loads((tmp_path / "x.json").read_text())) == []

    res = cli(["export", "perfetto", str(trace.path), "--out", str(tmp_path / "y.json")])
    assert res.exit_code == 0
    assert "request slices (queued, prefill, decode)" in res.stdout and "ui.perfetto.dev" in res.stderr

    res = cli(["export", "perfetto", str(tmp_path / "missing"), "--out", str(tmp_path / "z.json")])
    assert res.exit_code == 1
    assert res.stderr.startswith("Error: ") and len(res.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "z.json").exists()

    res = cli(["export", "perfetto", str(trace.path), "--out", str(tmp_path / "no" / "z.json")])
    assert res.exit_code == 1
    assert res.stderr == f"Error: cannot write {tmp_path / 'no' / 'z.json'}: the directory {tmp_path / 'no'} does not exist; create it first.\n"


@pytest.mark.engine
def test_real_capture_exports_a_valid_timeline(tmp_path, family_capture):
    """A tiny real vLLM engine, captured: every request's three phases, every eviction, the pool counter."""
    trace_dir, outs = family_capture
    trace = open_trace(trace_dir)
    summary = export_perfetto(trace, tmp_path / "t.json")
    obj = json.loads((tmp_path / "t.json").read_text())
    assert validate_trace_events(obj) == []
    t0 = obj["otherData"]["t0_ns"]
    assert t0 == trace.sql("SELECT least((SELECT min(ts_ns) FROM block_events), (SELECT min(arrival_ns) FROM invocations)) t")["t"][0]
    expected = {(r["request_id"], phase, (r[s] - t0) / 1000, (r[e] - r[s]) / 1000)
                for r in trace.frame("invocations").iter_rows(named=True) for phase, s, e in PHASES}
    assert len(expected) == 3 * len(outs) and _request_slices(obj["traceEvents"]) == expected
    procs, threads = _names(obj["traceEvents"])
    assert sorted(procs.values()) == ["KV pool", "family fam", "unrelated"]
    num_evicted = trace.sql("SELECT count(*) n FROM block_events WHERE event = 'evicted'")["n"][0]
    assert num_evicted > 0 and summary["num_evictions"] == num_evicted
    assert len([e for e in obj["traceEvents"] if e["ph"] == "i" and e["name"] == "evicted"]) == num_evicted
    last_free = trace.sql("SELECT num_free_blocks FROM block_events WHERE num_free_blocks IS NOT NULL ORDER BY seq DESC LIMIT 1")
    assert [e for e in obj["traceEvents"] if e["ph"] == "C" and e["name"] == "free"][-1]["args"]["blocks"] == last_free[0, 0]
