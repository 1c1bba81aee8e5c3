"""The prefill cost model: exact arithmetic, recovery of known coefficients, and a fit read from a recorded trace."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest

from kmesh_trace.errors import KmeshTraceError
from kmesh_trace.oracle.prefill_cost import PrefillCost


def test_seconds_is_the_integral_of_the_per_position_cost():
    m = PrefillCost(1e-4, 2e-8, 5e-3)
    assert m.seconds(0, 1000) == pytest.approx(5e-3 + 1e-4 * 1000 + 2e-8 * 1000**2 / 2)
    # Cached [0, 600): only the last 400 positions are paid for, at their (higher) positions.
    assert m.seconds(600, 1000) == pytest.approx(5e-3 + 1e-4 * 400 + 2e-8 * (1000**2 - 600**2) / 2)
    assert m.seconds(1000, 1000) == 0.0
    assert m.seconds_array(np.array([0, 600, 5]), np.array([1000, 1000, 5])).tolist() == pytest.approx(
        [m.seconds(0, 1000), m.seconds(600, 1000), 0.0])
    assert m.tokens_per_second_at(0) == pytest.approx(1e4)
    assert m.tokens_per_second_at(5000) == pytest.approx(1 / (1e-4 + 1e-4))
    assert set(m.to_json()) >= {"seconds_per_token", "seconds_per_token_position", "seconds_per_request"}


def test_throughput_and_geometry_constructors():
    m = PrefillCost.from_throughput(10_000, attention_factor=1e-4)
    assert m.tokens_per_second_at(0) == pytest.approx(10_000)
    assert m.tokens_per_second_at(10_000) == pytest.approx(5_000)  # twice the cost at 1 / factor
    g = PrefillCost.from_geometry(10_000, num_params=8e9, num_layers=32, attention_dim=4096)
    assert g.seconds_per_token_position / g.seconds_per_token == pytest.approx(2 * 32 * 4096 / 8e9)
    assert g.source == "geometry"
    with pytest.raises(KmeshTraceError, match="positive number of tokens per second"):
        PrefillCost.from_throughput(0)


def test_fit_recovers_exact_coefficients():
    rng = random.Random(3)
    true = PrefillCost(2e-4, 3e-8, 7e-3)
    start = [rng.choice([0, rng.randrange(0, 4000)]) for _ in range(40)]
    end = [s + rng.randrange(1, 8000) for s in start]
    secs = [true.seconds(s, e) for s, e in zip(start, end)]
    m, rep = PrefillCost.fit_points(start, end, secs)
    assert (m.seconds_per_token, m.seconds_per_token_position, m.seconds_per_request) == pytest.approx(
        (2e-4, 3e-8, 7e-3), rel=1e-6)
    assert json.loads(json.dumps(m.to_json()))["seconds_per_request"] == pytest.approx(7e-3)
    assert rep.n == 40 and rep.r2 == pytest.approx(1.0) and rep.median_relative_error < 1e-9
    assert len(rep.points) == 40 and rep.points[0][:3] == (start[0], end[0], secs[0])


def test_fit_never_returns_a_negative_coefficient():
    # Constant per-token cost, noise that an unconstrained fit would explain with a negative slope.
    start = np.zeros(6, np.int64)
    end = np.array([100, 200, 300, 400, 500, 600])
    secs = end * 1e-3 - np.array([0, 0, 0, 0, 1e-3, 3e-3])
    m, _ = PrefillCost.fit_points(start, end, secs)
    assert min(m.seconds_per_token, m.seconds_per_token_position, m.seconds_per_request) >= 0
    with pytest.raises(KmeshTraceError, match="at least 3"):
        PrefillCost.fit_points([0, 0], [10, 20], [1.0, 2.0])


def test_fit_reads_a_recorded_capture_and_skips_rows_without_a_measured_prefill(tmp_path):
    """`PrefillCost.fit(trace)` on a trace as the capture writes it, with times from a known cost: the
    coefficients come back, and rows with no measurable prefill (null times, a full hit, an
    unscheduled request) are counted as skipped. (The fit to a live engine's measured times is a
    benchmark, benchmarks/prefill_fit_bench.py: measured times on a loaded machine are no test.)"""
    from kmesh_trace.trace import open_trace
    from kmesh_trace.writer import TraceWriter

    rng = random.Random(5)
    true = PrefillCost(1.5e-4, 4e-8, 2e-3)
    rows = []
    for i in range(30):
        n = rng.randrange(64, 2000)
        cached = rng.choice([0, 32 * rng.randrange(0, n // 32)])
        sched = 1_000_000 * i
        rows.append({"request_id": f"r{i}", "seq": i, "num_prompt_tokens": n, "num_cached_tokens": cached,
                     "arrival_ns": sched, "first_scheduled_ns": sched,
                     "first_token_ns": sched + int(round(true.seconds(cached, n) * 1e9)), "status": "finished"})
    rows.append(dict(rows[0], request_id="no-times", seq=30, first_token_ns=None))
    rows.append(dict(rows[0], request_id="full-hit", seq=31, num_cached_tokens=rows[0]["num_prompt_tokens"]))
    rows.append(dict(rows[0], request_id="never-scheduled", seq=32, first_scheduled_ns=None, first_token_ns=None,
                     status=None))
    with TraceWriter(tmp_path / "t", "e0", {"block_size": 32, "num_usable_blocks": 64}) as w:
        w.write("invocations", {k: [r[k] for r in rows] for k in rows[0]})
    with open_trace(tmp_path / "t") as trace:
        m, rep = PrefillCost.fit(trace)
    assert (rep.n, rep.num_skipped) == (30, 3) and m.source == "fit"
    assert (m.seconds_per_token, m.seconds_per_token_position, m.seconds_per_request) == pytest.approx(
        (1.5e-4, 4e-8, 2e-3), rel=1e-4)  # nanosecond rounding of the recorded times
    assert any(s > 0 for s, _, _, _ in rep.points)  # prefills that started from a cached prefix
    assert json.loads(json.dumps({"model": m.to_json(), "fit": rep.to_json()}))["fit"]["n"] == 30


def test_every_reason_for_no_prefill_seconds_names_the_flag_that_gives_them(tmp_path):
    """A capture with too few measured prefills to fit: the reason says what to pass."""
    from kmesh_trace.oracle.prefill_cost import MIN_FIT_POINTS, usable_fit
    from kmesh_trace.trace import open_trace
    from kmesh_trace.writer import TraceWriter

    rows = [{"request_id": f"r{i}", "seq": i, "num_prompt_tokens": 100, "num_cached_tokens": 0, "arrival_ns": i,
             "first_scheduled_ns": i, "first_token_ns": i + 1_000_000, "status": "finished"} for i in range(2)]
    with TraceWriter(tmp_path / "t", "e0", {"block_size": 32, "num_usable_blocks": 64}) as w:
        w.write("invocations", {k: [r[k] for r in rows] for k in rows[0]})
    with open_trace(tmp_path / "t") as trace:
        cost, _, why = usable_fit(trace)
    assert cost is None and why.startswith("no prefill seconds: only 2 invocation(s) have a measured prefill")
    assert why.endswith(f"needs at least {MIN_FIT_POINTS}. Give a throughput with --prefill-tokens-per-s instead")
