"""The headroom analysis and `kmesh-trace headroom`, on the built-in fork-tree workload."""

from __future__ import annotations

import json

import pytest

from kmesh_trace.datasets.workloads.fork_tree import BLOCK_SIZE, fork_tree_requests, fork_tree_rows, write_fork_tree
from kmesh_trace.errors import KmeshTraceError
from kmesh_trace.oracle.headroom import headroom, headroom_of_requests
from kmesh_trace.oracle.policies import POLICIES, Workload
from kmesh_trace.apps.plots import plot_headroom
from kmesh_trace.trace import open_trace
from kmesh_trace.writer import TraceWriter

ALIGNED_PROMPT_TOKENS = 4096 + 5 * 4608


def _written_blocks(reqs, policy, capacity):
    """Full blocks the workload computes and writes (reads that missed, plus output blocks)."""
    s = Workload(BLOCK_SIZE, reqs).stream
    r = POLICIES[policy].simulate(Workload(BLOCK_SIZE, reqs, s), capacity)
    return len(s) - r.hit_blocks


@pytest.mark.parametrize("aligned", [True, False])
def test_fork_tree_block_counts(aligned):
    reqs = fork_tree_requests(aligned=aligned)
    assert [r.num_prompt_tokens for r in reqs] == ([4096] + [4608] * 5 if aligned else [4101] + [4610] * 5)
    assert all(r.output_hashes == [] for r in reqs)  # 8 output tokens complete no block
    assert all(r.parent_index == 0 for r in reqs[1:])
    # With the ancestor cached: 256 + 5 x 32 blocks; as independent copies: 256 + 5 x 288.
    assert _written_blocks(reqs, "infinite", None) == 416
    assert _written_blocks(reqs, "lru", 0) == 1696
    r = POLICIES["belady"].simulate(Workload(BLOCK_SIZE, reqs), 512)
    assert r.hit_tokens_per_request.tolist() == [0] + [4096] * 5
    prefill = [p - h for p, h in zip(r.num_prompt_tokens.tolist(), r.hit_tokens_per_request.tolist())]
    # Aligned, a child computes its 512-token tail; non-aligned, its 509-token tail plus 5 boundary tokens.
    assert prefill[1:] == ([512] * 5 if aligned else [514] * 5)


def test_headroom_from_captured_stock(tmp_path):
    rows = fork_tree_rows()
    # As if captured: the engine reused the ancestor for the first two children only.
    for row, cached in zip(rows, [0, 4096, 4096, 0, 0, 0]):
        row["num_cached_tokens"] = cached
    with TraceWriter(tmp_path / "t", "e0", {"block_size": 16, "num_usable_blocks": 512}) as w:
        w.write("invocations", {k: [r[k] for r in rows] for k in rows[0]})
    res = headroom(open_trace(tmp_path / "t"), policies=["lru", "belady"])
    d = res.to_dict()
    assert d["stock_source"] == "capture" and d["headroom_capacity_blocks"] == 512
    assert d["results"] == [
        {"policy": "lru", "capacity_blocks": 512, "hit_blocks": 1280, "hit_tokens": 20480,
         "prefill_tokens": ALIGNED_PROMPT_TOKENS - 20480, "hit_ratio": 1280 / 1696,
         "token_hit_ratio": 20480 / ALIGNED_PROMPT_TOKENS},
        {"policy": "belady", "capacity_blocks": 512, "hit_blocks": 1280, "hit_tokens": 20480,
         "prefill_tokens": ALIGNED_PROMPT_TOKENS - 20480, "hit_ratio": 1280 / 1696,
         "token_hit_ratio": 20480 / ALIGNED_PROMPT_TOKENS},
        {"policy": "stock", "capacity_blocks": 512, "hit_blocks": 512, "hit_tokens": 8192,
         "prefill_tokens": ALIGNED_PROMPT_TOKENS - 8192, "hit_ratio": 512 / 1696,
         "token_hit_ratio": 8192 / ALIGNED_PROMPT_TOKENS},
    ]
    assert d["headroom_tokens"] == 3 * 4096


def test_headroom_models_stock_with_the_pool_when_not_captured():
    # 300 blocks: the pool holds the ancestor (256) and one child's 33 running blocks.
    res = headroom_of_requests(fork_tree_requests(), 16, [300], ["belady"], num_usable_blocks=512)
    assert res.stock_source == "vllm" and res.headroom_capacity_blocks == 300
    assert res.headroom_tokens == res.stock.prefill_tokens - res.results[0].prefill_tokens
    with pytest.raises(KmeshTraceError, match="give capacity_blocks=N"):
        headroom_of_requests(fork_tree_requests(), 16, None, ["lru"])


def test_cli_headroom_json_and_plot(cli, tmp_path):
    write_fork_tree(tmp_path / "t")
    r = cli(["headroom", tmp_path / "t", "--capacity-blocks", "256,512", "--policies", "infinite,belady",
             "--json", "--plot", tmp_path / "p.svg"])
    assert r.exit_code == 0, r.stderr
    d = json.loads(r.stdout)
    assert list(d) == ["block_size", "results", "headroom_tokens", "headroom_capacity_blocks", "stock_source"]
    assert [(x["policy"], x["capacity_blocks"], x["hit_blocks"]) for x in d["results"]] == [
        ("infinite", 256, 1280), ("infinite", 512, 1280), ("belady", 256, 1280), ("belady", 512, 1280)]
    # Stock is the pool model at the trace's 512 usable blocks, where it reuses the ancestor too.
    assert (d["stock_source"], d["headroom_capacity_blocks"], d["headroom_tokens"]) == ("vllm", 512, 0)
    assert (tmp_path / "p.svg").read_text().lstrip().startswith("<?xml")
    assert "wrote" in r.stderr


def test_cli_headroom_scenario_table_and_errors(cli, tmp_path):
    r = cli(["headroom", "--scenario", "fork-tree-unaligned", "--capacity-blocks", "512", "--policies", "lru"])
    assert r.exit_code == 0, r.stderr
    row = next(line for line in r.stdout.splitlines() if " lru " in line)
    assert [c.strip() for c in row.split("│")[1:-1]] == ["lru", "512", "1,280", "20,480", f"{4101 + 5 * 4610 - 20480:,}",
                                                         f"{1280 / 1696:.4f}"]
    assert r.stdout.endswith("headroom: 0 prefill tokens at 512 blocks (stock from vllm minus belady)\n")
    r = cli(["headroom", "--scenario", "fork-tree", "--policies", "fifo"])
    assert r.exit_code == 1
    assert r.stderr.strip() == "Error: unknown policy 'fifo'; the policies are infinite, lru, vllm, belady, belady-prefix."
    r = cli(["headroom", "--scenario", "fork-tree", "--capacity-blocks", "12x"])
    assert r.stderr.strip() == ("Error: --capacity-blocks must be comma-separated integers above zero, e.g. 256,512,1024 "
                                "(got '12x').")
    r = cli(["headroom"])
    assert r.exit_code == 1 and r.stderr.startswith("Error: give either a TRACE directory or --scenario")
    with pytest.raises(KmeshTraceError, match="give a .png or .svg file"):
        plot_headroom(headroom_of_requests(fork_tree_requests(), 16, [512], ["lru"]), tmp_path / "p.pdf")
