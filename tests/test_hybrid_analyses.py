"""Analyses on a hybrid engine's trace (engine metadata `kv_cache_groups`): headroom at given capacities
replays the hybrid pool (vllm) and the prefix positions at the full-attention share (bounds); the curve
scales the one-pass curves to the pool; fleet routes to hybrid engines; pressure and tiers refuse it in
one sentence."""

from __future__ import annotations

import json

import pytest

from kmesh_trace.kv_groups import KVCacheGroup
from kmesh_trace.oracle.policies import replay_point
from kmesh_trace.oracle.hybrid_pool import pool_block_bytes, position_capacity, simulate_hybrid_pool
from kmesh_trace.oracle.policies import POLICIES
from kmesh_trace.oracle.workload import Workload
from kmesh_trace.trace import open_trace

from hybrid_traces import BS, GROUPS, write_hybrid


def test_workload_carries_the_groups_and_vllm_replays_the_hybrid_pool(tmp_path):
    with open_trace(write_hybrid(tmp_path / "t")) as t:
        w = Workload.from_trace(t)
    assert w.groups == GROUPS and w.hybrid
    res = POLICIES["vllm"].simulate(w, 40)
    ref = simulate_hybrid_pool(list(w.requests), GROUPS, num_usable_blocks=40, timed=False)
    assert res.hit_blocks_per_request.tolist() == ref.hit_blocks
    plain = Workload(BS, w.requests)  # the same requests on one full-attention group of 40 blocks
    assert POLICIES["vllm"].simulate(plain, 40).hit_blocks != res.hit_blocks
    # A bound replays the prefix positions at one block per full-attention group (here: all 40).
    assert replay_point(w, "belady", 40).hit_blocks == POLICIES["belady"].simulate(plain, 40).hit_blocks
    assert replay_point(w, "belady", 40).hit_blocks >= res.hit_blocks


@pytest.mark.parametrize("stated,retention", [(None, 0), (0, 0), (-1, None), (32, 32)])
def test_the_retention_interval_comes_from_the_metadata(tmp_path, stated, retention):
    extra = {} if stated is None else {"prefix_cache_retention_interval": stated}
    with open_trace(write_hybrid(tmp_path / "t", **extra)) as t:
        w = Workload.from_trace(t)
    assert w.retention_interval == retention
    ref = simulate_hybrid_pool(list(w.requests), GROUPS, num_usable_blocks=40, timed=False,
                               retention_interval=retention)
    assert POLICIES["vllm"].simulate(w, 40).hit_blocks_per_request.tolist() == ref.hit_blocks


def test_headroom_runs_on_a_hybrid_trace(tmp_path, cli):
    write_hybrid(tmp_path / "t")
    r = cli(["headroom", tmp_path / "t", "--capacity-blocks", "40", "--policies", "vllm,belady", "--json"])
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    with open_trace(tmp_path / "t") as t:
        w = Workload.from_trace(t)
    ref = simulate_hybrid_pool(list(w.requests), GROUPS, num_usable_blocks=40, timed=False)
    vllm = next(x for x in d["results"] if x["policy"] == "vllm")
    assert vllm["hit_tokens"] == ref.total_hit_tokens > 0
    assert d["headroom_tokens"] == vllm["prefill_tokens"] - next(
        x for x in d["results"] if x["policy"] == "belady")["prefill_tokens"]
    assert "hybrid engine (sliding_window(48) + full_attention)" in r.stderr


def test_two_full_attention_groups_halve_the_bound_positions():
    groups = (KVCacheGroup("full_attention", BS), KVCacheGroup("full_attention", BS, 3, 4096),
              KVCacheGroup("sliding_window", BS, sliding_window=64))
    assert position_capacity(groups, 41) == 20
    assert pool_block_bytes(GROUPS) == 4096 and pool_block_bytes(groups) is None


@pytest.mark.parametrize("args,word", [
    (["pressure", "{t}"], "pressure"),
    (["tiers", "{t}", "--host", "100"], "tiers"),
])
def test_what_cannot_honour_the_groups_refuses(tmp_path, cli, args, word):
    write_hybrid(tmp_path / "t")
    r = cli([a.replace("{t}", str(tmp_path / "t")) for a in args])
    assert r.exit_code == 1, r.output
    assert "sliding_window(48) + full_attention" in r.output and word in r.output
    assert r.output.count("Error:") == 1


def test_capacity_in_bytes_converts_through_the_page_sizes(tmp_path, cli):
    write_hybrid(tmp_path / "t")  # a pool block: 2 layers x 2,048-byte pages = 4,096 bytes
    a = cli(["headroom", tmp_path / "t", "--capacity", "160KiB", "--policies", "vllm", "--json"])
    b = cli(["headroom", tmp_path / "t", "--capacity-blocks", "40", "--policies", "vllm", "--json"])
    assert a.exit_code == b.exit_code == 0, a.output
    assert json.loads(a.stdout)["results"] == json.loads(b.stdout)["results"]


