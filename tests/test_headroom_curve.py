"""`headroom` along the whole capacity axis (`headroom_curve`, `kmesh-trace headroom --curve`), the
[belady-prefix, belady] bracket and prefill seconds, on the built-in fork-tree workload."""

from __future__ import annotations

import json

import numpy as np
import pytest

from kmesh_trace.datasets.workloads.fork_tree import BLOCK_SIZE, fork_tree_requests, fork_tree_rows, write_fork_tree
from kmesh_trace.oracle.headroom import headroom_of_requests
from kmesh_trace.oracle.headroom_curve import grid_capacities, headroom_curve, simulate_grid
from kmesh_trace.oracle.policies import POLICIES, Workload
from kmesh_trace.oracle.prefill_cost import PrefillCost
from kmesh_trace.oracle.stream import requests_from_rows
from kmesh_trace.writer import TraceWriter

COST = PrefillCost(1e-4, 1e-8, 1e-3)


def test_grid_is_powers_of_two_past_the_depth_plus_the_stock_capacity():
    assert grid_capacities(256, [300]) == [1, 2, 4, 8, 16, 32, 64, 128, 256, 300]
    assert grid_capacities(257) == [1, 2, 4, 8, 16, 32, 64, 128, 256, 512]
    # A stock capacity far beyond where the curves go flat: powers of two up to it, no jump.
    assert grid_capacities(4, [8191]) == [1 << k for k in range(13)] + [8191]
    assert grid_capacities(4, [8192]) == [1 << k for k in range(14)]


@pytest.mark.parametrize("window", ["all", "last-half"])
def test_curve_agrees_with_the_replays_at_every_grid_capacity(window):
    reqs = fork_tree_requests(aligned=False)
    res = headroom_curve(Workload(BLOCK_SIZE, reqs, num_usable_blocks=300), window=window, cost=COST, processes=2)
    start = len(reqs) // 2 if window == "last-half" else 0
    w = Workload(BLOCK_SIZE, reqs)
    assert res.grid == [1, 2, 4, 8, 16, 32, 64, 128, 256, 300]
    rows = res.along_grid()
    for row in rows:
        c = row["capacity_blocks"]
        for name in ("lru", "vllm", "belady-prefix", "belady"):
            r = POLICIES[name].simulate(w, c)
            assert row[name]["hit_blocks"] == r.hit_blocks_per_request[start:].sum(), (name, c)
            want_s = COST.seconds_array(r.hit_tokens_per_request[start:], r.num_prompt_tokens[start:]).sum()
            assert row[name]["prefill_seconds"] == pytest.approx(want_s)
        assert row["headroom_tokens"] == row["vllm"]["prefill_tokens"] - row["belady"]["prefill_tokens"]
        assert row["headroom_seconds"] == pytest.approx(row["vllm"]["prefill_seconds"] - row["belady"]["prefill_seconds"])
        assert row["bracket_width_tokens"] == 0  # chained hashes: belady never needs a block without its parent
    assert res.stock["source"] == "vllm" and res.stock["capacity_blocks"] == 300
    # The ancestor (256 blocks) is what the children reuse; belady reaches it at 256, lru too.
    fr = res.capacity_for_fraction()
    assert fr["belady"]["0.99"] <= 256 and fr["lru"]["0.99"] <= 256
    assert set(res.ttft) == {"lru", "vllm", "belady-prefix", "belady", "no cache"}
    assert res.ttft["belady"]["p50"] <= res.ttft["no cache"]["p50"]


@pytest.mark.parametrize("policies, grid", [(None, None), (None, [3, 64, 300]), (["vllm"], None),
                                           (["lru", "belady-prefix"], [5, 300]), (["belady", "vllm"], None)])
def test_grid_replays_beside_the_curves_equal_the_curves_then_the_grid(policies, grid):
    """On threads the grid replays start as a finished curve bounds the grid (kmesh_trace.oracle.headroom_curve
    `_curves_and_grid`); one after another (InProcess) they wait for every curve: the same result."""
    from kmesh_trace.oracle.executor import InProcess

    reqs = fork_tree_requests(aligned=False)
    for window in ("all", "last-half"):
        kw = dict(policies=policies, window=window, cost=COST, grid=grid)
        plain = headroom_curve(Workload(BLOCK_SIZE, reqs, num_usable_blocks=300), executor=InProcess(), **kw).to_dict()
        for processes in (1, 2, 3):
            res = headroom_curve(Workload(BLOCK_SIZE, reqs, num_usable_blocks=300), processes=processes, **kw)
            assert res.to_dict() == plain, (window, processes)


