"""Compiled kernels that Ctrl-C can stop, one or several at once.

A compiled kernel runs for as long as its stream is long (minutes on 10^8 block reads), and Python handles
a signal only between bytecodes of the main thread, so a kernel called from the main thread holds
Ctrl-C until it returns. The kernels release the GIL (C through ctypes):
`run_interruptible` runs one on a worker thread while the main thread waits in short slices, so SIGINT
raises `KeyboardInterrupt` in the main thread within `POLL_S` (the CLI turns it into `Error: interrupted.`,
exit 130); `run_all_interruptible` runs several side by side on worker threads (the two one-pass curves,
the replays of a grid), each on a core of its own. An abandoned worker is a daemon thread: it never
touches Python objects again and ends with the process.
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Sequence

#: Longest wait between two checks for a signal, in seconds.
POLL_S = 0.05


def run_interruptible(kernel, *args):
    """`kernel(*args)`, with Ctrl-C honoured within POLL_S (off the main thread: a plain call)."""
    if threading.current_thread() is not threading.main_thread():
        return kernel(*args)
    box: dict = {}

    def work():
        try:
            box["out"] = kernel(*args)
        except BaseException as e:  # handed to the caller below
            box["err"] = e

    worker = threading.Thread(target=work, name="kmesh-kernel", daemon=True)
    worker.start()
    while worker.is_alive():
        worker.join(POLL_S)
    if "err" in box:
        raise box["err"]
    return box["out"]


def run_all_interruptible(calls: Sequence[Callable[[], Any]], workers: int | None = None,
                          on_result: Callable[[int], None] | None = None,
                          then: Callable[[int, Any], Sequence[Callable[[], Any]]] | None = None) -> list:
    """`[call() for call in calls]`, on up to `workers` daemon threads at once (default: one per call), with
    Ctrl-C honoured within POLL_S. For calls that spend their time in compiled kernels, which release the
    GIL: they run side by side on the cores. `on_result(i)` (progress) runs here, in order, as results come.
    `then(i, result)`, when given, runs as call i returns (on its worker, one at a time) and returns further
    calls, appended to the list: work that can start only once an earlier result is known starts on the
    first free worker, while the other calls still run. The results are in the order of the calls."""
    calls = list(calls)
    workers = min(workers or len(calls), len(calls)) if then is None else max(workers or len(calls), 1)
    if workers <= 1:
        results = []
        for i, call in enumerate(calls):  # `calls` grows as `then` adds to it
            results.append(run_interruptible(call))
            if then is not None:
                calls.extend(then(i, results[i]))
            if on_result is not None:
                on_result(i)
        return results
    results: list = [None] * len(calls)
    done = [False] * len(calls)
    errors: list[BaseException] = []
    ready = threading.Condition()
    state = {"next": 0, "running": 0}

    def work():
        while True:
            with ready:  # wait while the queue is empty but a running call may still add to it
                while not errors and state["next"] >= len(calls) and state["running"]:
                    ready.wait()
                if errors or state["next"] >= len(calls):
                    ready.notify_all()
                    return
                i = state["next"]
                state["next"] += 1
                state["running"] += 1
            try:
                result = calls[i]()
            except BaseException as e:  # handed to the caller below
                with ready:
                    errors.append(e)
                    state["running"] -= 1
                    ready.notify_all()
                return
            with ready:
                try:
                    more = then(i, result) if then is not None else ()
                except BaseException as e:  # handed to the caller below
                    errors.append(e)
                    more = ()
                results[i] = result
                done[i] = True
                calls.extend(more)
                results.extend([None] * len(more))
                done.extend([False] * len(more))
                state["running"] -= 1
                ready.notify_all()

    threads = [threading.Thread(target=work, name="kmesh-kernel", daemon=True) for _ in range(workers)]
    for t in threads:
        t.start()
    reported = 0
    while True:
        alive = [t for t in threads if t.is_alive()]
        if alive:
            alive[0].join(POLL_S)
        while on_result is not None and reported < len(done) and done[reported] and not errors:
            on_result(reported)
            reported += 1
        if errors:
            raise errors[0]
        if not alive:
            return results
