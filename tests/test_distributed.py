"""Distributed runs on a local Ray cluster (2 CPUs, one per test session) give exactly the single-process
results; retries, persistent failures and a missing Ray give one clear error."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from fleet_workloads import write_fleet_trace
from kmesh_trace.distributed import Task, TaskFailedError, run_tasks
from kmesh_trace.errors import KmeshTraceError, MissingDependencyError


@pytest.fixture
def fleet_trace(tmp_path):
    return write_fleet_trace(tmp_path / "t", num_engines=3, seed=5)


def _same_json(cli, args: list) -> dict:
    local = cli([*args, "--json"])
    on_ray = cli([*args, "--json", "--ray", "auto"])
    assert local.exit_code == 0, local.stderr
    assert on_ray.exit_code == 0, on_ray.stderr
    assert on_ray.stdout == local.stdout
    return json.loads(local.stdout)


def test_fleet_on_ray_equals_one_process(ray_cluster, cli, fleet_trace):
    d = _same_json(cli, ["fleet", fleet_trace, "--engines", "2,3", "--capacity-blocks", "8,16"])
    assert len(d["points"]) == 4 and [r["policy"] for r in d["points"][0]["runs"]] == [
        "round-robin", "least-loaded", "family", "prefix-aware", "global"]
    # Tasks read the parts through a pyarrow filesystem URL just the same.
    url = cli(["fleet", f"file://{fleet_trace}", "--engines", "2,3", "--capacity-blocks", "8,16", "--json",
               "--ray", "auto"])
    assert url.exit_code == 0, url.stderr
    assert json.loads(url.stdout) == d


def test_tiers_sweep_on_ray_equals_one_process(ray_cluster, cli, fleet_trace):
    d = _same_json(cli, ["tiers", fleet_trace, "--engine", "e1", "--gpu-blocks", "8", "--sweep-host", "0,4",
                         "--sweep-ssd", "0,8,16"])
    assert len(d["sweep"]["configurations"]) == 6 and d["sweep"]["host_blocks"] == [0, 4]
    r = cli(["tiers", fleet_trace, "--engine", "e1", "--gpu-blocks", "8", "--ray", "auto"])
    assert r.exit_code == 1 and "add --sweep-host" in r.stderr


def test_headroom_and_pressure_on_ray_equal_one_process(ray_cluster, cli, fleet_trace):
    d = _same_json(cli, ["headroom", fleet_trace, "--engine", "e1", "--capacity-blocks", "4,8,16"])
    assert len(d["results"]) == 5 * 3  # infinite, lru, vllm, belady-prefix, belady at 3 capacities
    d = _same_json(cli, ["pressure", fleet_trace, "--engine", "e2", "--edges", "inferred",
                         "--sweep-capacity", "6,12,24"])
    assert [p["capacity_blocks"] for p in d["sweep"]] == [6, 12, 24]
    d = _same_json(cli, ["pressure", fleet_trace, "--engine", "e0", "--edges", "inferred", "--per-request"])
    assert d["capacity_blocks"] == 24 and len(d["requests"]) == 20


def test_results_come_back_in_task_order(ray_cluster):
    done = []
    tasks = [Task(f"part {i}", (i,)) for i in range(8)]
    assert run_tasks(__import__("ray_tasks").square, tasks, ray="auto", on_done=done.append) == [i * i for i in range(8)]
    assert sorted(t.name for t in done) == sorted(t.name for t in tasks)


def test_a_transient_failure_is_retried(ray_cluster, tmp_path):
    from ray_tasks import flaky

    assert run_tasks(flaky, [Task("engine=e7", (str(tmp_path / "marker"), 7))], ray="auto") == [7]
    assert (tmp_path / "marker").read_text() == "failed once"


def test_a_persistent_failure_is_one_error_naming_the_piece(ray_cluster):
    from ray_tasks import broken, refuses, square

    tasks = [Task("engine=e0", (0,)), Task("engine=e1", (1,))]
    with pytest.raises(TaskFailedError) as e:
        run_tasks(broken, tasks[1:], ray="auto", max_retries=1)
    assert str(e.value) == "the task for engine=e1 failed (OSError: part 1 is unreadable) after 2 attempts."
    # A caller's mistake is not retried: the same error, naming its piece.
    with pytest.raises(KmeshTraceError) as e:
        run_tasks(refuses, tasks[:1], ray="auto")
    assert str(e.value) == "engine=e0: the partition has no block size."
    assert run_tasks(square, tasks, ray="auto") == [0, 1]  # the cluster is still usable


def test_without_ray_the_option_says_how_to_get_it(cli, fleet_trace, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` fails as if it were not installed
    with pytest.raises(MissingDependencyError, match=r"install it with: pip install 'kmesh-trace\[fleet\]'"):
        run_tasks(abs, [Task("x", (1,))], ray="auto")
    r = cli(["fleet", fleet_trace, "--ray", "auto"])
    assert r.exit_code == 1
    assert r.stderr.strip() == ("Error: --ray needs Ray, which is not installed; install it with: "
                                "pip install 'kmesh-trace[fleet]'")


def test_ray_address_joins_the_running_cluster(ray_cluster, cli, fleet_trace):
    # Another process (the CLI) joins the session's cluster through RAY_ADDRESS.
    args = ["fleet", str(fleet_trace), "--engines", "2", "--capacity-blocks", "8", "--json"]
    env = {**os.environ, "RAY_ADDRESS": ray_cluster.get_runtime_context().gcs_address}
    r = subprocess.run([sys.executable, "-m", "kmesh_trace.cli", *args, "--ray", "auto"], env=env,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout == cli(args).stdout
