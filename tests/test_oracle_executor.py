"""One executor behind every grid: in process and forked workers give the same results in task order,
and report progress; options name their flags once, so a reproducing command line is derived."""

from __future__ import annotations

import os

from kmesh_trace.oracle.executor import ForkPool, InProcess, Task, executor_for
from kmesh_trace.oracle.fleet import FleetOptions
from kmesh_trace.oracle.headroom import HeadroomOptions
from kmesh_trace.oracle.options import flags
from kmesh_trace.oracle.pressure import PressureOptions
from kmesh_trace.schema import PressureEdges

BIG = list(range(100_000))  # inherited by forked workers, never pickled


def _work(i: int, scale: int) -> tuple[int, int, bool]:
    return i * scale, len(BIG), os.getpid() == PARENT


PARENT = os.getpid()


def test_in_process_and_forked_workers_agree_in_task_order():
    tasks = [Task(f"task {i}", (i, 3)) for i in range(7)]
    done: list[str] = []
    here = InProcess()
    here.on_done = lambda t: done.append(t.name)
    local = here.map(_work, tasks)
    assert [r[0] for r in local] == [3 * i for i in range(7)] and all(r[2] for r in local)
    assert done == [t.name for t in tasks]
    forked = ForkPool(2).map(_work, tasks)
    assert [r[:2] for r in forked] == [r[:2] for r in local]
    assert not any(r[2] for r in forked) or os.cpu_count() == 1  # the work ran in the workers
    assert [r[:2] for r in ForkPool(1).map(_work, tasks)] == [r[:2] for r in local]
    assert not executor_for().remote and executor_for(ray="auto").remote


def test_options_give_the_flags_that_reproduce_them():
    assert flags(HeadroomOptions()) == ""
    assert flags(HeadroomOptions(capacities=(64, 512), window="last-half")) == " --capacity-blocks 64,512 --window last-half"
    assert flags(PressureOptions(PressureEdges.inferred, (96,))) == " --edges inferred --capacity-blocks 96"
    assert flags(PressureOptions(capacities=(1, 2), sweep=True)) == " --capacity-blocks 1,2"  # no flag of its own
    assert flags(FleetOptions((2, 4), (128,))) == " --engines 2,4 --capacity-blocks 128"


def _threaded_work(i: int, scale: int) -> tuple[int, bool]:
    import threading

    if i == 99:
        raise ValueError("task 99 failed")
    return i * scale, threading.current_thread() is threading.main_thread()


def test_threads_agree_with_in_process_in_task_order_and_raise_a_task_error():
    import pytest

    from kmesh_trace.oracle.executor import Threads

    tasks = [Task(f"task {i}", (i, 3)) for i in range(9)]
    for pool in (Threads(3), ForkPool(3).threads(), Threads(1)):
        done: list[str] = []
        pool.on_done = lambda t: done.append(t.name)
        got = pool.map(_threaded_work, tasks)
        assert [r[0] for r in got] == [3 * i for i in range(9)]
        assert done == [t.name for t in tasks]
        if getattr(pool, "workers", 1) > 1:
            assert not any(r[1] for r in got)  # on the worker threads
        with pytest.raises(ValueError, match="task 99"):
            pool.map(_threaded_work, tasks + [Task("bad", (99, 1))])
