"""Ctrl-C stops a compiled kernel: the Belady curve of a large stream runs for many
seconds in compiled code (C); SIGINT must raise KeyboardInterrupt within 2 s (the CLI turns it
into `Error: interrupted.`, exit 130)."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import numpy as np

from kmesh_trace.oracle.interruptible import run_interruptible

# A stream of 2^23 block reads over 10^6 ids, built with numpy in about a second: its Belady curve runs for
# several seconds in compiled code (O(log n) per read; the curve of the earlier 800,000-read test
# trace now ends in about a second, before any signal could reach it).
_LONG_KERNEL = """
import sys
import numpy as np
from kmesh_trace.oracle.curves import belady_curve
from kmesh_trace.oracle.stream import AccessStream
n = 1 << 23
rng = np.random.default_rng(1)
ids = rng.integers(0, 1_000_000, n).astype(np.uint64)
starts = np.arange(0, n + 1, 16, dtype=np.int64)
per = np.diff(starts)
s = AccessStream.from_arrays(512, ids, np.ones(n, bool), starts, per * 512 + 1, per)
belady_curve(AccessStream.from_arrays(512, ids[:1000], np.ones(1000, bool), starts[:63], per[:62] * 512 + 1, per[:62]))
print("ready", flush=True)
belady_curve(s)
print("done", flush=True)
"""


def test_ctrl_c_stops_headroom_inside_the_belady_kernel():
    p = subprocess.Popen([sys.executable, "-c", _LONG_KERNEL], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        assert p.stdout.readline() == "ready\n"
        time.sleep(1.0)  # inside the kernel now
        assert p.poll() is None, "the kernel ended before the signal: the stream is too small to test this"
        t0 = time.monotonic()
        p.send_signal(signal.SIGINT)
        err = ""
        while not err.endswith("KeyboardInterrupt\n"):  # the main thread's traceback, as soon as it is raised
            line = p.stderr.readline()
            assert line, f"the process ended without KeyboardInterrupt: {err}"
            err += line
        elapsed = time.monotonic() - t0  # (the exit itself then takes 1-2 s on the loaded 2-core VM)
        out, _ = p.communicate(timeout=120)
    finally:
        p.kill()
    assert p.returncode != 0 and out == "", (p.returncode, out, err)
    assert elapsed < 2.0, f"Ctrl-C took {elapsed:.1f} s"


def test_run_interruptible_returns_and_raises_as_a_plain_call():
    assert run_interruptible(lambda a, b: a + b, 2, 3) == 5

    def boom():
        raise ValueError("x")

    try:
        run_interruptible(boom)
    except ValueError as e:
        assert str(e) == "x"
    else:
        raise AssertionError("the kernel's exception was lost")


def test_run_all_interruptible_gives_results_in_order_and_raises_the_first_error():
    import threading

    import pytest

    from kmesh_trace.oracle.interruptible import run_all_interruptible

    seen: list[int] = []
    calls = [lambda i=i: (i * i, threading.current_thread().name) for i in range(6)]
    got = run_all_interruptible(calls, 2, seen.append)
    assert [g[0] for g in got] == [i * i for i in range(6)] and seen == list(range(6))
    assert {g[1] for g in got} == {"kmesh-kernel"}
    with pytest.raises(ZeroDivisionError):
        run_all_interruptible([lambda: 1, lambda: 1 // 0, lambda: 2])
    assert run_all_interruptible([lambda: 7], 4) == [7]


def test_calls_added_as_results_come_run_on_the_free_workers_in_order():
    import threading
    import time as _time

    import pytest

    from kmesh_trace.oracle.interruptible import run_all_interruptible

    gate = threading.Event()

    def slow():  # the long call: the added calls must run while it waits
        assert gate.wait(10), "the added calls never ran beside the long call"
        return "slow"

    def then(i, result):
        if result == "fast":  # a fast call adds two more (one of them fast), until call 6 frees the long one
            return [lambda: "fast", lambda: "added"] if i < 5 else [gate.set]
        return []

    for workers in (2, 3):
        gate.clear()
        got = run_all_interruptible([slow, lambda: "fast"], workers, then=then)
        assert got == ["slow", "fast", "fast", "added", "fast", "added", "fast", "added", None], workers
    # One worker: one after another, the added calls after the first ones.
    assert run_all_interruptible([lambda: 1, lambda: 2], 1, then=lambda i, r: [lambda: r * 10] if r < 10 else []) \
        == [1, 2, 10, 20]
    with pytest.raises(KeyError):
        run_all_interruptible([lambda: _time.sleep(0.01), lambda: 1], 2, then=lambda i, r: {}["x"] if r else [])
