"""The retention-pressure what-if and the `pressure` command, on hold-stress and a fork-tree trace."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from kmesh_trace.cli import app
from kmesh_trace.datasets.workloads.fork_tree import write_fork_tree
from kmesh_trace.datasets.workloads.hold_stress import hold_stress
from kmesh_trace.errors import KmeshTraceError
from kmesh_trace.oracle.pressure import infer_exact_prefix_edges, sweep, what_if

runner = CliRunner()
S = 1_000_000_000


def stress(timed: bool = False):
    rb = hold_stress().request_blocks()
    if timed:  # one request every 10 s, each running 1 s
        for i, r in enumerate(rb):
            r.arrival_ns, r.finish_ns = i * 10 * S, i * 10 * S + S
    return rb


def test_hold_stress_tradeoff_json_shape():
    d = what_if(stress(), block_size=16, num_usable_blocks=128).to_dict()
    assert d["arms"] == {
        "stock": {"child_hit_tokens": 48, "other_hit_tokens": 1984, "hit_tokens": 2032, "prefill_tokens": 3040,
                  "evictions": 62, "num_not_admitted": 0, "num_stalled": 0, "num_deferred": 0},
        "held": {"child_hit_tokens": 512, "other_hit_tokens": 128, "hit_tokens": 640, "prefill_tokens": 4432,
                 "evictions": 149, "num_not_admitted": 0, "num_stalled": 0, "num_deferred": 0},
    }
    assert (d["saved_child_tokens"], d["displaced_hit_tokens"], d["net_cached_tokens"]) == (464, 1856, -1392)
    assert (d["num_holds"], d["unused_holds"], d["refused_holds"], d["held_block_steps"]) == (1, 0, 0, 288)
    assert d["held_block_seconds"] is None
    assert (d["num_families"], d["num_parents"]) == (1, 1)
    assert d["holds"] == [{
        "parent_index": 0, "parent_request_id": "parent", "family": "hold-stress", "num_children": 1,
        "hold_status": "taken", "num_held_blocks": 32, "release_reason": "children", "num_children_served": 1,
        "child_hit_tokens_stock": 48, "child_hit_tokens_held": 512, "saved_child_tokens": 464}]


def test_inferred_edges_equal_declared_on_hold_stress():
    rb = stress()
    assert infer_exact_prefix_edges(rb, 16) == {9: 0}  # the second pass repeats, it does not extend
    for r in rb:
        r.parent_index = None
    assert what_if(rb, block_size=16, num_usable_blocks=128, edges="inferred").net_cached_tokens == -1392
    with pytest.raises(KmeshTraceError, match="no declared parent-child edges"):
        what_if(rb, block_size=16, num_usable_blocks=128)


def test_expiry_and_seconds_on_a_timed_stream():
    res = what_if(stress(timed=True), block_size=16, num_usable_blocks=128)
    assert res.held.held_block_seconds == 32 * 89.0  # taken at 1 s, released at the child's arrival, 90 s
    res = what_if(stress(timed=True), block_size=16, num_usable_blocks=128, expiry_s=45)
    # Expired at the 50 s boundary, after the first pass was already squeezed: a pure loss.
    assert [h.release_reason for h in res.held.holds] == ["expiry"]
    assert (res.saved_child_tokens, res.displaced_hit_tokens, res.num_unused_holds) == (0, 1856, 1)
    assert (res.held.held_block_steps, res.held.held_block_seconds) == (4 * 32, 32 * 49.0)


def test_caps_refuse_the_hold():
    for kw in (dict(max_held_blocks=31), dict(max_families=0)):
        res = what_if(stress(), block_size=16, num_usable_blocks=128, **kw)
        assert (res.num_refused_holds, res.net_cached_tokens) == (1, 0)


def test_sweep_points():
    pts = sweep(stress(), block_size=16, capacities=[64, 128, 160])
    assert [(p.capacity_blocks, p.saved_child_tokens, p.displaced_hit_tokens, p.net_cached_tokens) for p in pts] == [
        (64, 512, 0, 512), (128, 464, 1856, -1392), (160, 0, 0, 0)]


def test_cli_scenario_json():
    r = runner.invoke(app, ["pressure", "--scenario", "hold-stress", "--json"])
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    assert (d["block_size"], d["capacity_blocks"], d["net_cached_tokens"]) == (16, 128, -1392)
    r = runner.invoke(app, ["pressure", "--scenario", "hold-stress-x2", "--json"])
    d = json.loads(r.stdout)
    assert (d["block_size"], d["saved_child_tokens"], d["net_cached_tokens"]) == (32, 928, -2784)


def test_cli_per_request_rows():
    r = runner.invoke(app, ["pressure", "--scenario", "hold-stress", "--per-request", "--json"])
    rows = json.loads(r.stdout)["requests"]
    assert [(q["request_id"], q["role"], q["hit_tokens_held"], q["evictions_held"]) for q in rows[8:]] == [
        ("other3-pass2", "other", 32, 29), ("child", "child", 512, 4)]


def test_cli_human_output():
    r = runner.invoke(app, ["pressure", "--scenario", "hold-stress"])
    assert r.exit_code == 0, r.output
    assert "saved_child_tokens 464  displaced_hit_tokens 1,856  net_cached_tokens -1,392" in r.stdout
    assert "holds 1  unused 0  refused 0  held_block_steps 288" in r.stdout


def test_cli_sweep_json_and_plot(tmp_path):
    png = tmp_path / "net.png"
    r = runner.invoke(app, ["pressure", "--scenario", "hold-stress", "--capacity-blocks", "64,128", "--plot", str(png),
                            "--json"])
    assert r.exit_code == 0, r.output
    assert [p["net_cached_tokens"] for p in json.loads(r.stdout)["sweep"]] == [512, -1392]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("args, message", [
    (["--scenario", "hold-stress", "--plot", "x.png"], "--plot draws a capacity sweep"),
    (["--scenario", "hold-stress", "--capacity-blocks", "1,x"], "comma-separated integers"),
    (["--scenario", "hold-stress", "--expiry-s", "5"], "needs arrival and finish times"),
    ([], "give either a TRACE directory or --scenario"),
])
def test_cli_errors_are_one_line(args, message):
    r = runner.invoke(app, ["pressure", *args])
    assert r.exit_code == 1
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: ") and message in lines[0]


def test_cli_on_a_trace_declared_and_inferred(tmp_path):
    trace = write_fork_tree(tmp_path / "fork")
    for edges in ("declared", "inferred"):
        r = runner.invoke(app, ["pressure", str(trace), "--edges", edges, "--capacity-blocks", "300", "--json"])
        assert r.exit_code == 0, r.output
        d = json.loads(r.stdout)
        # 300 blocks: the parent's 256 cached blocks survive each child's 33 new ones in both arms.
        assert (d["num_children"], d["arms"]["stock"]["child_hit_tokens"], d["net_cached_tokens"]) == (5, 5 * 4096, 0)
        assert d["held_block_seconds"] == pytest.approx(256 * 0.05)  # parent done at 10 ms, last child in at 60 ms


def test_inferred_parent_is_the_longest_prefix_chain():
    from kmesh_trace.oracle.stream import RequestBlocks

    def r(i, hashes, tokens):
        return RequestBlocks(i, f"r{i}", tokens, 1, hashes)

    reqs = [r(0, [1, 2], 9), r(1, [1, 2, 3], 13), r(2, [1, 2, 3, 4], 16), r(3, [1, 2, 3, 4], 16), r(4, [1, 2, 9], 12),
            r(5, [1, 2], 8)]
    # r2 extends r1 (longest), r3 repeats r2 (not an edge) and extends r1, r4 extends only r0; r5 is
    # r0's prompt again, with no room for a tail.
    assert infer_exact_prefix_edges(reqs, 4) == {1: 0, 2: 1, 3: 1, 4: 0}


def test_what_if_trace_uses_the_trace_geometry(tmp_path):
    from kmesh_trace.oracle.pressure import what_if_trace

    trace = write_fork_tree(tmp_path / "fork", num_usable_blocks=289)
    res = what_if_trace(trace)
    assert (res.block_size, res.capacity_blocks, res.request_ids[0], res.stock.timed) == (16, 289, "parent", True)
    # 289 blocks fit one child (4,615 computed tokens). Each child from the second on evicts the
    # previous child's 32 tail blocks (freed tail first, the LRU end) and never the ancestor, which
    # every child touches: the hold changes nothing here.
    assert res.stock.hit_tokens == res.held.hit_tokens == [0] + [4096] * 5
    assert res.stock.num_evictions == res.held.num_evictions == [0, 0, 32, 32, 32, 32]
    # 288 blocks: each child's prompt (288 blocks) fits, its output does not: vLLM admits it on the
    # prompt, then preempts it for good (stalled).
    small = what_if_trace(trace, capacity_blocks=288).stock
    assert small.admitted == [True] * 6 and small.stalled == [False] + [True] * 5


def test_inferred_edges_come_from_the_traces_exact_prefix_rows(tmp_path):
    from kmesh_trace.datasets.workloads.fork_tree import BLOCK_SIZE, fork_tree_rows
    from kmesh_trace.oracle.pressure import what_if_trace
    from kmesh_trace.writer import TraceWriter

    rows = fork_tree_rows()
    lineage = [
        {"child_request_id": "child-0", "parent_request_id": "parent", "edge_kind": "exact_prefix"},
        {"child_request_id": "child-3", "parent_request_id": "parent", "edge_kind": "exact_prefix"},
        {"child_request_id": "child-1", "parent_request_id": "parent", "edge_kind": "declared"},  # not used
    ]
    with TraceWriter(tmp_path / "t", "e0", {"block_size": BLOCK_SIZE, "num_usable_blocks": 600}) as w:
        w.write("invocations", {k: [r[k] for r in rows] for k in rows[0]})
        w.write("lineage", {k: [r.get(k) for r in lineage] for k in
                            ("child_request_id", "parent_request_id", "declared_parent_id", "family_id", "edge_kind",
                             "num_shared_tokens")})
    res = what_if_trace(tmp_path / "t", edges="inferred")
    assert (res.edge_source, res.child_indices) == ("lineage", [1, 4])
    assert what_if_trace(tmp_path / "t").edge_source == "declared"


def test_cli_capacity_in_bytes_is_the_same_what_if_as_in_blocks(cli, tmp_path):
    """--capacity on pressure as on headroom: 4.8MB at 1,000 KV bytes per token and 16-token
    blocks is 300 blocks; a sweep in bytes is the sweep in blocks."""
    trace = write_fork_tree(tmp_path / "t")
    for blocks, size in (("300", "4.8MB"), ("150,300", "2.4MB,4.8MB")):
        want = cli(["pressure", trace, "--capacity-blocks", blocks, "--json"])
        assert want.exit_code == 0, want.stderr
        got = cli(["pressure", trace, "--capacity", size, "--kv-bytes-per-token", "1000", "--json"])
        assert (got.exit_code, got.stdout) == (0, want.stdout), got.stderr
    r = cli(["pressure", trace, "--capacity", "300", "--capacity-blocks", "300"])
    assert (r.exit_code, r.stderr.strip()) == (1, "Error: give the capacities once: --capacity or --capacity-blocks.")
