"""The fleet what-if: routing policies on hand-built workloads with known answers, the step-wise pool
replay against simulate_pool, the global pool as the reference, the CLI and its errors."""

from __future__ import annotations

import functools
import json
import random

import pytest

from fleet_workloads import BLOCK_SIZE, random_rows, req, workload, write_fleet_trace
from kmesh_trace.errors import KmeshTraceError
from kmesh_trace.oracle.blockpool import PoolReplay, simulate_pool
from kmesh_trace.oracle.fleet import GLOBAL, ROUTINGS, route, simulate_run
from kmesh_trace.oracle.fleet import sweep as fleet_sweep
from kmesh_trace.oracle.stream import requests_from_rows
from kmesh_trace.parts import open_parts
from kmesh_trace.trace import open_trace
from kmesh_trace.oracle.workload import Workload

fleet_workload = functools.partial(Workload.from_trace, merged=True)  # every partition, as the fleet reads it


# ---- the step-wise replay ---------------------------------------------------------------------


@pytest.mark.parametrize("timed", [True, False])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_feeding_one_request_at_a_time_gives_simulate_pool_exactly(seed, timed):
    reqs = requests_from_rows(random_rows(seed, timed=timed), BLOCK_SIZE)
    for capacity in (6, 12, 40):
        whole = simulate_pool(reqs, block_size=BLOCK_SIZE, num_usable_blocks=capacity)
        step = PoolReplay([], BLOCK_SIZE, capacity, None, timed)
        for r in reqs:
            if timed:  # what a router does before choosing: it changes nothing feed would not do
                step.advance(r.arrival_ns)
            step.feed(r)
        assert step.close() == whole
        assert whole.timed is timed and whole.total_hit_blocks > 0


def test_cached_prefix_blocks_is_what_the_next_lookup_hits():
    rep = PoolReplay([], BLOCK_SIZE, 16)
    rep.feed(req(0, [1, 2, 3]))
    assert [rep.cached_prefix_blocks(req(1, h)) for h in ([1, 2, 3, 4], [1, 2, 9], [5, 2], [1, 2, 3])] == [3, 2, 0, 3]
    rep.feed(req(1, [1, 2, 9]))
    assert rep.close().hit_blocks == [0, 2]


# ---- routing policies, known answers ------------------------------------------------------------


def test_round_robin_deals_requests_in_turn():
    w = workload([req(i, [100 + i]) for i in range(7)])
    assert route(w, "round-robin", 3, 8).engine_of == [0, 1, 2, 0, 1, 2, 0]


def test_least_loaded_counts_running_requests_when_timed():
    # r0 runs long on engine 0; r1 finishes at 2, so at 3 engine 1 is idle again; at 4 both run one.
    w = workload([req(0, [1], arrival=0, finish=100), req(1, [2], arrival=1, finish=2),
                  req(2, [3], arrival=3, finish=10), req(3, [4], arrival=4, finish=10)])
    assert route(w, "least-loaded", 2, 8).engine_of == [0, 1, 1, 0]
    # Untimed, load is the requests routed so far: the same deal as round-robin.
    untimed = workload([req(i, [i]) for i in range(5)])
    assert route(untimed, "least-loaded", 2, 8).engine_of == [0, 1, 0, 1, 0]


def test_family_affinity_follows_the_family_and_places_new_ones_least_loaded():
    fams = ["A", "B", "A", "C", "B", "A"]
    w = workload([req(i, [10 * i + 1], family=f) for i, f in enumerate(fams)])
    assert route(w, "family", 3, 8).engine_of == [0, 1, 0, 2, 1, 0]
    # No family ids: the root of the declared parent chain (2's parent is 1, whose parent is 0).
    w = workload([req(0, [1]), req(1, [2], parent=0), req(2, [3], parent=1), req(3, [4]), req(4, [5], parent=3)])
    assert route(w, "family", 2, 8).engine_of == [0, 0, 0, 1, 1]
    assert w.families("auto")[1] == "declared"


