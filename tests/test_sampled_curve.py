"""Sampled and partitioned curves (oracle/sampling.py, oracle/sampled_curve.py): the sub-stream of a share
of the block ids is the stream of those blocks, sampling is deterministic, rate 1 and one partition are the
exact curve, a sample or a merge of partitions stays within a stated tolerance of the exact curve on a
synthetic agentic stream, the merge is exact for the infinite cache, and every such result says so."""

from __future__ import annotations

import json

import numpy as np
import pytest

from kmesh_trace.oracle.curves import HitCurve
from kmesh_trace.oracle.headroom import EXACT_CURVE_BYTES_PER_ACCESS
from kmesh_trace.oracle.headroom_curve import headroom_curve
from kmesh_trace.oracle.sampled_curve import partitioned_curve, sampled_curve
from kmesh_trace.oracle.sampling import (SPACE, Share, merged_curve, object_buckets, partition_shares, rate_share,
                                         scaled_curve, sub_stream)
from kmesh_trace.oracle.stream import AccessStream
from kmesh_trace.oracle.workload import Workload

POLICIES = ["lru", "belady-prefix", "belady"]


def agentic_requests(seed=7, num_conversations=400, turns=12, system_blocks=6, prompts=40):
    """(arrival, block ids) per request: conversations whose every turn re-reads its growing prefix, one of
    `prompts` system prompts first, interleaved in time."""
    rng = np.random.default_rng(seed)
    events, next_id = [], 1 << 32
    for c in range(num_conversations):
        prefix = list(range(c % prompts * 100, c % prompts * 100 + system_blocks))
        t = rng.uniform(0, 1000)
        for _ in range(turns):
            grow = int(rng.integers(1, 8))
            prefix = prefix + list(range(next_id, next_id + grow))
            next_id += grow
            events.append((t, list(prefix)))
            t += rng.exponential(20)
    events.sort(key=lambda e: e[0])
    return events


def agentic_stream(block_size=16, **kw) -> AccessStream:
    events = agentic_requests(**kw)
    ids = np.array([b for _, blocks in events for b in blocks], np.uint64)
    per = np.array([len(b) for _, b in events], np.int64)
    req_start = np.concatenate([[0], np.cumsum(per)])
    return AccessStream.from_arrays(block_size, ids, np.ones(len(ids), bool), req_start, per * block_size + 1, per)


@pytest.fixture(scope="module")
def stream():
    return agentic_stream()


@pytest.fixture(scope="module")
def exact(stream):
    return headroom_curve(Workload.of_stream(stream), policies=POLICIES, window="last-half", processes=1)


def max_delta(exact, other, name) -> float:
    """max |other - exact| hit ratio: over every rise of either step curve, or over the grid."""
    a, b = exact.curves[name], other.curves[name]
    caps = np.union1d(a.capacities, b.capacities) if a.exact else np.asarray(exact.grid)
    return float(np.abs(a.at(caps) - b.at(caps)).max()) / exact.num_reads


def splitmix64(i: int) -> int:
    """Output i (from 1) of splitmix64 seeded with 0, in plain Python: the reference."""
    m = (1 << 64) - 1
    z = (i * 0x9E3779B97F4A7C15) & m
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & m
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & m
    return z ^ (z >> 31)


def test_object_buckets_are_splitmix64s_top_bits():
    assert splitmix64(1) == 0xE220A8397B1DCDAF  # the generator's first output from seed 0, as published
    ids = [0, 1, 2, 3, (1 << 22) - 1, 1 << 22, (1 << 22) + 1]  # across the chunk boundary too
    got = object_buckets((1 << 22) + 2)
    assert [int(got[i]) for i in ids] == [splitmix64(i + 1) >> 40 for i in ids]


