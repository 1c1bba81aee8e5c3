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
                          on_result: Callable[[int], None] | None = None) -> list:
    """`[call() for call in calls]`, on up to `workers` daemon threads at once (default: one per call), with
    Ctrl-C honoured within POLL_S. For calls that spend their time in compiled kernels, which release the
    GIL: they run side by side on the cores. `on_result(i)` (progress) runs here, in order, as results come."""
    workers = min(workers or len(calls), len(calls))
    if workers <= 1:
        results = []
        for i, call in enumerate(calls):
            results.append(run_interruptible(call))
            if on_result is not None:
                on_result(i)
        return results
    results: list = [None] * len(calls)
    done = [False] * len(calls)
    errors: list[BaseException] = []
    lock = threading.Lock()
    queue = iter(range(len(calls)))

    def work():
        while not errors:
            with lock:
                i = next(queue, None)
            if i is None:
                return
            try:
                results[i] = calls[i]()
            except BaseException as e:  # handed to the caller below
                errors.append(e)
                return
            done[i] = True

    threads = [threading.Thread(target=work, name="kmesh-kernel", daemon=True) for _ in range(workers)]
    for t in threads:
        t.start()
    reported = 0
    while True:
        alive = [t for t in threads if t.is_alive()]
        if alive:
            alive[0].join(POLL_S)
        while on_result is not None and reported < len(calls) and done[reported] and not errors:
            on_result(reported)
            reported += 1
        if errors:
            raise errors[0]
        if not alive:
            return results