def test_family_affinity_on_inferred_exact_prefix_edges():
    # Nothing declared: 1 extends 0's whole prompt, 3 extends 1's; 2 starts a new chain.
    w = workload([req(0, [1, 2]), req(1, [1, 2, 3]), req(2, [7, 8]), req(3, [1, 2, 3, 4])])
    keys, source = w.families("auto")
    assert source == "inferred" and keys[0] == keys[1] == keys[3] != keys[2]
    assert route(w, "family", 2, 8).engine_of == [0, 0, 1, 0]


def test_prefix_aware_picks_the_longest_cached_prefix_within_the_load_bound():
    w = workload([req(0, [1, 2]), req(1, [1, 2]), req(2, [1, 2, 3]), req(3, [1, 2, 3, 4]), req(4, [1, 2, 3, 4, 5])])
    # 0-2 stay with engine 0 (it holds their prefix); at 3 engine 0 has 3 requests > 1.0 x 1.5 + 1, so
    # 3 goes to engine 1, which then holds [1, 2, 3, 4]; 4 goes there too: 4 cached blocks beat 3.
    assert route(w, "prefix-aware", 2, 16, overload=1.0).engine_of == [0, 0, 0, 1, 1]
    # Without a prefix anywhere it is least-loaded; ties go to the lowest index.
    w = workload([req(i, [50 + i]) for i in range(4)])
    assert route(w, "prefix-aware", 3, 16).engine_of == [0, 1, 2, 0]


# ---- the global pool as the reference -----------------------------------------------------------


def test_one_engine_is_the_global_pool_and_simulate_pool():
    reqs = requests_from_rows(random_rows(3), BLOCK_SIZE)
    w = workload(reqs)
    ref = simulate_pool(reqs, block_size=BLOCK_SIZE, num_usable_blocks=10)
    for policy in (*ROUTINGS, GLOBAL):
        run = simulate_run(w, policy, 1, 10)
        assert (run.hit_blocks, run.prefill_tokens, run.num_evictions) == (
            ref.total_hit_blocks, ref.prefill_tokens, ref.total_evictions), policy


