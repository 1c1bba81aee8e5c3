"""The sample taken at read time (oracle/shards.py, native/kernels/shards.c): on the same seed and rate it keeps
the accesses the sample taken after the stream is built keeps, with the same ids, and gives the same curve;
pieces of any size give the same sample; the fixed-size sample never holds more than its bound and is the
fixed-rate sample at the rate it ended at; SHARDS-adj moves only the smallest capacities; rate 1 is the exact
curve."""

from __future__ import annotations

import json

import numpy as np
import pytest

from agentic_streams import BLOCK, agentic_rows, object_hashes, write_mooncake
from kmesh_trace.oracle.sampled_curve import curve_of_sample, sampled_curve
from kmesh_trace.oracle.sampling import (Share, accesses_for_bytes, adjusted_curve, bounded_rate, hash_buckets,
                                         measured_eligible, object_buckets, rate_share, sub_stream)
from kmesh_trace.oracle.shards import _Held, _sample_piece, read_sample, sample_after_build, sample_at_read
from kmesh_trace.oracle.curves import HitCurve
from kmesh_trace.oracle.workload import Workload

POLICIES = ["lru", "belady-prefix", "belady"]


@pytest.fixture(scope="module")
def rows():
    return agentic_rows()


@pytest.fixture(scope="module")
def jsonl(tmp_path_factory, rows):
    return write_mooncake(tmp_path_factory.mktemp("shards") / "agentic.jsonl", rows)


@pytest.fixture(scope="module")
def whole(jsonl):
    from kmesh_trace.sources import read_directly

    return Workload.from_trace(read_directly(jsonl), None, requests=False).stream


def same_stream(a, b) -> None:
    for col in ("obj", "eligible", "next_use", "req_start", "num_prompt_tokens", "num_reads"):
        np.testing.assert_array_equal(getattr(a, col), getattr(b, col), err_msg=col)
    assert a.num_objects == b.num_objects


def curves_of(res) -> dict:
    d = res.to_dict()
    return {k: d[k] for k in ("curves", "grid", "num_reads", "num_requests")}


def test_the_kernel_buckets_a_hash_as_numpy_does():
    h = np.random.default_rng(1).integers(0, 2**63, 50_000, dtype=np.int64).view(np.uint64)
    for seed in (0, 12345, 2**64 - 1):
        held = _Held(1 << 24, 10**9)  # rate 1 with a bound: every access kept, its bucket written
        n = np.array([len(h)], np.int64)
        _sample_piece(np.array([0, len(h)], np.int64), h, n, n, seed, held)
        np.testing.assert_array_equal(held.buckets[0], hash_buckets(h, seed))
    np.testing.assert_array_equal(hash_buckets(np.arange(1000, dtype=np.uint64)), object_buckets(1000))


@pytest.mark.parametrize("rate,seed", [(0.25, 0), (0.1, 7), (0.05, 2**40 + 3)])
def test_sampled_at_read_equals_sampled_after_build(jsonl, rows, whole, rate, seed):
    at_read = read_sample(jsonl, BLOCK, rate=rate, seed=seed, chunk_bytes=4096)  # thousands of piece boundaries
    after = sample_after_build(whole, object_hashes(rows), rate, seed)
    assert 0 < len(after) < len(whole)
    same_stream(at_read.stream, after)
    assert at_read.num_accesses == len(whole)
    for window in ("all", "last-half"):
        start = whole.num_requests // 2 if window == "last-half" else 0
        built = curve_of_sample(after, at_read.fraction, measured_eligible(whole, start), window=window,
                                policies=POLICIES)
        read = sample_at_read(jsonl, BLOCK, rate=rate, seed=seed, window=window, policies=POLICIES)
        assert curves_of(read) == curves_of(built)
        assert read.sampling["taken"] == "at read" and read.sampling["error_bound"] is not None


def test_pieces_of_any_size_give_one_sample(jsonl):
    one = read_sample(jsonl, BLOCK, rate=0.2, seed=5)
    for chunk in (1024, 10_000):
        same_stream(read_sample(jsonl, BLOCK, rate=0.2, seed=5, chunk_bytes=chunk).stream, one.stream)


@pytest.mark.parametrize("bound", [500, 2_000, 7_777])
def test_fixed_size_never_holds_more_than_its_bound(jsonl, whole, bound):
    s = read_sample(jsonl, BLOCK, max_accesses=bound, chunk_bytes=4096)
    assert s.max_held <= bound and len(s.stream) <= bound
    assert s.fraction < 1 and len(s.stream) > bound // 4  # the rate fell as far as it had to, not much further
    same_stream(read_sample(jsonl, BLOCK, rate=s.fraction, chunk_bytes=1 << 20).stream, s.stream)
    res = sample_at_read(jsonl, BLOCK, max_accesses=bound, policies=["lru"], chunk_bytes=4096)
    assert res.sampling["held_at_most"] <= bound == res.sampling["max_sampled_accesses"]
    assert res.sampling["rate"] == s.fraction


