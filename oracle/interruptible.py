"""Compiled kernels that Ctrl-C can stop.

A numba kernel runs for as long as its stream is long (minutes on 10^8 block reads), and Python handles
a signal only between bytecodes of the main thread, so a kernel called from the main thread holds
Ctrl-C until it returns. The kernels are compiled `nogil`: `run_interruptible` runs one on a worker
thread while the main thread waits in short slices, so SIGINT raises `KeyboardInterrupt` in the main
thread within `POLL_S` (the CLI turns it into `Error: interrupted.`, exit 130). The abandoned worker is a
daemon thread: it never touches Python objects again and ends with the process.
"""

from __future__ import annotations

import threading

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