@pytest.mark.parametrize("seed", range(6))
def test_a_global_pool_that_never_evicts_is_ahead_of_every_routing(seed):
    # With N x C at least every block of the workload, the global pool never evicts, so its hits are
    # every repeated prefix: no routing over smaller pools can hit more. (Short of that, nothing
    # guarantees it: splitting an LRU-like pool can keep blocks a shared one drops.)
    reqs = requests_from_rows(random_rows(seed, timed=seed % 2 == 0), BLOCK_SIZE)
    w = workload(reqs)
    num_engines = random.Random(seed).randint(2, 5)
    distinct = len({h for r in reqs for h in r.prompt_hashes}) + sum(r.num_output_tokens for r in reqs)
    capacity = -(-distinct // num_engines)
    g = simulate_run(w, GLOBAL, num_engines, capacity)
    assert g.num_evictions == 0
    for policy in ROUTINGS:
        assert g.hit_tokens >= simulate_run(w, policy, num_engines, capacity).hit_tokens, policy


def test_a_sweep_shares_global_pools_and_reports_the_gap():
    w = workload(requests_from_rows(random_rows(4, timed=False), BLOCK_SIZE))
    res = fleet_sweep(w, [2, 4], [6, 12], ["round-robin", "prefix-aware"], overload=1.25, edges="auto")
    assert [(p.num_engines, p.capacity_blocks) for p in res.points] == [(2, 6), (2, 12), (4, 6), (4, 12)]
    p = res.points[1]
    assert [r.policy for r in p.runs] == ["round-robin", "prefix-aware", GLOBAL]
    # 2 x 12 and 4 x 6 are the same global pool.
    assert res.points[1].global_run.hit_tokens == res.points[2].global_run.hit_tokens
    rr, pa, g = p.runs
    assert p.gap_tokens(g) == 0 and p.gap_tokens(rr) == rr.prefill_tokens - g.prefill_tokens
    assert p.gap_closed(rr) == 0.0 and p.gap_closed(g) == 1.0
    assert rr.load_imbalance == 1.0 and g.load_imbalance is None
    assert sum(rr.num_requests_per_engine) == res.num_requests == 60


# ---- traces, the CLI and errors -----------------------------------------------------------------


def test_fleet_workload_merges_every_partition_in_arrival_order(tmp_path):
    trace = write_fleet_trace(tmp_path / "t", num_engines=3)
    merged = fleet_workload(open_trace(trace))
    assert merged.num_partitions == 3 and merged.timed and merged.num_usable_blocks == 24
    assert [r.request_id for r in merged.requests] == [r["request_id"] for r in sorted(
        random_rows(0), key=lambda r: (r["arrival_ns"], f"e{int(r['request_id'][1:]) % 3}"))]
    # Read through a pyarrow filesystem URL: the same workload.
    assert fleet_workload(open_parts(f"file://{trace}")).requests == merged.requests


def test_cli_fleet_json_out_and_plot(cli, tmp_path):
    trace = write_fleet_trace(tmp_path / "t")
    r = cli(["fleet", trace, "--engines", "2,3", "--capacity-blocks", "8,16", "--routing", "round-robin,family",
             "--json", "--out", tmp_path / "f.json", "--plot", tmp_path / "f.svg"])
    assert r.exit_code == 0 and r.stdout == "", r.stderr  # --out: the file, nothing on stdout
    d = json.loads((tmp_path / "f.json").read_text())
    assert (d["num_requests"], d["timed"], d["load"], d["family_source"]) == (60, True, "running requests", "declared")
    assert [(p["num_engines"], p["capacity_blocks"], [x["policy"] for x in p["runs"]]) for p in d["points"]] == [
        (n, c, ["round-robin", "family", "global"]) for n in (2, 3) for c in (8, 16)]
    w = fleet_workload(open_trace(trace))
    assert d["points"][3]["runs"][1]["hit_tokens"] == simulate_run(w, "family", 3, 16).hit_tokens
    assert (tmp_path / "f.svg").read_text().lstrip().startswith("<?xml")
    # Defaults: the trace's partitions and usable blocks; a table for humans.
    r = cli(["fleet", trace, "--routing", "prefix-aware"])
    assert r.exit_code == 0, r.stderr
    assert "prefix-aware" in r.stdout and "global" in r.stdout


@pytest.mark.parametrize("args, message", [
    (["--routing", "random"], "unknown routing 'random'; the routings are round-robin, least-loaded, family, prefix-aware."),
    (["--engines", "0"], "--engines must be comma-separated integers above zero, e.g. 256,512,1024 (got '0')."),
    (["--overload", "0.5"], "--overload must be at least 1 (a multiple of the mean load); got 0.5."),
    (["--edges", "inferred", "--plot", "f.txt"], "cannot plot to f.txt: give a .png or .svg file."),
])
def test_cli_fleet_errors(cli, tmp_path, args, message):
    trace = write_fleet_trace(tmp_path / "t")
    r = cli(["fleet", trace, *args])
    assert r.exit_code == 1
    assert r.stderr.strip() == f"Error: {message}"


def test_errors_of_the_model():
    w = workload([req(0, [1])])
    with pytest.raises(KmeshTraceError, match="unknown routing 'nearest'"):
        route(w, "nearest", 2, 8)
    with pytest.raises(KmeshTraceError, match="--capacity-blocks must be positive"):
        simulate_run(w, GLOBAL, 2, 0)
    with pytest.raises(KmeshTraceError, match="unknown edge mode 'guessed'"):
        route(w, "family", 2, 8, edges="guessed")


def test_cli_fleet_refuses_a_trace_without_usable_blocks_unless_given(cli, tmp_path):
    from kmesh_trace.writer import TraceWriter

    with TraceWriter(tmp_path / "t", "e0", {"block_size": BLOCK_SIZE}) as w:
        w.write("invocations", {"request_id": ["a"], "seq": [0], "num_prompt_tokens": [9],
                                "prompt_block_hashes": [[1, 2, 3]]})
    r = cli(["fleet", tmp_path / "t"])
    assert r.exit_code == 1 and "pass --capacity-blocks N" in r.stderr
    r = cli(["fleet", tmp_path / "t", "--capacity-blocks", "4", "--json"])
    assert r.exit_code == 0, r.stderr
    assert json.loads(r.stdout)["num_requests"] == 1
    with TraceWriter(tmp_path / "t", "e1", {"block_size": BLOCK_SIZE, "num_usable_blocks": 8}) as w:
        w.write("invocations", {"request_id": ["b"], "seq": [0], "num_prompt_tokens": [9],
                                "prompt_block_hashes": [[1, 2, 3]]})
    r = cli(["fleet", tmp_path / "t"])
    assert r.exit_code == 1
    assert r.stderr.strip() == ("Error: the trace's engines have different pools (8, None usable blocks); "
                                "pass --capacity-blocks N.")


def test_a_worker_reads_a_trace_once_until_its_parts_change(tmp_path):
    from kmesh_trace.oracle.tasks import load_at
    from kmesh_trace.writer import TraceWriter

    trace = write_fleet_trace(tmp_path / "t", num_engines=2)
    first = load_at(str(trace), None, "fleet", fleet_workload)
    assert load_at(str(trace), None, "fleet", fleet_workload) is first
    with TraceWriter(trace, "e1", {"block_size": BLOCK_SIZE, "num_usable_blocks": 24}) as w:
        w.write("invocations", {"request_id": ["late"], "seq": [30], "num_prompt_tokens": [9],
                                "prompt_block_hashes": [[1, 2, 3]], "arrival_ns": [10**6], "finish_ns": [10**6 + 1]})
    again = load_at(str(trace), None, "fleet", fleet_workload)
    assert again is not first and len(again.requests) == len(first.requests) + 1
    assert again.requests[-1].request_id == "late"


def test_reading_parts_by_location_gives_clear_errors(tmp_path):
    from kmesh_trace.errors import TraceNotFoundError

    with pytest.raises(TraceNotFoundError, match=r"is not a kmesh-trace trace \(no kmesh_trace.json\)"):
        open_parts(str(tmp_path))
    with pytest.raises(KmeshTraceError, match=r"cannot open foo://bar/x: .*give a trace directory or a pyarrow "
                                              r"filesystem URL"):
        open_parts("foo://bar/x")
    trace = write_fleet_trace(tmp_path / "t", num_engines=2)
    with pytest.raises(KmeshTraceError, match=r"has no engine 'e9'; its engines are e0, e1\."):
        open_parts(str(trace), ["e9"])
    one = open_parts(str(trace), ["e1"])
    assert list(one.engines) == ["e1"] and [p.split("/")[-2] for p in one.parts("invocations")] == ["engine=e1"]
    assert one.scan("invocations").collect()["request_id"].to_list() == [f"q{i}" for i in range(1, 60, 2)]
    assert one.scan("lineage").collect().height == 0


def test_cli_capacity_in_bytes_is_the_same_fleet_as_in_blocks(cli, tmp_path):
    """--capacity on fleet (per engine): 4.8MB at 1,000 KV bytes per token and 16-token blocks
    is 300 blocks."""
    from kmesh_trace.datasets.workloads.fork_tree import write_fork_tree

    trace = str(write_fork_tree(tmp_path / "t"))
    want = cli(["fleet", trace, "--engines", "2", "--capacity-blocks", "150,300", "--json"])
    assert want.exit_code == 0, want.stderr
    got = cli(["fleet", trace, "--engines", "2", "--capacity", "2.4MB,4.8MB", "--kv-bytes-per-token", "1000", "--json"])
    assert (got.exit_code, got.stdout) == (0, want.stdout), got.stderr
    r = cli(["fleet", trace, "--capacity", "300", "--capacity-blocks", "300"])
    assert (r.exit_code, r.stderr.strip()) == (1, "Error: give the capacities once: --capacity or --capacity-blocks.")
