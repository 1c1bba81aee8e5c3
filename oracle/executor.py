"""The one way an analysis runs its independent pieces (sweep points, grid replays, routed runs).

An `Executor` maps a function over `Task`s (`kmesh_trace.distributed.Task`: a name for progress and
errors, and the function's positional arguments) and returns the results in task order:
- `InProcess`: one after another, here;
- `ForkPool(processes)`: worker processes forked from this one, each inheriting the tasks (nothing is
  pickled on the way in, so a large workload is shared, not copied), one after another when one
  process would do or the platform cannot fork;
- `Threads(workers)`: worker threads of this process, for tasks that spend their time in compiled
  kernels outside the GIL (the C kernels of native/kernels/): as parallel as the forked workers, with no
  fork and no copied pages. `ForkPool.threads()` is the same number of workers as threads;
- `OnRay(address)`: Ray tasks (`kmesh_trace.distributed.run_tasks`). It is `remote`: its tasks read their
  input from the trace's location themselves (`kmesh_trace.oracle.tasks`), not from this process.

`on_start(num_tasks)` and `on_done(task)`, when set, report progress.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Sequence

from kmesh_trace.distributed import Task, run_tasks
from kmesh_trace.oracle.interruptible import run_all_interruptible

__all__ = ["Executor", "ForkPool", "InProcess", "OnRay", "Task", "Threads", "executor_for"]


class Executor:
    remote = False  # True: tasks must be given a location to read, not this process's objects

    def __init__(self) -> None:
        self.on_start: Callable[[int], None] | None = None
        self.on_done: Callable[[Task], None] | None = None

    def map(self, fn: Callable[..., Any], tasks: Sequence[Task]) -> list:
        if self.on_start is not None:
            self.on_start(len(tasks))
        return self._map(fn, list(tasks))

    def _map(self, fn, tasks: list[Task]) -> list:
        return run_tasks(fn, tasks, on_done=self.on_done)


class InProcess(Executor):
    """Every task here, one after another."""


_SHARED: tuple[Callable, list[Task]] | None = None  # what a forked worker inherits


def _run_shared(i: int) -> Any:
    assert _SHARED is not None
    fn, tasks = _SHARED
    return fn(*tasks[i].args)


class ForkPool(Executor):
    """Forked worker processes (default: the cores), sharing the tasks by inheritance."""

    def __init__(self, processes: int | None = None):
        super().__init__()
        self.processes = processes

    def _map(self, fn, tasks: list[Task]) -> list:
        global _SHARED
        import multiprocessing as mp

        procs = min(self.processes or os.cpu_count() or 1, len(tasks))
        if procs <= 1 or "fork" not in mp.get_all_start_methods():
            return super()._map(fn, tasks)
        _SHARED = (fn, tasks)
        try:
            with mp.get_context("fork").Pool(procs) as pool:
                results = []
                for i, r in enumerate(pool.imap(_run_shared, range(len(tasks)), chunksize=1)):
                    results.append(r)
                    if self.on_done is not None:
                        self.on_done(tasks[i])
                return results
        finally:
            _SHARED = None

    def threads(self) -> "Threads":
        """The same workers as threads (for tasks whose work releases the GIL), with this one's progress."""
        pool = Threads(self.processes)
        pool.on_start, pool.on_done = self.on_start, self.on_done
        return pool


class Threads(Executor):
    """Worker threads (default: the cores), for tasks whose kernels release the GIL; Ctrl-C stops the wait."""

    def __init__(self, workers: int | None = None):
        super().__init__()
        self.workers = workers

    def _map(self, fn, tasks: list[Task]) -> list:
        on_done = self.on_done
        return run_all_interruptible([lambda t=t: fn(*t.args) for t in tasks], self.workers or os.cpu_count() or 1,
                                     None if on_done is None else lambda i: on_done(tasks[i]))


class OnRay(Executor):
    """Ray tasks on the cluster `kmesh_trace.distributed.connect(address)` joins."""

    remote = True

    def __init__(self, address: str):
        super().__init__()
        self.address = address

    def _map(self, fn, tasks: list[Task]) -> list:
        return run_tasks(fn, tasks, ray=self.address, on_done=self.on_done)


def executor_for(processes: int | None = None, ray: str | None = None) -> Executor:
    """The executor the `--processes` and `--ray` options ask for (neither: forked workers, one per core)."""
    return OnRay(ray) if ray is not None else ForkPool(processes)
