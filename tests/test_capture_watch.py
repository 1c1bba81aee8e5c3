"""`kmesh-trace capture` watching its engines' partitions (kmesh_trace.cli.capture_watch), without an engine:
the verdict on a partition from its metadata and whether its process still runs. (The real thing, a vLLM
server whose engine is killed under the capture: tests/test_capture_engine_death.py.)"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

from kmesh_trace.cli.capture_watch import KILLED, EngineWatch, death


def _partition(tmp_path, **meta):
    engines = tmp_path / "engines"
    engines.mkdir(exist_ok=True)
    path = engines / "e0.json"
    path.write_text(json.dumps({"engine_id": "e0", "host": socket.gethostname(), **meta}))
    return path


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_the_verdict_on_a_partition(tmp_path):
    dead = _dead_pid()
    assert death(_partition(tmp_path, pid=dead, complete=False), {"pid": dead, "complete": False,
                                                                  "host": socket.gethostname()}) == KILLED
    path = _partition(tmp_path, pid=os.getpid(), complete=False)  # still running: not dead
    assert death(path, json.loads(path.read_text())) is None
    path = _partition(tmp_path, pid=dead, complete=True)  # stopped and closed
    assert death(path, json.loads(path.read_text())) is None
    path = _partition(tmp_path, pid=dead, complete=True, engine_died="the engine core stopped on a fatal error")
    assert death(path, json.loads(path.read_text())) == "the engine core stopped on a fatal error"
    path = _partition(tmp_path, pid=dead, complete=False, host="another-host")  # not ours to judge
    assert death(path, json.loads(path.read_text())) is None


def test_the_watch_says_each_start_and_death_once_and_writes_engine_died(tmp_path):
    dead = _dead_pid()
    path = _partition(tmp_path, pid=dead, complete=False)
    said = []
    watch = EngineWatch(tmp_path / "engines", said.append)
    watch.look()
    watch.look()
    assert watch.finish() == {"e0": KILLED}
    assert said == [f"kmesh-trace: capturing engine e0 (pid {dead}) into {tmp_path}",
                    f"kmesh-trace: engine e0 died under the capture: {KILLED}"]
    meta = json.loads(path.read_text())
    assert (meta["engine_died"], meta["complete"]) == (KILLED, False)