def test_a_bound_the_stream_fits_is_the_exact_curve(jsonl, whole):
    exact = sampled_curve(whole, 1.0, policies=POLICIES, window="last-half")
    for kw in ({"rate": 1.0}, {"max_accesses": len(whole)}):
        res = sample_at_read(jsonl, BLOCK, policies=POLICIES, window="last-half", **kw)
        assert curves_of(res) == curves_of(exact)
        assert res.infinite_hit_blocks == exact.infinite_hit_blocks


def test_a_memory_budget_in_bytes_bounds_the_accesses():
    assert accesses_for_bytes(512 << 20) == ((512 - 160) << 20) // 48
    with pytest.raises(Exception, match="no room"):
        accesses_for_bytes(100 << 20)


def test_shards_adj_adds_its_difference_at_the_smallest_capacity():
    c = HitCurve("lru", 16, np.array([0, 5, 3, 2]), np.array([0, 10, 6, 4]), 100, 1600)
    up = adjusted_curve(c, 4)
    assert up.count.tolist() == [0, 9, 3, 2] and up.position_sum.tolist() == [0, 18, 6, 4]
    down = adjusted_curve(c, -7)
    assert down.count.tolist() == [0, 0, 1, 2] and down.count.sum() == c.count.sum() - 7


def test_shards_adj_and_the_ratio_estimator_agree_where_the_sample_has_its_share(jsonl):
    ratio = sample_at_read(jsonl, BLOCK, rate=0.1, seed=1, policies=["lru"])
    adj = sample_at_read(jsonl, BLOCK, rate=0.1, seed=1, policies=["lru"], correction="adj")
    assert adj.sampling["correction"] == "adj"
    a, b = ratio.curves["lru"], adj.curves["lru"]
    caps = np.union1d(a.capacities, b.capacities)
    assert np.abs(a.at(caps) - b.at(caps)).max() / ratio.num_reads < 0.1


# ---- the CLI: `headroom --sample RATE` and `--sample-memory SIZE` sample a file while reading it ---------


def test_cli_samples_a_file_while_reading_it(cli, jsonl):
    r = cli(["headroom", jsonl, "--window", "last-half", "--sample", "0.1", "--json"])
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    want = sample_at_read(jsonl, BLOCK, rate=0.1, window="last-half").to_dict()
    assert d["curves"] == want["curves"] and d["sampled"]["taken"] == "at read"
    assert d["sampled"]["infinite_check"]["exact_hit_ratio"] is None
    human = cli(["headroom", jsonl, "--window", "last-half", "--sample", "0.1"])
    assert "taken while" in human.stdout and "from the sample (taken while reading" in human.stdout


def test_cli_sample_memory_is_a_fixed_size_sample(cli, jsonl, whole):
    r = cli(["headroom", jsonl, "--sample-memory", "161MiB", "--json"])
    assert r.exit_code == 0, r.output
    s = json.loads(r.stdout)["sampled"]
    assert s["max_sampled_accesses"] == accesses_for_bytes(161 << 20) < len(whole)
    assert s["held_at_most"] <= s["max_sampled_accesses"] and s["rate"] < 1
    plain = cli(["headroom", jsonl, "--sample-memory", "161", "--json"])  # a plain number: MiB
    assert json.loads(plain.stdout) == json.loads(r.stdout)
    human = cli(["headroom", jsonl, "--sample-memory", "161MiB"])
    assert "fixed size: at most" in human.stdout
    bad = cli(["headroom", jsonl, "--sample-memory", "100MiB"])
    assert bad.exit_code != 0 and "no room" in bad.output


def test_cli_samples_after_the_build_what_it_cannot_read_in_one_pass(cli, rows, tmp_path):
    late = write_mooncake(tmp_path / "late.jsonl", [rows[1], rows[0], *rows[2:]])  # a timestamp goes back
    r = cli(["headroom", late, "--sample", "0.1", "--json"])
    assert r.exit_code == 0, r.output
    assert "the sample at read time stopped" in r.stderr
    s = json.loads(r.stdout)["sampled"]
    assert "taken" not in s and s["infinite_check"]["exact_hit_ratio"] is not None


def test_a_built_stream_takes_its_fixed_size_sample_by_the_same_rule(whole):
    for bound in (100, 3_000, len(whole)):
        rate = bounded_rate(whole, bound)
        assert len(sub_stream(whole, rate_share(rate))) <= bound
        if rate < 1:  # one bucket more would pass the bound
            assert len(sub_stream(whole, Share(0, rate_share(rate).hi + 1))) > bound


def test_cli_sample_correction(cli, jsonl):
    r = cli(["headroom", jsonl, "--sample", "0.1", "--sample-correction", "adj", "--json"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["sampled"]["correction"] == "adj"
    assert cli(["headroom", jsonl, "--sample", "0.1", "--sample-correction", "more"]).exit_code != 0