def test_a_share_is_the_stream_of_its_blocks(stream):
    share = rate_share(0.3)
    part = sub_stream(stream, share)
    kept = (object_buckets(stream.num_objects) < share.hi)[stream.obj]
    # Dense ids are the ranks of the hashes: the kept ids' ranks, built from scratch, are the same stream.
    per = np.diff(np.searchsorted(np.flatnonzero(kept), stream.req_start))
    want = AccessStream.from_arrays(16, stream.obj[kept].astype(np.uint64), stream.eligible[kept],
                                    np.concatenate([[0], np.cumsum(per)]), stream.num_prompt_tokens, stream.num_reads)
    assert 0 < len(part) < len(stream)
    for name in ("obj", "eligible", "next_use", "req_start", "num_prompt_tokens", "num_reads"):
        assert np.array_equal(getattr(part, name), getattr(want, name)), name
    assert part.num_objects == want.num_objects


def test_partitions_split_every_access_once(stream):
    parts = [sub_stream(stream, s) for s in partition_shares(3)]
    assert sum(len(p) for p in parts) == len(stream)
    assert sum(p.num_objects for p in parts) == stream.num_objects
    assert partition_shares(3) == [Share(0, SPACE // 3), Share(SPACE // 3, 2 * SPACE // 3), Share(2 * SPACE // 3, SPACE)]


def test_scaled_curve_spreads_each_level_over_the_capacities_it_stands_for():
    sample = HitCurve("belady", 16, np.array([0, 10, 0, 20]), np.array([0, 1, 0, 3]), 100, 1600)
    c = scaled_curve(sample, 0.5, 2.0)
    # level 1 stands for capacities 1-2, level 3 for 5-6; hits doubled
    assert c.count.tolist() == [0, 10, 10, 0, 0, 20, 20]
    assert c.position_sum.tolist() == [0, 1, 1, 0, 0, 3, 3]
    assert (c.num_reads, c.num_prompt_tokens) == (100, 1600)


def test_merged_curve_adds_the_partitions_at_k_times_their_levels():
    a = HitCurve("lru", 16, np.array([0, 4, 2]), np.array([0, 0, 2]), 50, 800)
    b = HitCurve("lru", 16, np.array([0, 0, 0, 6]), np.array([0, 0, 0, 0]), 50, 800)
    m = merged_curve([a, b])
    assert m.count.tolist() == [0, 2, 2, 1, 1, 3, 3]
    assert m.count.sum() == 12  # every hit of every partition: the infinite cache's hits are exact


def test_sampling_is_deterministic(stream):
    one = sampled_curve(stream, 0.25, window="last-half").to_dict()
    two = sampled_curve(agentic_stream(), 0.25, window="last-half").to_dict()
    assert json.dumps(one, sort_keys=True) == json.dumps(two, sort_keys=True)


def test_rate_one_and_one_partition_are_the_exact_curve(stream, exact):
    for res in (sampled_curve(stream, 1.0, window="last-half", grid=exact.grid),
                partitioned_curve(Workload.of_stream(stream), 1, window="last-half", grid=exact.grid)):
        for name in POLICIES:
            assert np.array_equal(res.curves[name].capacities, exact.curves[name].capacities)
            assert np.array_equal(res.curves[name].hit_blocks, exact.curves[name].hit_blocks)
        assert res.sampling["infinite_check"]["delta"] == 0.0


#: Tolerances on this stream (153,878 accesses): the max |delta hit ratio| over the whole curve (measured:
#: 0.0129 and 0.0213 at rates 0.25 and 0.1, 0.0033 and 0.0028 with 2 and 4 partitions).
SAMPLE_TOLERANCE = {0.25: 0.02, 0.1: 0.03}
PARTITION_TOLERANCE = {2: 0.005, 4: 0.005}


@pytest.mark.parametrize("rate", sorted(SAMPLE_TOLERANCE))
def test_a_sample_stays_within_its_tolerance(stream, exact, rate):
    res = sampled_curve(stream, rate, window="last-half", grid=exact.grid)
    deltas = {name: max_delta(exact, res, name) for name in POLICIES}
    assert max(deltas.values()) <= SAMPLE_TOLERANCE[rate], deltas
    assert max(deltas.values()) > 0  # a sample, not the stream
    assert abs(res.sampling["infinite_check"]["delta"]) <= 0.01


@pytest.mark.parametrize("k", sorted(PARTITION_TOLERANCE))
def test_merged_partitions_stay_within_their_tolerance_and_are_exact_at_infinity(stream, exact, k):
    res = partitioned_curve(Workload.of_stream(stream), k, window="last-half", grid=exact.grid)
    deltas = {name: max_delta(exact, res, name) for name in POLICIES}
    assert 0 < max(deltas.values()) <= PARTITION_TOLERANCE[k], deltas
    assert res.sampling["infinite_check"]["delta"] == 0.0
    assert res.curves["belady"].hit_blocks[-1] == exact.curves["belady"].hit_blocks[-1] == exact.infinite_hit_blocks


# ---- the CLI: labelled, with its error ----------------------------------------------------------------


@pytest.fixture(scope="module")
def jsonl(tmp_path_factory):
    """The synthetic stream as a Mooncake-format file (512-token blocks)."""
    path = tmp_path_factory.mktemp("sampled") / "agentic.jsonl"
    with open(path, "w") as f:
        for t, blocks in agentic_requests(num_conversations=120):
            f.write(json.dumps({"timestamp": int(t * 1000), "input_length": 512 * len(blocks),
                                "output_length": 10, "hash_ids": blocks}) + "\n")
    return path


def test_cli_sampled_result_is_labelled_in_json_and_for_humans(cli, jsonl):
    r = cli(["headroom", jsonl, "--window", "last-half", "--sample", "0.1", "--json"])
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    s = d["sampled"]
    assert (s["method"], s["rate"]) == ("shards", 0.1)
    assert s["error_bound"]["rate"] == 0.1 and set(s["error_bound"]) >= {"lru", "belady", "belady-prefix", "stream"}
    assert set(s["infinite_check"]) == {"exact_hit_ratio", "sampled_hit_ratio", "delta"}
    assert list(d["curves"]) == POLICIES
    r = cli(["headroom", jsonl, "--window", "last-half", "--sample", "0.1"])
    assert r.exit_code == 0, r.output
    lines = r.stdout.splitlines()
    assert lines[0].startswith("sampled: 0.1 of the block ids (SHARDS;")
    assert lines[1] == "  the input was read"  # a Mooncake file is sampled while it is read (oracle/shards.py)
    assert lines[2].startswith("error: max |delta hit ratio| measured at rate 0.1: lru ")
    assert lines[3].startswith("  ") and lines[4].startswith("  ")  # the bound's stream, within 80 columns
    assert lines[5].startswith("infinite cache here: ")
    assert max(len(line) for line in lines[:7]) <= 80
    assert "SAMPLED block hit ratio by capacity" in r.stdout
    r = cli(["headroom", jsonl, "--window", "last-half", "--sample", "0.1", "--csv"])
    assert r.exit_code == 0, r.output
    rows = r.stdout.splitlines()
    assert rows[0].split(",")[-1] == "sampled" and all(row.endswith(",shards 0.1") for row in rows[1:])


def test_cli_rate_one_is_the_exact_curve_unlabelled(cli, jsonl):
    exact = cli(["headroom", jsonl, "--policies", ",".join(POLICIES), "--window", "last-half", "--json"])
    one = cli(["headroom", jsonl, "--policies", ",".join(POLICIES), "--window", "last-half", "--sample", "1",
               "--json"])
    assert exact.exit_code == one.exit_code == 0
    assert json.loads(one.stdout) == json.loads(exact.stdout)
    assert "sampled" not in json.loads(one.stdout)


def test_cli_samples_above_the_memory_budget_and_says_why(cli, jsonl):
    # 0.0005 GiB: under the exact curves' 16 B an access, over a tenth of them (the largest rate that fits)
    r = cli(["headroom", jsonl, "--window", "last-half", "--memory-budget", "0.0005", "--json"])
    assert r.exit_code == 0, r.output
    s = json.loads(r.stdout)["sampled"]
    assert 0.0005 * 2**30 < s["num_accesses"] * EXACT_CURVE_BYTES_PER_ACCESS <= 0.005 * 2**30
    assert s["rate"] == 0.1 and s["why"].endswith("over the memory budget; --sample 1 forces them")
    assert list(json.loads(r.stdout)["curves"]) == POLICIES  # the vllm model is not sampled


@pytest.mark.parametrize("args, message", [
    (["--sample", "0.1", "--policies", "lru,vllm"], "a sampled curve covers lru, belady-prefix, belady, not vllm"),
    (["--sample", "0.1", "--partitions", "2"], "--sample and --partitions are two ways"),
    (["--sample", "0.1", "--capacity-blocks", "8"], "--sample and --partitions make a curve"),
    (["--sample", "0"], "--sample"),
])
def test_cli_refuses_what_a_sample_cannot_do(cli, jsonl, args, message):
    r = cli(["headroom", jsonl, *args])
    assert r.exit_code != 0
    assert message in r.output


def test_cli_partitions_in_process_are_labelled_and_exact_at_infinity(cli, jsonl):
    r = cli(["headroom", jsonl, "--window", "last-half", "--partitions", "3", "--json"])
    assert r.exit_code == 0, r.output
    s = json.loads(r.stdout)["sampled"]
    assert (s["method"], s["partitions"], s["infinite_check"]["delta"]) == ("partitions", 3, 0.0)
    assert s["error_bound"]["partitions"] == 4  # the nearest measured setting that errs at least as much


def test_partitions_on_ray_equal_partitions_here_and_stay_near_the_exact_curve(ray_cluster, cli, jsonl):
    """The k partitions as Ray tasks on the local cluster (127.0.0.1, 2 workers), each reading the trace itself:
    the same merged curve as in this process, exact at the infinite cache, near the one-machine exact curve."""
    args = ["headroom", jsonl, "--window", "last-half", "--policies", ",".join(POLICIES), "--json"]
    here = cli([*args, "--partitions", "2"])
    on_ray = cli([*args, "--partitions", "2", "--ray", "auto"])
    exact = cli(args)
    assert here.exit_code == on_ray.exit_code == exact.exit_code == 0, on_ray.output
    merged, one = json.loads(on_ray.stdout), json.loads(exact.stdout)
    assert merged == json.loads(here.stdout)
    assert merged["sampled"]["method"] == "partitions" and merged["sampled"]["infinite_check"]["delta"] == 0.0
    for name in POLICIES:
        a, b = one["curves"][name], merged["curves"][name]
        caps = np.union1d(a["capacities"], b["capacities"])  # a grid curve: both on the same grid
        at = lambda c, cap: np.asarray(c["hit_blocks"])[np.searchsorted(c["capacities"], cap, side="right") - 1]  # noqa: E731
        delta = np.abs(at(a, caps) - at(b, caps)).max() / one["num_reads"]
        assert delta <= PARTITION_TOLERANCE[2], (name, delta)


@pytest.mark.parametrize("flag", [["--sample", "0.1"], ["--partitions", "2"]])
def test_cli_refuses_to_sample_a_hybrid_engine(tmp_path, cli, flag):
    """A hybrid engine's pool serves prefix positions across KV groups: a sample of block ids is not its curve."""
    from hybrid_traces import write_hybrid

    write_hybrid(tmp_path / "t")
    r = cli(["headroom", tmp_path / "t", "--window", "last-half", *flag])
    assert r.exit_code == 1
    assert "this engine is hybrid" in r.output
    r = cli(["headroom", tmp_path / "t", "--window", "last-half", "--memory-budget", "0.0000001", "--json"])
    assert r.exit_code == 0, r.output
    assert "sampled" not in json.loads(r.stdout)  # nor sampled by itself: the exact curve