def test_simulate_grid_in_worker_processes_equals_one_after_another():
    w = Workload(BLOCK_SIZE, fork_tree_requests())
    assert (simulate_grid("vllm", w, [64, 300, 512], processes=2) == simulate_grid("vllm", w, [64, 300, 512], processes=1)).all()



def test_a_gil_free_policy_replays_its_grid_on_threads_equal_to_one_after_another(monkeypatch):
    """belady-prefix's kernel is C (it releases the GIL): its grid runs on --processes threads, not forks."""
    from kmesh_trace.oracle import executor as ex

    w = Workload(BLOCK_SIZE, fork_tree_requests())
    caps = [1, 64, 300, 512, 4096]
    alone = simulate_grid("belady-prefix", w, caps, processes=1)
    forked = []
    monkeypatch.setattr(ex.ForkPool, "_map", lambda self, fn, tasks: forked.append(tasks) or [])
    assert (simulate_grid("belady-prefix", w, caps, processes=3) == alone).all()
    assert (simulate_grid("belady-prefix", w, caps, executor=ex.Threads(2)) == alone).all()
    assert forked == []  # no worker process was forked


def test_a_wide_bracket_is_flagged():
    # Hash lists whose block 2 recurs under another parent: belady keeps it alone, a prefix cache cannot.
    rows = [{"request_id": str(i), "num_prompt_tokens": 9, "num_output_tokens": 0, "prompt_block_hashes": h}
            for i, h in enumerate([[1, 2, 3], [5, 2, 6], [7, 2, 8], [9, 2, 10]])]
    reqs = requests_from_rows(rows, 4)
    res = headroom_curve(Workload(4, reqs), policies=["belady-prefix", "belady"], grid=[1])
    assert res.wide_brackets() == [1] and "is a range, not a number" in res.notes[0]
    fixed = headroom_of_requests(reqs, 4, [1], ["belady-prefix", "belady"])
    assert fixed.bracket() == {"belady_prefix_prefill_tokens": 36, "belady_prefill_tokens": 24, "width_tokens": 12,
                               "wide": True}
    assert "is a range, not a number" in fixed.notes[-1]


def _captured_fork_tree(tmp_path):
    rows = fork_tree_rows()
    for i, (row, cached) in enumerate(zip(rows, [0, 4096, 4096, 0, 0, 0])):
        row["num_cached_tokens"] = cached
        row["first_token_ns"] = row["first_scheduled_ns"] + 1_000_000 + (row["num_prompt_tokens"] - cached) * 10_000
    with TraceWriter(tmp_path / "t", "e0", {"block_size": 16, "num_usable_blocks": 512}) as w:
        w.write("invocations", {k: [r[k] for r in rows] for k in rows[0]})
    return tmp_path / "t"


