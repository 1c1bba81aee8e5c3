"""Where an analysis's independent pieces run: in this process (the default) or as Ray tasks (`--ray`).

It owns Ray: connecting (`--ray auto` joins the cluster `RAY_ADDRESS` names or one already running on
this machine, else starts a local one that listens on 127.0.0.1 only, with no dashboard; `--ray ADDRESS`
joins that cluster, giving up in one line after `KMESH_TRACE_RAY_TIMEOUT_S` seconds, default 30), submitting one task per
piece (an engine partition, a sweep point, a routing policy), following their completion, retrying
failed tasks, and turning a persistent failure into one error that names the piece.

A caller hands `run_tasks` a plain module-level function and one `Task` (a name and the arguments) per
piece; the results come back in the order of the tasks, whichever finished first, so merging them gives
exactly what the same loop in one process gives. Tasks should take a trace's *location* (see
`kmesh_trace.parts`) rather than its rows, so each reads its own Parquet parts where they lie.

Wiring another analysis is one call: replace `[f(*a) for a in points]` with
`run_tasks(f, [Task(name, a) for ...], ray=ray, on_done=...)` and add the `--ray` option (`RAY_HELP`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from kmesh_trace.errors import KmeshTraceError, MissingDependencyError

__all__ = ["CONNECT_TIMEOUT_ENV", "INSTALL_HINT", "LOCAL_SYSTEM_CONFIG", "MAX_RETRIES", "RAY_HELP", "Task", "TaskFailedError",
           "check_ray_option", "connect", "local_cluster_options", "run_tasks"]

INSTALL_HINT = "pip install 'kmesh-trace[fleet]'"
RAY_HELP = ("Run the pieces (engine partitions, sweep points) as Ray tasks: 'auto' joins RAY_ADDRESS's "
            "cluster or a local one, or starts a local one; or give a cluster address.")
#: Retries of a task after its first attempt: Ray re-runs a task whose worker died, and one that raised
#: a transient I/O error (a re-read may succeed). A caller's mistake (KmeshTraceError) is not retried.
MAX_RETRIES = 2
_RETRIED = [OSError, ConnectionError, TimeoutError]
#: For a local cluster started here: Ray runs its workers at nice 15 by default, which on a shared
#: machine hands their CPU to every other process; the single-process run they replace runs at nice 0.
LOCAL_SYSTEM_CONFIG = {"worker_niceness": 0}


class TaskFailedError(KmeshTraceError):
    """A task failed on every attempt; the message names its piece."""


@dataclass(frozen=True)
class Task:
    """One piece of work: `name` says what it covers ("engine=e1: lru at 512 blocks") in
    progress and errors; `args` are the function's positional arguments (small and picklable)."""

    name: str
    args: tuple = ()


#: Seconds `--ray ADDRESS` may take to join a cluster before giving up (Ray's own retries take minutes).
CONNECT_TIMEOUT_ENV = "KMESH_TRACE_RAY_TIMEOUT_S"
DEFAULT_CONNECT_TIMEOUT_S = 30.0
#: Ray picks its node address, and the interfaces its servers listen on, from this switch: off, a node
#: is this machine's loopback only. A cluster's job API is unauthenticated, so a local one stays there.
_LOOPBACK_ONLY_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
LOOPBACK = "127.0.0.1"


def connect_timeout_s() -> float:
    try:
        value = float(os.environ.get(CONNECT_TIMEOUT_ENV, DEFAULT_CONNECT_TIMEOUT_S))
    except ValueError:
        value = -1.0
    if not 0 < value < float("inf"):
        raise KmeshTraceError(f"{CONNECT_TIMEOUT_ENV} must be a number of seconds above zero "
                              f"(got {os.environ.get(CONNECT_TIMEOUT_ENV)!r}).")
    return value


def local_cluster_options() -> dict:
    """`ray.init` options for a cluster started on this machine (here and by the tests): every server
    bound to 127.0.0.1, no dashboard, workers at normal priority. Call before `ray.init`; it also makes
    the Ray processes started from here, which inherit the environment, keep to the loopback."""
    os.environ[_LOOPBACK_ONLY_ENV] = "0"
    import ray._private.ray_constants as constants  # read when ray was imported; set for this process too

    constants.ENABLE_RAY_CLUSTER = False
    return dict(include_dashboard=False, _node_ip_address=LOOPBACK, _system_config=LOCAL_SYSTEM_CONFIG)


def _within(seconds: float, target: str, work: Callable[[], Any]) -> Any:
    """Run `work` (a Ray connection) and give up after `seconds` with one sentence; Ray's own
    connection retries to an address where no cluster answers run for minutes."""
    import threading

    box: dict = {}

    def run() -> None:
        try:
            box["value"] = work()
        except BaseException as e:  # handed to the caller's thread
            box["error"] = e

    t = threading.Thread(target=run, name="ray-connect", daemon=True)
    t.start()
    t.join(seconds)
    if t.is_alive():
        raise KmeshTraceError(f"no Ray cluster answered at {target} within {seconds:g} s; check the address "
                              f"(ray status shows it), raise {CONNECT_TIMEOUT_ENV}, or use --ray auto for a "
                              "local cluster.")
    if "error" in box:
        raise box["error"]
    return box.get("value")


