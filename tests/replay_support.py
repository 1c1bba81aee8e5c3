"""Test support for the native replay tests: the io_uring check (importing this module skips the
importing test module when the kernel or a seccomp profile refuses io_uring), a directory where
O_DIRECT works (the `ddir` fixture) and a small prepared store.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest

from kmesh_trace.native import store as st

KIB = 1024


def _io_uring_or_skip() -> None:
    # The engine must be built (a failure to load it fails every test); io_uring itself may be refused by
    # a container's seccomp profile, which no code here can fix: say so instead of failing.
    from kmesh_trace.native._lib import probe_io_uring, strerror

    rc = probe_io_uring()
    if rc:
        pytest.skip(f"io_uring is unavailable on this machine ({strerror(rc)}); the host route needs it",
                    allow_module_level=True)


_io_uring_or_skip()


def _direct_ok(d: Path) -> bool:
    fd, name = tempfile.mkstemp(dir=d)
    os.close(fd)
    try:
        os.close(os.open(name, os.O_RDONLY | os.O_DIRECT))
        return True
    except OSError:
        return False
    finally:
        os.unlink(name)


@pytest.fixture
def ddir(tmp_path) -> Path:
    """A directory where O_DIRECT works (tmp_path unless it is tmpfs; then one under $HOME)."""
    if _direct_ok(tmp_path):
        yield tmp_path
        return
    d = Path(tempfile.mkdtemp(dir=Path.home(), prefix=".kmesh-replay-test-"))
    if not _direct_ok(d):
        pytest.skip("no directory with O_DIRECT support on this machine")
    yield d
    import shutil

    shutil.rmtree(d, ignore_errors=True)


def small_store(ddir: Path, name="s", restores=2, chunks=3, chunk_bytes=64 * KIB, seed=7) -> st.Store:
    return st.prepare(ddir / name, st.plan_uniform(restores, chunks, chunk_bytes), seed=seed)