def test_cli_curve_is_the_default_without_capacities(cli, tmp_path):
    trace = _captured_fork_tree(tmp_path)
    r = cli(["headroom", trace, "--json", "--plot", tmp_path / "c.svg"])
    assert r.exit_code == 0, r.stderr
    assert "prefill cost fitted to 6 measured prefills" in r.stderr and "wrote" in r.stderr
    d = json.loads(r.stdout)
    assert d["stock"] == {"source": "capture", "capacity_blocks": 512, "hit_tokens": 8192,
                          "prefill_tokens": 4096 + 5 * 4608 - 8192,
                          "prefill_seconds": pytest.approx(d["stock"]["prefill_seconds"])}
    # The synthetic timings are exactly 1 ms + 10 us per computed token: the fit finds them.
    assert d["prefill_cost"]["seconds_per_token"] == pytest.approx(1e-5, rel=1e-6)
    assert d["prefill_cost"]["seconds_per_request"] == pytest.approx(1e-3, rel=1e-6)
    assert d["prefill_cost_fit"]["n"] == 6 and d["prefill_cost_fit"]["r2"] == pytest.approx(1.0)
    assert d["stock"]["prefill_seconds"] == pytest.approx(6e-3 + (4096 + 5 * 4608 - 8192) * 1e-5)
    assert list(d["curves"]) == ["lru", "vllm", "belady-prefix", "belady"]
    assert d["curves"]["belady"]["exact"] and not d["curves"]["vllm"]["exact"]
    assert set(d["ttft_estimate_seconds"]) == {"stock", "lru", "vllm", "belady-prefix", "belady", "no cache"}
    assert (tmp_path / "c.svg").read_text().startswith("<?xml")
    # Without vllm no RequestBlocks are built (the stream comes column-wise): the same curves.
    r = cli(["headroom", trace, "--json", "--policies", "lru,belady"])
    assert r.exit_code == 0, r.stderr
    lean = json.loads(r.stdout)
    assert lean["curves"] == {k: v for k, v in d["curves"].items() if k in ("lru", "belady")}
    assert lean["stock"] == d["stock"]
    r = cli(["headroom", trace, "--window", "last-half"])
    assert r.exit_code == 0, r.stderr
    assert "window: last-half, 3 requests" in r.stdout and "stock (capture) at 512 blocks" in r.stdout
    r = cli(["headroom", trace, "--curve", "--capacity-blocks", "64"])
    assert (r.exit_code, r.stderr.strip()) == (1, "Error: --curve covers every capacity; drop --capacity-blocks (or --curve).")
    # A window with explicit capacities: the curve's result at exactly those capacities.
    r = cli(["headroom", trace, "--window", "last-half", "--capacity-blocks", "64,300", "--json"])
    assert r.exit_code == 0, r.stderr
    half = json.loads(r.stdout)
    assert half["window"] == "last-half" and [row["capacity_blocks"] for row in half["grid"]] == [64, 300]
    whole = json.loads(cli(["headroom", trace, "--window", "last-half", "--json"]).stdout)
    assert half["num_reads"] == whole["num_reads"] and half["num_reads"] < d["num_reads"]
    for name in ("lru", "belady"):  # exact curves: the same values wherever both report a capacity
        assert half["curves"][name] == whole["curves"][name]


def test_cli_fixed_capacities_give_seconds_and_the_bracket(cli, tmp_path):
    trace = write_fork_tree(tmp_path / "t")
    r = cli(["headroom", trace, "--capacity-blocks", "300", "--prefill-tokens-per-s", "10000", "--json"])
    assert r.exit_code == 0, r.stderr
    d = json.loads(r.stdout)
    assert [x["policy"] for x in d["results"]] == ["infinite", "lru", "vllm", "belady-prefix", "belady"]
    assert d["bracket"]["width_tokens"] == 0 and d["bracket"]["wide"] is False
    by = {x["policy"]: x for x in d["results"]}
    assert by["belady"]["prefill_seconds"] == pytest.approx(by["belady"]["prefill_tokens"] / 10000)
    assert d["headroom_seconds"] == pytest.approx(d["headroom_tokens"] / 10000)
    assert np.isclose(d["prefill_cost"]["tokens_per_second_at_0"], 10000)


def test_cli_capacity_in_bytes_is_the_same_replay_as_in_blocks(cli, tmp_path):
    """--capacity takes blocks or bytes: 4.8MB at 1,000 KV bytes per token and 16-token
    blocks is 300 blocks, and gives --capacity-blocks 300's result exactly, with or without a window."""
    trace = write_fork_tree(tmp_path / "t")
    for window in ([], ["--window", "last-half"]):
        want = cli(["headroom", trace, "--capacity-blocks", "300", "--json", *window])
        assert want.exit_code == 0, want.stderr
        for cap in (["--capacity", "300"], ["--capacity", "4.8MB", "--kv-bytes-per-token", "1000"]):
            got = cli(["headroom", trace, *cap, "--json", *window])
            assert (got.exit_code, got.stdout) == (0, want.stdout), got.stderr
    r = cli(["headroom", trace, "--capacity", "300", "--capacity-blocks", "300"])
    assert (r.exit_code, r.stderr.strip()) == (1, "Error: give the capacities once: --capacity or --capacity-blocks.")
    r = cli(["headroom", trace, "--capacity", "1KiB", "--kv-bytes-per-token", "1000"])
    assert r.exit_code == 1
    assert r.stderr.strip().splitlines()[-1].startswith("Error: --capacity must give capacities of at least one block")
