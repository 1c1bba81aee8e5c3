"""Task functions for the Ray tests (workers import this module: tests/ is on their path)."""

from __future__ import annotations

from pathlib import Path

from kmesh_trace.errors import KmeshTraceError


def square(x: int) -> int:
    return x * x


def flaky(marker: str, x: int) -> int:
    """Fails with an I/O error on its first attempt (no marker yet), then succeeds."""
    m = Path(marker)
    if not m.exists():
        m.write_text("failed once")
        raise OSError(f"transient read failure of part {x}")
    return x


def broken(x: int) -> int:
    raise OSError(f"part {x} is unreadable")


def refuses(x: int) -> int:
    raise KmeshTraceError("the partition has no block size.")