def check_ray_option(ray: str | None) -> None:
    """`--ray ADDRESS` where nothing accepts connections, refused before a command does any work."""
    if ray is not None and ray != "auto":
        _check_reachable(ray, connect_timeout_s())


def _check_reachable(address: str, seconds: float) -> None:
    """Refuse at once an ADDRESS (host:port) where nothing accepts a connection."""
    import socket

    host, _, port = address.rpartition(":")
    if "://" in address or not host or not port.isdigit():
        return  # ray://, a bare host: left to Ray (bounded by _within)
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=seconds).close()
    except OSError as e:
        raise KmeshTraceError(f"cannot join the Ray cluster at {address}: nothing accepts connections there "
                              f"({e.strerror or e}); check the address (ray status shows it) or use --ray auto "
                              "for a local cluster.") from None


def connect(address: str = "auto"):
    """Join or start a Ray cluster (see the module docstring) and return the `ray` module. Joining gives
    up after `KMESH_TRACE_RAY_TIMEOUT_S` seconds (default 30); a cluster started here listens on
    127.0.0.1 only, with no dashboard."""
    try:
        import ray
    except ImportError:
        raise MissingDependencyError(f"--ray needs Ray, which is not installed; install it with: {INSTALL_HINT}") from None
    if ray.is_initialized():
        return ray
    import logging  # here, not at the top: every analysis command's --help imports this module

    quiet = dict(logging_level=logging.WARNING, log_to_driver=False)  # stdout stays the command's data
    seconds = connect_timeout_s()
    target = address if address != "auto" else os.environ.get("RAY_ADDRESS") or "this machine"
    try:
        if address != "auto" or os.environ.get("RAY_ADDRESS"):
            joined = address if address != "auto" else os.environ["RAY_ADDRESS"]
            _check_reachable(joined, seconds)
            _within(seconds, joined, lambda: ray.init(address=joined, **quiet))
        else:
            try:
                _within(seconds, target, lambda: ray.init(address="auto", **quiet))
            except ConnectionError:  # nothing running here: start a local cluster for this process
                ray.init(**local_cluster_options(), **quiet)
    except (ConnectionError, ValueError, RuntimeError, ray.exceptions.RayError) as e:
        raise KmeshTraceError(f"cannot join the Ray cluster at {target} ({_one_line(e)}); check the "
                              "address (ray status shows it) or use --ray auto for a local cluster.") from None
    return ray


def run_tasks(fn: Callable[..., Any], tasks: Sequence[Task], *, ray: str | None = None,
              on_done: Callable[[Task], None] | None = None, max_retries: int = MAX_RETRIES) -> list:
    """`[fn(*t.args) for t in tasks]`, in this process (`ray` None) or as Ray tasks on the cluster
    `connect(ray)` gives. `on_done(task)` is called as each task completes (progress bars)."""
    if ray is None:
        results = []
        for t in tasks:
            results.append(fn(*t.args))
            if on_done is not None:
                on_done(t)
        return results
    return _run_on_ray(connect(ray), fn, tasks, on_done, max_retries)


_REMOTE: dict[Callable, Any] = {}


def _run_on_ray(ray, fn, tasks, on_done, max_retries) -> list:
    remote = _REMOTE.get(fn)
    if remote is None:
        remote = _REMOTE[fn] = ray.remote(fn)
    refs = [remote.options(name=t.name, max_retries=max_retries, retry_exceptions=_RETRIED).remote(*t.args)
            for t in tasks]
    position = {ref: i for i, ref in enumerate(refs)}
    results: list = [None] * len(tasks)
    pending = list(refs)
    try:
        while pending:
            done, pending = ray.wait(pending, num_returns=1)
            for ref in done:
                i = position[ref]
                results[i] = _get(ray, ref, tasks[i], max_retries)
                if on_done is not None:
                    on_done(tasks[i])
    finally:
        for ref in pending:  # a failure (or an interrupt) leaves nothing running behind it
            ray.cancel(ref, force=True)
    return results


def _get(ray, ref, task: Task, max_retries: int):
    from ray.exceptions import RayError, RayTaskError

    try:
        return ray.get(ref)
    except RayTaskError as e:
        cause = e.cause if isinstance(e.cause, BaseException) else e
        if isinstance(cause, KmeshTraceError):  # the caller's mistake: the same sentence, with its piece
            raise type(cause)(f"{task.name}: {cause}") from None
        attempts = 1 + max_retries if isinstance(cause, tuple(_RETRIED)) else 1
        raise TaskFailedError(f"the task for {task.name} failed ({_one_line(cause)}) after {attempts} "
                              f"attempt{'s' if attempts > 1 else ''}.") from None
    except RayError as e:  # the worker died on every attempt, or the task was cancelled
        raise TaskFailedError(f"the task for {task.name} did not complete after {1 + max_retries} attempts "
                              f"({_one_line(e)}).") from None


def _one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0]}" if text else type(e).__name__