@pytest.mark.parametrize("timed", [False, True])
def test_fleet_routes_to_hybrid_engines(tmp_path, cli, timed):
    """Round-robin sends request k to engine k mod 2: each engine is the hybrid pool over its requests; the
    global pool is one hybrid pool of both engines' blocks."""
    from kmesh_trace.oracle.fleet import simulate_run

    write_hybrid(tmp_path / "t")
    with open_trace(tmp_path / "t") as t:
        w = Workload.from_trace(t)
    if timed:
        for k, r in enumerate(w.requests):
            r.arrival_ns, r.finish_ns = 10 * k, 10 * k + 25
        w.derived.clear()
    assert w.timed == timed
    reqs = list(w.requests)
    rr = simulate_run(w, "round-robin", 2, 30)
    per_engine = [simulate_hybrid_pool(reqs[e::2], GROUPS, num_usable_blocks=30, timed=timed) for e in (0, 1)]
    assert rr.hit_tokens == sum(p.total_hit_tokens for p in per_engine) > 0
    assert rr.num_evictions == sum(p.total_evictions for p in per_engine)
    glob = simulate_run(w, "global", 2, 30)
    assert glob.hit_tokens == simulate_hybrid_pool(reqs, GROUPS, num_usable_blocks=60, timed=timed).total_hit_tokens
    prefix = simulate_run(w, "prefix-aware", 2, 30)
    assert prefix.hit_tokens >= rr.hit_tokens
    r = cli(["fleet", tmp_path / "t", "--engines", "2", "--capacity-blocks", "30", "--json"])
    assert r.exit_code == 0, r.output


def test_the_curve_on_a_hybrid_trace(tmp_path, cli):
    """Two full-attention groups and a window: the exact curves step at twice their position capacities;
    the vllm curve is the hybrid pool at each grid capacity."""
    groups = (KVCacheGroup("full_attention", BS, 1, 2048), KVCacheGroup("sliding_window", BS, 1, 2048,
                                                                        sliding_window=40),
              KVCacheGroup("full_attention", BS, 1, 4096))
    write_hybrid(tmp_path / "t", groups=groups, usable=60)
    r = cli(["headroom", tmp_path / "t", "--json"])
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    with open_trace(tmp_path / "t") as t:
        w = Workload.from_trace(t)
    assert d["curves"]["belady"]["exact"] and d["curves"]["belady"]["capacities"][:3] == [0, 2, 4]
    for row in d["grid"]:
        cap = row["capacity_blocks"]
        ref = simulate_hybrid_pool(list(w.requests), groups, num_usable_blocks=cap, timed=False)
        assert row["vllm"]["hit_blocks"] == ref.total_hit_blocks
        bound = POLICIES["belady"].simulate(w, cap // 2).hit_blocks if cap >= 2 else 0
        assert row["belady"]["hit_blocks"] == row["belady-prefix"]["hit_blocks"] == bound  # a narrow bracket here
    assert [row["vllm"]["hit_blocks"] for row in d["grid"]][-2:] == [54, 58]
    assert "capacity / 2" in r.stderr


def test_the_report_on_a_hybrid_trace(tmp_path, cli):
    """The page's headroom runs on the hybrid pool; its pressure and tiers sections say why they cannot."""
    write_hybrid(tmp_path / "t")
    r = cli(["report", tmp_path / "t", "--out", tmp_path / "page.html", "--json"])
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    with open_trace(tmp_path / "t") as t:
        w = Workload.from_trace(t)
    stock = simulate_hybrid_pool(list(w.requests), GROUPS, num_usable_blocks=40, timed=False)
    assert d["headroom"]["stock"]["hit_tokens"] == stock.total_hit_tokens  # the vllm curve at the engine's pool
    for section in ("pressure", "tiers"):
        assert d[section] == {"unavailable": f"{section} models one full-attention KV cache group and this engine has "
                                             "sliding_window(48) + full_attention; on a hybrid trace, headroom and "
                                             "fleet run."}


def test_capacity_in_bytes_needs_the_page_sizes(tmp_path, cli):
    write_hybrid(tmp_path / "t", groups=(KVCacheGroup("full_attention", BS), KVCacheGroup("sliding_window", BS,
                                                                                          sliding_window=48)))
    r = cli(["headroom", tmp_path / "t", "--capacity", "1MiB", "--policies", "vllm"])
    assert r.exit_code == 1
    assert r.output == ("Error: --capacity is given in bytes, but the engine's KV cache groups do not state their "
                        "page sizes and layers; give blocks.\n")
