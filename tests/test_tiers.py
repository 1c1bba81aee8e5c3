"""The tier simulation (`kmesh_trace.oracle.tiers`) and `kmesh-trace tiers`: exact small cases, the GPU-only
identity with the `vllm` model, monotonicity in lower-tier capacity, costs read from a real replay result,
the family-burst arms, and the replay journal it writes."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from kmesh_trace.cli import app
from kmesh_trace.datasets.workloads.family_burst import family_burst
from kmesh_trace.datasets.workloads.hold_stress import hold_stress
from kmesh_trace.oracle.policies import POLICIES, Workload
from kmesh_trace.oracle.stream import RequestBlocks, token_block_hashes
from kmesh_trace.oracle.tier_costs import kv_bytes_from_config, parse_capacity, restore_costs_from_results
from kmesh_trace.oracle.tiers import RestoreCost, TierConfig, TierSpec, family_burst_arms, simulate_tiers, sweep_tiers

H200 = Path(__file__).resolve().parents[1] / "benchmarks" / "results" / "replay-h200-2026-11-29"
runner = CliRunner()


def family_workload(seed: int, bs: int = 4, timed: bool = False, num_families: int = 6) -> list[RequestBlocks]:
    """Random families (a parent, 1-4 children = parent prompt + output + a private tail) among competitors."""
    rng = random.Random(seed)
    rows = []  # (prompt, output, parent position or None)
    for _ in range(num_families):
        prompt = [rng.randrange(1 << 20) for _ in range(bs * rng.randint(1, 6) + rng.randint(0, bs - 1))]
        out = [rng.randrange(1 << 20) for _ in range(rng.randint(1, 2 * bs))]
        p = len(rows)
        rows.append((prompt, out, None))
        for _ in range(rng.randint(0, 3)):
            rows.append(([rng.randrange(1 << 20) for _ in range(rng.randint(1, 3 * bs))], [1], -1))
        for _ in range(rng.randint(1, 4)):
            rows.append((prompt + out + [rng.randrange(1 << 20) for _ in range(rng.randint(1, 2 * bs))],
                         [rng.randrange(1 << 20) for _ in range(rng.randint(1, bs))], p))
    reqs, t = [], 0
    for i, (prompt, out, parent) in enumerate(rows):
        ph, oh = token_block_hashes(prompt, out, bs)
        t += rng.randint(0, 3) * 1_000_000
        reqs.append(RequestBlocks(index=i, request_id=str(i), num_prompt_tokens=len(prompt), num_output_tokens=len(out),
                                  prompt_hashes=ph, output_hashes=oh, parent_index=parent if parent and parent >= 0 else None,
                                  prompt_token_ids=prompt, output_token_ids=out,
                                  arrival_ns=t if timed else None,
                                  finish_ns=t + rng.randint(1, 6) * 1_000_000 if timed else None))
    return reqs


def chain(n: int, bs: int = 4, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1 << 20) for _ in range(n * bs)]


def req(i: int, prompt: list[int], bs: int = 4, out: int = 1, **kw) -> RequestBlocks:
    ph, oh = token_block_hashes(prompt, [7] * out, bs)
    return RequestBlocks(index=i, request_id=str(i), num_prompt_tokens=len(prompt), num_output_tokens=out,
                         prompt_hashes=ph, output_hashes=oh, **kw)


# ---- the GPU tier is the vllm model --------------------------------------------------------------


@pytest.mark.parametrize("timed", [False, True])
@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("cap", [6, 12, 40])
def test_gpu_only_equals_vllm_row(seed, cap, timed):
    reqs = family_workload(seed, timed=timed)
    ref = POLICIES["vllm"].simulate(Workload(4, reqs), cap)
    res = simulate_tiers(reqs, TierConfig(cap), block_size=4)
    assert res.hit_tokens == ref.hit_tokens
    assert res.hit_tokens_per_request.tolist() == ref.hit_tokens_per_request.tolist()
    assert res.recomputed_tokens == ref.prefill_tokens


def test_gpu_only_equals_vllm_row_hold_stress():
    sc = hold_stress(1)
    reqs = sc.request_blocks()
    ref = POLICIES["vllm"].simulate(Workload(sc.block_size, reqs), sc.num_usable_blocks)
    assert simulate_tiers(reqs, TierConfig(sc.num_usable_blocks), block_size=sc.block_size).hit_tokens == ref.hit_tokens


def test_lower_tiers_leave_the_gpu_pool_unchanged():
    reqs = family_workload(3, timed=True)
    alone = simulate_tiers(reqs, TierConfig(8), block_size=4)
    tiered = simulate_tiers(reqs, TierConfig(8, (TierSpec("host", 16), TierSpec("ssd", 64, write="write-through"))),
                            block_size=4)
    assert tiered.pool.free_queue == alone.pool.free_queue
    assert tiered.pool.num_evictions == alone.pool.num_evictions


# ---- exact small cases -------------------------------------------------------------------------


def test_on_evict_host_serves_an_evicted_prefix():
    # GPU of 3 blocks: A (2 full blocks + 1 token) fills it; B (3 blocks) evicts A's blocks into the host;
    # A again hits both of its blocks in the host tier (the last prompt token is always computed).
    a, b = chain(2, seed=1) + [5], chain(3, seed=2)
    reqs = [req(0, a, out=1), req(1, b, out=1), req(2, a, out=1)]
    res = simulate_tiers(reqs, TierConfig(3, (TierSpec("host", 8),)), block_size=4, kv_bytes_per_token=10)
    assert res.hit_blocks_by_tier["gpu"].tolist() == [0, 0, 0]
    assert res.hit_blocks_by_tier["host"].tolist() == [0, 0, 2]
    assert res.num_chunk_reads == {"host": 2} and res.read_bytes == {"host": 80}
    assert res.read_amplification == 1.0
    res0 = simulate_tiers(reqs, TierConfig(3), block_size=4)
    assert res0.hit_tokens == 0


def test_read_once_drops_the_chunk_after_a_load():
    a, b = chain(2, seed=1) + [5], chain(3, seed=2)
    reqs = [req(0, a), req(1, b), req(2, a), req(3, b), req(4, a)]
    keep = simulate_tiers(reqs, TierConfig(3, (TierSpec("host", 8),)), block_size=4)
    once = simulate_tiers(reqs, TierConfig(3, (TierSpec("host", 8, retain=False),)), block_size=4)
    # A and B alternate through a 3-block GPU: each load finds the blocks the GPU evicted just before.
    assert keep.hit_blocks_by_tier["host"].tolist() == once.hit_blocks_by_tier["host"].tolist() == [0, 0, 2, 2, 2]
    # Retained, the 5 distinct blocks are stored once; read-once drops each loaded block (2 + 2) so the
    # GPU's next eviction of it stores it again.
    assert keep.num_stores == {"host": 5} and once.num_stores == {"host": 9}
    # Request 2's load of A leaves A out of a read-once tier only.
    one = simulate_tiers(reqs[:3], TierConfig(3, (TierSpec("host", 8, retain=False),)), block_size=4)
    assert one.num_stores == {"host": 5}


def test_a_block_counts_only_while_its_prefix_is_available():
    # The host holds blocks 2 and 3 of a chain but not block 1: nothing is usable.
    p = chain(4, seed=3)
    r = req(0, p + [1])
    res = simulate_tiers([r], TierConfig(8, (TierSpec("host", 8),)), block_size=4,
                         preload={"host": r.prompt_hashes[1:4]})
    assert res.hit_tokens == 0
    res = simulate_tiers([r], TierConfig(8, (TierSpec("host", 8),)), block_size=4,
                         preload={"host": r.prompt_hashes[0:2]})
    assert res.hit_blocks_by_tier["host"].tolist() == [2]


def test_chunks_read_whole_and_amplify():
    # 2-block chunks, write-through: a 3-block prefix needs chunk 0 whole and chunk 1 for its first block.
    # A chunk is found only when the prompt holds all its blocks (its key is its last block's hash).
    p = chain(4, seed=4)
    first, again = req(0, p + [1]), req(1, p)  # 16 tokens: 4 full blocks, at most 3 usable
    res = simulate_tiers([first, again], TierConfig(8, (TierSpec("ssd", 16, chunk_blocks=2, write="write-through"),),
                                                    lookup="gpu-prefix"),
                         block_size=4, kv_bytes_per_token=1, timed=False)
    # The GPU still holds the blocks (gpu-prefix: GPU hits first), so nothing is read.
    assert res.hit_blocks_by_tier["gpu"].tolist() == [0, 3]
    tiny_gpu = [first, req(1, chain(5, seed=5)), again]
    res = simulate_tiers(tiny_gpu, TierConfig(5, (TierSpec("ssd", 16, chunk_blocks=2, write="write-through"),)),
                         block_size=4, kv_bytes_per_token=1)
    assert res.hit_blocks_by_tier["ssd"].tolist() == [0, 0, 3]
    assert res.num_chunk_reads["ssd"] == 2 and res.read_bytes["ssd"] == 16
    assert res.read_amplification == pytest.approx(16 / 12)


def test_on_evict_needs_one_block_chunks():
    with pytest.raises(Exception, match="one-block chunks"):
        simulate_tiers([], TierConfig(4, (TierSpec("host", 8, chunk_blocks=2),)), block_size=4)


# ---- monotonicity ------------------------------------------------------------------------------


# Sequential replays only: in a timed replay a restored block is unusable until its read completes, so a
# larger tier that restores a block a concurrent request would otherwise find recomputed in the pool can
# lose that hit (test_timed_replays_can_lose_hits_to_in_flight_restores).


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 10_000), gpu=st.integers(4, 30), small=st.integers(0, 40), extra=st.integers(1, 40),
       which=st.sampled_from(["host", "ssd", "both"]))
def test_more_write_through_capacity_never_lowers_hits(seed, gpu, small, extra, which):
    timed = False
    reqs = family_workload(seed, timed=timed)

    def run(c):
        tiers = []
        if which in ("host", "both"):
            tiers.append(TierSpec("host", c, write="write-through"))
        if which in ("ssd", "both"):
            tiers.append(TierSpec("ssd", 2 * c, write="write-through"))
        return simulate_tiers(reqs, TierConfig(gpu, tuple(tiers)), block_size=4, timed=timed).hit_tokens

    assert run(small + extra) >= run(small)


@settings(max_examples=100, deadline=None)
@given(seed=st.integers(0, 10_000), gpu=st.integers(4, 30), small=st.integers(0, 40), extra=st.integers(1, 40))
def test_more_on_evict_capacity_never_lowers_hits(seed, gpu, small, extra):
    timed = False
    reqs = family_workload(seed, timed=timed)

    def run(c):
        return simulate_tiers(reqs, TierConfig(gpu, (TierSpec("host", c),)), block_size=4, timed=timed).hit_tokens

    assert run(small + extra) >= run(small)


def test_timed_replays_can_lose_hits_to_in_flight_restores():
    reqs = family_workload(32, timed=True, num_families=10)
    hits = [simulate_tiers(reqs, TierConfig(10, (TierSpec("host", c),)), block_size=4).hit_tokens for c in (0, 3)]
    assert hits == [468, 464]
    assert simulate_tiers(reqs, TierConfig(10, (TierSpec("host", 3),), singleflight=True), block_size=4).hit_tokens >= 468


# ---- timing: singleflight and early preparation ------------------------------------------------


def test_family_burst_arms():
    fb = family_burst()
    arms = {a["arm"]: a for a in family_burst_arms(fb, costs={"ssd": RestoreCost(1.0), "host": RestoreCost(50.0)})}
    mib48 = 48 * 2**20
    assert (arms["baseline"]["num_lower_tier_reads"], arms["baseline"]["lower_tier_read_bytes"]) == (80, 5 * mib48)
    assert (arms["singleflight"]["num_lower_tier_reads"], arms["singleflight"]["lower_tier_read_bytes"]) == (16, mib48)
    assert arms["singleflight"]["num_shared_reads"] == 64
    assert arms["retention"]["num_reads_by_tier"] == {"host": 80, "ssd": 0}
    # Reads on one tier queue: the fifth child's ancestor arrives after five 48 MiB reads at 1 GB/s.
    assert arms["baseline"]["restore_wait_max_s"] == pytest.approx(5 * mib48 / 1e9, rel=1e-6)
    assert arms["singleflight"]["restore_wait_max_s"] == pytest.approx(mib48 / 1e9, rel=1e-6)


def test_early_preparation_reads_the_ancestor_once_ahead_of_the_children():
    bs = 4
    anc = chain(4, seed=6)
    parent = req(0, anc + [1], out=1, arrival_ns=0, finish_ns=10)
    other = req(1, chain(15, seed=7) + [2], out=1, arrival_ns=20, finish_ns=30)  # fills the 16-block GPU
    kids = [req(2 + k, anc + [1, 50 + k], out=1, parent_index=0, arrival_ns=10_000_000_000,
                finish_ns=10_000_000_100) for k in range(3)]
    reqs = [parent, other] + kids
    costs = {"ssd": RestoreCost(1.0)}
    tiers = (TierSpec("ssd", 64),)
    kw = dict(block_size=bs, kv_bytes_per_token=1000, costs=costs)
    plain = simulate_tiers(reqs, TierConfig(16, tiers), **kw)
    at_finish = simulate_tiers(reqs, TierConfig(16, tiers, early_prep=True), **kw)
    ahead = simulate_tiers(reqs, TierConfig(16, tiers, early_prep=True, prep_lead_s=1.0), **kw)
    # Plain: each child reads the 4 ancestor blocks itself (the others' restores are still in flight).
    assert plain.hit_blocks_by_tier["ssd"].tolist() == [0, 0, 4, 4, 4]
    assert plain.num_chunk_reads["ssd"] == 12 and plain.restore_wait_s[2] == pytest.approx(16e-6)
    # At the parent's finish the ancestor is still in the GPU: nothing to prepare, nothing changes.
    assert at_finish.num_chunk_reads == plain.num_chunk_reads
    # One second ahead of the children: 4 reads, done before they arrive, shared by all three.
    assert ahead.hit_tokens == plain.hit_tokens
    assert ahead.num_chunk_reads["ssd"] == 4 and all(r.prepare for r in ahead.reads)
    assert ahead.restore_wait_s.tolist() == [0.0] * 5


# ---- costs -------------------------------------------------------------------------------------


def test_restore_costs_from_the_h200_results():
    import numpy as np
    import pyarrow.parquet as pq

    t = pq.read_table(H200 / "restores.parquet").to_pylist()

    def rates(route):
        return np.array([r["num_bytes"] / r["timer1_ns"] for r in t
                         if r["route"] == route and r["kind"] == "measured" and r["accepted"]])

    costs, notes = restore_costs_from_results(H200)
    ssd = costs["ssd"]
    assert ssd.source.endswith("host_fixed")  # the most direct route measured there (cufile was unavailable)
    assert len(rates("host_fixed")) == 100
    assert ssd.gbps == pytest.approx(np.percentile(rates("host_fixed"), 50))
    assert ssd.gbps_p95 == pytest.approx(np.percentile(rates("host_fixed"), 5))
    # Every restore there moved 48 MiB, so the median rate is 48 MiB over summary.json's p50 time.
    assert ssd.gbps == pytest.approx(50331648 / 28.949642e-3 / 1e9, rel=1e-3)
    assert costs["host"].gbps == pytest.approx(50331648 / 1.0210559964179993e-3 / 1e9)
    host_costs, _ = restore_costs_from_results(H200, "host")
    assert host_costs["ssd"].gbps == pytest.approx(np.percentile(rates("host"), 50))
    with pytest.raises(Exception, match="no measured route 'cufile'"):
        restore_costs_from_results(H200, "cufile")


def test_restore_costs_without_per_restore_samples(tmp_path):
    import shutil

    shutil.copy(H200 / "summary.json", tmp_path / "summary.json")
    costs, _ = restore_costs_from_results(tmp_path)
    assert costs["ssd"].gbps == pytest.approx(50331648 / 28.949642e-3 / 1e9)
    assert costs["ssd"].gbps_p95 == pytest.approx(50331648 / 32.217364999999994e-3 / 1e9)
    assert "host" not in costs  # no bench.json: the host tier's copy was not measured


def test_kv_bytes_from_a_model_config(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"num_hidden_layers": 2, "num_attention_heads": 2,
                                                      "num_key_value_heads": 1, "head_dim": 32, "hidden_size": 64,
                                                      "torch_dtype": "bfloat16"}))
    assert kv_bytes_from_config(tmp_path) == 2 * 2 * 1 * 32 * 2
    assert parse_capacity("512", None, "--host") == 512
    assert parse_capacity("1MiB", 4096, "--host") == 256
    with pytest.raises(Exception, match="bytes per token are unknown"):
        parse_capacity("1GiB", None, "--host")


def test_read_bytes_past_int64_are_one_error_not_a_wrapped_count():
    """KV bytes per token at which the most the tiers could read passes int64 are refused before the replay,
    whose byte counters are int64 (before: a negative lower_tier_read_bytes, exit 0)."""
    from kmesh_trace.errors import KmeshTraceError
    from kmesh_trace.oracle.stream import RequestBlocks

    reqs = [RequestBlocks(i, f"r{i}", 16 * 65_536, 0, list(range(65_536))) for i in range(8)]
    config = TierConfig(4, (TierSpec("host", 1 << 20),))
    with pytest.raises(KmeshTraceError, match=r"^the blocks the tiers could read \(8,388,736 tokens at "
                                              r"1,099,511,627,776 KV bytes per token\) come to "):
        simulate_tiers(reqs, config, block_size=16, kv_bytes_per_token=1 << 40)
    ok = simulate_tiers(reqs[:1], config, block_size=16, kv_bytes_per_token=1 << 40)
    assert ok.kv_bytes_per_token == 1 << 40


# ---- the command -------------------------------------------------------------------------------


def test_cli_family_burst_json():
    r = runner.invoke(app, ["tiers", "--scenario", "family-burst", "--ssd-gbps", "1.5", "--json"])
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    assert [a["arm"] for a in d["arms"]] == ["baseline", "singleflight", "retention"]
    assert [a["num_lower_tier_reads"] for a in d["arms"]] == [80, 16, 80]
    assert [a["lower_tier_read_bytes"] for a in d["arms"]] == [240 * 2**20, 48 * 2**20, 240 * 2**20]
    r = runner.invoke(app, ["tiers", "--scenario", "family-burst", "--children", "3", "--chunks", "8", "--json"])
    assert [a["num_lower_tier_reads"] for a in json.loads(r.stdout)["arms"]] == [24, 8, 24]


def test_cli_errors():
    r = runner.invoke(app, ["tiers"])
    assert r.exit_code == 1 and "Error: give either a TRACE" in r.output
    r = runner.invoke(app, ["tiers", "--scenario", "family-burst", "--restore-results", "/nonexistent"])
    assert r.exit_code == 1 and "no summary.json" in r.output


def test_sweep_picks_the_smallest_near_best():
    reqs = family_workload(11, timed=True)
    sw = sweep_tiers(reqs, TierConfig(6), [0, 8, 64], [0, 32], block_size=4, within_pct=0.0)
    g = sw.grid()
    assert g[0, 0] == simulate_tiers(reqs, TierConfig(6), block_size=4).hit_tokens
    a, b = sw.smallest_within()
    assert g[a, b] == g.max()
    assert all(sw.host_blocks[x] + sw.ssd_blocks[y] >= sw.host_blocks[a] + sw.ssd_blocks[b]
               for x in range(3) for y in range(2) if g[x, y] == g.max())


def test_cli_trace_equals_headroom_and_writes_a_journal(cli, tmp_path):
    from kmesh_trace.native.store import open_store
    from kmesh_trace.writer import TraceWriter

    reqs = family_workload(5, timed=True, num_families=12)
    with TraceWriter(tmp_path / "t", "e0", {"block_size": 4, "num_usable_blocks": 64}) as w:
        w.write("invocations", {
            "request_id": [r.request_id for r in reqs], "seq": list(range(len(reqs))),
            "parent_id": [None if r.parent_index is None else str(r.parent_index) for r in reqs],
            "num_prompt_tokens": [r.num_prompt_tokens for r in reqs],
            "num_output_tokens": [r.num_output_tokens for r in reqs],
            "prompt_token_ids": [r.prompt_token_ids for r in reqs], "output_token_ids": [r.output_token_ids for r in reqs],
            "arrival_ns": [r.arrival_ns for r in reqs], "finish_ns": [r.finish_ns for r in reqs]})
    for cap in ("8", "12", "64"):
        h = json.loads(cli(["headroom", tmp_path / "t", "--policies", "vllm", "--capacity-blocks", cap, "--json"]).stdout)
        r = cli(["tiers", tmp_path / "t", "--gpu-blocks", cap, "--json"])
        assert r.exit_code == 0, r.output
        gpu_only = json.loads(r.stdout)["configurations"][0]
        assert gpu_only["hit_tokens"] == h["results"][0]["hit_tokens"]
        assert gpu_only["recomputed_tokens"] == h["results"][0]["prefill_tokens"]
    r = cli(["tiers", tmp_path / "t", "--gpu-blocks", "8", "--ssd", "2048", "--kv-bytes-per-token", "1024",
             "--ssd-gbps", "2", "--prefill-tokens-per-s", "10000", "--journal", tmp_path / "store", "--json",
             "--out", tmp_path / "tiers.json"])
    assert r.exit_code == 0 and r.stdout == "", r.output  # --out: the file, nothing on stdout
    d = json.loads((tmp_path / "tiers.json").read_text())
    tiered = d["configurations"][1]
    assert tiered["hit_tokens"] >= d["configurations"][0]["hit_tokens"]
    store = open_store(tmp_path / "store")
    j = d["journal"]
    assert j["tier"] == "ssd" and j["chunk_bytes"] == 4 * 1024
    assert len(store.restores) == j["num_restores"] == min(16, j["num_reads_total"])
    assert sum(len(c) for c in store.restores.values()) * 4096 == store.num_bytes
    assert store.meta["source"].startswith("tiers:")
