"""Ray, as kmesh-trace starts and joins it: a local cluster (`--ray auto`
and the tests' fixture) listens on 127.0.0.1 only, with no dashboard, and `--ray ADDRESS` where no
cluster answers gives up in one line, within the configurable timeout."""

from __future__ import annotations

import ipaddress
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import textwrap
import time

import pytest

CLI = [sys.executable, "-m", "kmesh_trace.cli"]


def _listeners_of(pids: set[int]) -> list[tuple[str, str]]:
    """(local address, process) of every TCP/UDP socket listening in one of `pids`, as `ss` reports them."""
    if shutil.which("ss") is None:
        pytest.skip("ss(8) is not installed")
    out = subprocess.run(["ss", "-ltnupH"], capture_output=True, text=True, check=True).stdout
    found = []
    for line in out.splitlines():
        if {int(p) for p in re.findall(r"pid=(\d+)", line)} & pids:
            fields = line.split()
            found.append((fields[4], line))
    return found


def _is_loopback(local: str) -> bool:
    host = local.rsplit(":", 1)[0].strip("[]")
    if host.startswith("::ffff:"):
        host = host[len("::ffff:"):]
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # "*", "0.0.0.0" spelled otherwise
        return False


def _tree(pid: int) -> set[int]:
    psutil = pytest.importorskip("psutil")
    return {pid} | {p.pid for p in psutil.Process(pid).children(recursive=True)}


def test_the_fixture_cluster_listens_on_loopback_only(ray_cluster):
    # The worker processes start on demand: run a task so that they exist too.
    assert ray_cluster.get(ray_cluster.remote(lambda: 1).remote()) == 1
    assert {n["NodeManagerAddress"] for n in ray_cluster.nodes()} == {"127.0.0.1"}
    listeners = _listeners_of(_tree(os.getpid()))
    assert listeners, "the cluster's servers were not found"
    outside = [line for local, line in listeners if not _is_loopback(local)]
    assert outside == []


_AUTO = textwrap.dedent("""
    import os, sys, time
    from kmesh_trace.distributed import connect
    ray = connect("auto")
    assert ray.get(ray.remote(lambda: 1).remote()) == 1
    print({n["NodeManagerAddress"] for n in ray.nodes()}, flush=True)
    sys.stdin.readline()  # hold the cluster while the test looks at its sockets
""")


def test_ray_auto_starts_a_local_cluster_on_loopback_only():
    """`--ray auto` with no cluster to join: the cluster it starts listens on 127.0.0.1 only, and has no
    dashboard. Its own Ray temporary directory keeps it from joining any other cluster on this machine."""
    pytest.importorskip("ray")
    tmp = tempfile.mkdtemp(prefix="kr", dir="/tmp")  # short: Ray's socket paths live under it
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(RAY_TMPDIR=tmp, RAY_DISABLE_USAGE_STATS="1")
    p = subprocess.Popen([sys.executable, "-c", _AUTO], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, env=env)
    try:
        line = p.stdout.readline()
        assert line.strip() == "{'127.0.0.1'}", p.stderr.read() if p.poll() is not None else line
        listeners = _listeners_of(_tree(p.pid))
        assert listeners
        assert [line for local, line in listeners if not _is_loopback(local)] == []
        assert not any("dashboard" in line for _, line in listeners)
    finally:
        p.stdin.close()
        try:
            p.wait(timeout=60)
        finally:
            p.kill()
            shutil.rmtree(tmp, ignore_errors=True)


@pytest.fixture
def small_trace(tmp_path):
    from kmesh_trace.writer import TraceWriter

    with TraceWriter(tmp_path / "t", "e0", {"block_size": 16, "num_usable_blocks": 8}) as w:
        w.write("invocations", {"request_id": ["a"], "seq": [0], "num_prompt_tokens": [32],
                                "prompt_token_ids": [list(range(32))]})
    return tmp_path / "t"


def test_ray_at_an_address_where_nothing_listens_gives_up_at_once(small_trace):
    t0 = time.monotonic()
    p = subprocess.run(CLI + ["headroom", str(small_trace), "--capacity-blocks", "8", "--ray", "127.0.0.1:1"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 1
    errors = [line for line in p.stderr.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and errors[0].startswith("Error: cannot join the Ray cluster at 127.0.0.1:1: nothing "
                                                     "accepts connections"), p.stderr
    assert time.monotonic() - t0 < 120  # not Ray's minutes of retries (a bound, not a benchmark)


def test_ray_at_an_address_that_never_answers_gives_up_after_the_timeout(small_trace):
    """Something accepts connections but never speaks Ray: the join stops after KMESH_TRACE_RAY_TIMEOUT_S."""
    pytest.importorskip("ray")
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(16)
    port = silent.getsockname()[1]
    try:
        t0 = time.monotonic()
        p = subprocess.run(CLI + ["headroom", str(small_trace), "--capacity-blocks", "8", "--ray", f"127.0.0.1:{port}"],
                           capture_output=True, text=True, timeout=120,
                           env={**os.environ, "KMESH_TRACE_RAY_TIMEOUT_S": "3"})
        elapsed = time.monotonic() - t0
    finally:
        silent.close()
    assert p.returncode == 1
    # (Ray's own connection thread may still log a line of its own after ours, as the process exits.)
    errors = [line for line in p.stderr.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and errors[0].startswith(f"Error: no Ray cluster answered at 127.0.0.1:{port} within 3 s"), p.stderr
    assert elapsed < 120
