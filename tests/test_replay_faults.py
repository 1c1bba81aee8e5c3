"""Native replay under faults: bounds of the buffer table, ring failures mid-restore, routes that fail to
start, descriptors whose numbers are reused, files that vanish, chunks too large to read.

Real io_uring throughout: a ring failure is provoked by putting another file at the ring's descriptor
number (io_uring_enter then answers EOPNOTSUPP), reads are held in flight by reading empty pipes. Only
the CUDA/cuFile layer, which has no real path on a CPU host, is replaced by fakes (GpuArena, libcufile).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
import threading
import time

import numpy as np
import pytest

from kmesh_trace.errors import KmeshTraceError
from kmesh_trace.native import routes as rt
from kmesh_trace.native import store as st
from kmesh_trace.native._lib import CHUNK_DTYPE, HostArena, NativeError, Ownership, Ring
from kmesh_trace.native.runner import RunConfig, _Files, _summary, run
from replay_support import ddir, small_store  # noqa: F401  (fixture and helper; tests/ is on sys.path)

KIB = 1024
_SYS_IO_URING_REGISTER = 427
_IORING_UNREGISTER_BUFFERS = 1
_IORING_REGISTER_BUFFERS2 = 15


def uring_fds() -> list[int]:
    out = []
    for f in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{f}") == "anon_inode:[io_uring]":
                out.append(int(f))
        except OSError:
            pass  # the listing's own descriptor
    return sorted(out)


def new_ring(depth: int, workers: int) -> tuple[Ring, list[int]]:
    """A Ring and its rings' descriptors, in ring order (each is opened after the previous one)."""
    before = set(uring_fds())
    ring = Ring(depth, workers)
    return ring, [f for f in uring_fds() if f not in before]


def _register(fd: int, op: int, arg, nr: int) -> int:
    libc = ctypes.CDLL(None, use_errno=True)
    rc = libc.syscall(ctypes.c_long(_SYS_IO_URING_REGISTER), ctypes.c_int(fd), ctypes.c_uint(op),
                      arg, ctypes.c_uint(nr))
    return -ctypes.get_errno() if rc < 0 else rc


class _RsrcRegister(ctypes.Structure):  # struct io_uring_rsrc_register
    _fields_ = [("nr", ctypes.c_uint32), ("flags", ctypes.c_uint32), ("resv2", ctypes.c_uint64),
                ("data", ctypes.c_uint64), ("tags", ctypes.c_uint64)]


# ---------------------------------------------------------------- finding: buffer table bounds


def test_sparse_table_is_bounded_and_registered_once(ddir):
    s = small_store(ddir, restores=1, chunks=1, chunk_bytes=4 * KIB)
    fd = os.open(ddir / "s" / s.restores[0][0].file, os.O_RDONLY | os.O_DIRECT)
    try:
        with Ring(2, 1) as ring:
            assert ring.register_sparse(2000) == -errno.EINVAL  # past the engine's 1024-entry table
            assert ring.register_sparse(0) == -errno.EINVAL
            assert ring.register_sparse(2) == 0
            assert ring.register_sparse(2) == -errno.EINVAL  # already registered
            a = np.zeros(1, dtype=CHUNK_DTYPE)
            a[0] = (fd, 1500, 0, 4096, 0)
            with pytest.raises(NativeError, match=r"EINVAL"):
                ring.restore(a)
            ring.unregister_buffers()
            buf = HostArena(4 * KIB)
            ring.register_buffers([buf.address], [4 * KIB])  # the table is free again
    finally:
        os.close(fd)


def test_sparse_registration_failing_on_one_ring_rolls_back_the_others():
    ring, fds = new_ring(2, 2)
    with ring:
        assert len(fds) == 2
        taken = _RsrcRegister(nr=1, flags=1)  # IORING_RSRC_REGISTER_SPARSE, behind the engine's back
        assert _register(fds[1], _IORING_REGISTER_BUFFERS2, ctypes.byref(taken), ctypes.sizeof(taken)) == 0
        assert ring.register_sparse(4) == -errno.EBUSY  # ring 0 took it, ring 1 refused
        assert _register(fds[1], _IORING_UNREGISTER_BUFFERS, None, 0) == 0
        buf = HostArena(4 * KIB)
        ring.register_buffers([buf.address], [4 * KIB])  # EBUSY on ring 0 had its table been left behind
        ring.unregister_buffers()


# ---------------------------------------------------------------- finding: ring failure mid-restore


def test_ring_failure_withdraws_unsubmitted_reads_and_the_ring_recovers(ddir):
    s = small_store(ddir, restores=1, chunks=3, chunk_bytes=8 * KIB)
    path = ddir / "s" / s.restores[0][0].file
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    buf = HostArena(24 * KIB)
    ring, (rfd,) = new_ring(4, 1)
    chunks = np.array([(fd, 0, k * 8 * KIB, 8 * KIB, k * 8 * KIB) for k in range(3)], dtype=CHUNK_DTYPE)
    try:
        ring.register_buffers([buf.address], [24 * KIB])
        saved = os.dup(rfd)
        os.dup2(fd, rfd)  # the ring's number now names a plain file: io_uring_enter fails
        with pytest.raises(NativeError, match=r"Operation not supported"):
            ring.restore(chunks)
        own = ring.ownership()
        assert (own.num_acquired, own.num_released, own.num_inflight, own.num_cq_pending) == (3, 3, 0, 0)
        os.dup2(saved, rfd)
        os.close(saved)
        samples, _ = ring.restore(chunks)  # nothing stale is submitted or reaped
        assert samples["result"].tolist() == [8 * KIB] * 3 and samples["num_sqes"].tolist() == [1, 1, 1]
        assert buf.array.tobytes() == path.read_bytes()
        assert ring.ownership() == Ownership(6, 6, 0, 0)
    finally:
        ring.close()
        os.close(fd)


def _sq_head(fd: int) -> int:
    info = open(f"/proc/self/fdinfo/{fd}").read()
    return int(next(ln.split(":")[1] for ln in info.splitlines() if ln.startswith("SqHead:")))


def test_ring_failure_with_reads_in_flight_refuses_later_restores():
    pipes = [os.pipe() for _ in range(3)]
    buf = HostArena(16 * KIB)
    ring, (rfd,) = new_ring(2, 1)
    saved = os.dup(rfd)
    chunks = np.array([(r, 0, 0, 4 * KIB, i * 4 * KIB) for i, (r, _) in enumerate(pipes)], dtype=CHUNK_DTYPE)

    def interfere():
        # once the kernel holds reads 0 and 1 (both wait on empty pipes): break the ring, then let read 0
        # finish, so the engine's next io_uring_enter fails with read 1 still in flight
        deadline = time.monotonic() + 10
        try:
            while _sq_head(rfd) < 2 and time.monotonic() < deadline:
                time.sleep(0.01)
        finally:  # whatever happened, unblock the restore: the test may fail, never hang
            os.dup2(pipes[0][1], rfd)
            os.write(pipes[0][1], b"x" * 4 * KIB)

    try:
        ring.register_buffers([buf.address], [16 * KIB])
        t = threading.Thread(target=interfere)
        t.start()
        with pytest.raises(NativeError, match=r"Operation not supported"):
            ring.restore(chunks)
        t.join()
        own = ring.ownership()
        assert (own.num_acquired, own.num_released, own.num_inflight) == (3, 2, 1)
        assert not own.drained
        with pytest.raises(NativeError, match=r"earlier ring failure left reads this ring could not reap"):
            ring.restore(chunks)
    finally:
        os.dup2(saved, rfd)
        os.close(saved)
        os.write(pipes[1][1], b"y" * 4 * KIB)  # the read still in flight completes
        ring.close()
        for r, w in pipes:
            os.close(r)
            os.close(w)


# ---------------------------------------------------------------- finding: routes that fail to start


class _SpyArena(HostArena):
    made: list = []

    def __init__(self, n, *huge):
        super().__init__(n, *huge)
        _SpyArena.made.append(self)


class _FakeGpuArena:
    """Stands in for the device arena (no CUDA here); records close()."""

    made: list = []

    def __init__(self, n):
        self.address, self.stream_handle, self.closed = 1 << 40, 0, False
        self.stream = type("S", (), {"synchronize": lambda self: None})()
        _FakeGpuArena.made.append(self)

    def close(self):
        self.closed = True


def test_host_route_that_fails_to_register_releases_its_arena_and_ring(monkeypatch):
    monkeypatch.setattr(rt, "HostArena", _SpyArena)
    _SpyArena.made = []
    before = uring_fds()
    with pytest.raises(NativeError, match="registering fixed buffers"):
        rt.HostRoute(2 << 30)  # io_uring refuses a fixed buffer over 1 GiB
    assert [a._map.closed for a in _SpyArena.made] == [True]
    assert uring_fds() == before


@pytest.mark.skipif(ctypes.util.find_library("cuda") is not None, reason="this host has a CUDA driver")
def test_host_fixed_route_that_cannot_page_lock_releases_everything(monkeypatch):
    monkeypatch.setattr(rt, "HostArena", _SpyArena)
    monkeypatch.setattr(rt, "GpuArena", _FakeGpuArena)
    _SpyArena.made, _FakeGpuArena.made = [], []
    before = uring_fds()
    with pytest.raises(rt.RouteUnavailable, match=r"cuMemHostRegister .* failed \(libcuda.so.1 not found"):
        rt.HostFixedRoute(64 * KIB)  # no libcuda.so.1: the real kr_cuda_host_register fails
    assert [a._map.closed for a in _SpyArena.made] == [True]
    assert [a.closed for a in _FakeGpuArena.made] == [True]
    assert uring_fds() == before


def test_cufile_route_that_cannot_register_its_arena_releases_it(monkeypatch):
    from kmesh_trace.native import cufile

    class FakeCufile:  # libcufile: the driver opens, the buffer registration fails
        def cuFileDriverOpen(self):
            return cufile._Status(0, 0)

        def cuFileBufRegister(self, *a):
            return cufile._Status(5030, 0)

    monkeypatch.setattr(cufile, "load", lambda: FakeCufile())
    monkeypatch.setattr(cufile, "GpuArena", _FakeGpuArena)
    _FakeGpuArena.made = []
    with pytest.raises(rt.RouteUnavailable, match="cuFileBufRegister of the arena failed"):
        cufile.CufileRoute(64 * KIB)
    assert [a.closed for a in _FakeGpuArena.made] == [True]


# ---------------------------------------------------------------- finding: cuFile handles and ownership


def test_cufile_handles_follow_the_file_not_the_descriptor_number(ddir):
    from kmesh_trace.native.cufile import Handles

    for name in "abc":
        (ddir / name).write_bytes(b"\0" * 4096)
    log: list = []
    counter = iter(range(100))
    h = Handles(lambda fd: ("h", next(counter), fd), lambda handle: log.append(handle))
    fd = os.open(ddir / "a", os.O_RDONLY)
    assert h.get(fd) == h.get(fd) == ("h", 0, fd)
    h.forget(fd)  # the runner forgets before closing
    os.close(fd)
    fd2 = os.open(ddir / "b", os.O_RDONLY)
    assert fd2 == fd and h.get(fd2) == ("h", 1, fd)
    assert log == [("h", 0, fd)]
    os.close(fd2)  # closed without forget: the number now names another file, whose handle is new
    fd3 = os.open(ddir / "c", os.O_RDONLY)
    assert fd3 == fd and h.get(fd3) == ("h", 2, fd)
    assert log == [("h", 0, fd), ("h", 1, fd)]
    h.close()
    os.close(fd3)
    assert log[-1] == ("h", 2, fd)


def test_runner_forgets_each_corrupted_copy_before_closing_it(ddir, monkeypatch):
    small_store(ddir, restores=1, chunks=2, chunk_bytes=4 * KIB)
    seen = []
    monkeypatch.setattr(rt.HostRoute, "forget", lambda self, fd: seen.append(os.readlink(f"/proc/self/fd/{fd}")),
                        raising=False)
    sm = run(ddir / "s", RunConfig(pairs=1, restores=1, warmup=0, corrupt=2)).summary
    assert sm["ok"] and sm["corruptions_rejected"] == 2
    assert [os.path.basename(p) for p in seen] == ["0-0.bin", "0-1.bin"]  # still open when forgotten


def test_ownership_that_is_not_measured_is_reported_as_such(ddir):
    from kmesh_trace.native.cufile import CufileRoute

    own = object.__new__(CufileRoute).ownership()
    assert own.drained is None
    store = small_store(ddir, restores=1, chunks=1, chunk_bytes=4 * KIB)
    drained = {"num_acquired": 3, "num_released": 3, "num_inflight": 0, "num_cq_pending": 0, "drained": True}
    cfg = RunConfig(routes=["host", "cufile"], pairs=1, restores=1)
    sm = _summary(store, cfg, [], {"host": drained, "cufile": {"num_acquired": None, "num_released": None,
                                                               "num_inflight": None, "num_cq_pending": None,
                                                               "drained": None}}, [])
    assert (sm["all_buffers_returned"], sm["ownership_not_measured"]) == (True, ["cufile"])
    sm = _summary(store, cfg, [], {"host": {**drained, "num_released": 2, "drained": False},
                                   "cufile": {"drained": None}}, [])
    assert sm["all_buffers_returned"] is False and sm["ok"] is False
    # Nothing measured at all is no proof: None, not True.
    only = RunConfig(routes=["cufile"], pairs=1, restores=1)
    sm = _summary(store, only, [], {"cufile": {"num_acquired": None, "num_released": None, "num_inflight": None,
                                               "num_cq_pending": None, "drained": None}}, [])
    assert (sm["all_buffers_returned"], sm["ownership_not_measured"], sm["ok"]) == (None, ["cufile"], True)


# ---------------------------------------------------------------- finding: open errors and chunk limits


def test_payload_deleted_after_the_store_was_opened_is_named_missing(ddir):
    s = small_store(ddir, restores=2, chunks=1, chunk_bytes=4 * KIB)
    gone = ddir / "s" / "payload" / "restore-000001.bin"
    gone.unlink()
    with pytest.raises(KmeshTraceError) as e:
        _Files(s)
    assert str(e.value) == (f"payload file {gone} is missing (it was there when the store was opened); "
                            f"re-create the store with `replay prepare`")


def test_chunks_over_one_gib_are_refused_when_planned(ddir, cli):
    msg = ("--chunk-bytes is 2147483648 bytes, more than the 1073741824 (1 GiB) one io_uring read can move; "
           "use a smaller chunk size")
    for plan in (lambda: st.plan_uniform(1, 1, 2 << 30), lambda: st.plan_from_trace(ddir / "no-trace", 2 << 30, 1)):
        with pytest.raises(st.StoreError) as e:
            plan()
        assert str(e.value) == msg
    r = cli(["replay", "prepare", "--out", ddir / "s", "--chunks", 1, "--chunk-bytes", 2 << 30])
    assert (r.exit_code, r.stderr) == (1, f"Error: {msg}\n")
    assert not (ddir / "s").exists()
    assert st.plan_uniform(1, 1, 1 << 30) == [[1 << 30]]  # exactly 1 GiB is readable


# ---- journals are checked when read, runs are bounded, seeds are checked ---------------------------

import pyarrow as _pa
import pyarrow.parquet as _pq

from kmesh_trace.native import store as _st
from kmesh_trace.native.runner import MAX_TIMED_RESTORES, RunConfig as _RunConfig, schedule as _schedule


def _journal_edit(store_dir, column, index, value, type_):
    jp = store_dir / _st.JOURNAL
    t = _pq.read_table(jp)
    vals = t[column].to_pylist()
    vals[index] = value
    field = t.schema.field(column).with_nullable(value is None)
    t = t.set_column(t.schema.get_field_index(column), field, _pa.array(vals, type_))
    _pq.write_table(t, jp)


@pytest.mark.parametrize("column,value,type_,message", [
    ("offset_bytes", -4096, _pa.int64(), "offset -4096 is not a non-negative multiple of 4096"),
    ("file", "/etc/passwd", _pa.string(), "lies outside the store"),
    ("file", "../outside.bin", _pa.string(), "lies outside the store"),
    ("sha256", "not-a-digest", _pa.string(), "is not a SHA-256 in hex"),
])
def test_journal_entries_outside_the_store_are_refused_when_read(tmp_path, cli, column, value, type_, message):
    _st.prepare(tmp_path / "s", _st.plan_uniform(1, 2, 4096))
    (tmp_path / "outside.bin").write_bytes(b"\0" * 8192)
    _journal_edit(tmp_path / "s", column, 1, value, type_)
    with pytest.raises(_st.StoreError, match=message):
        _st.open_store(tmp_path / "s")
    r = cli(["replay", "run", tmp_path / "s", "--restores", 1, "--pairs", 1])
    assert r.exit_code == 1 and r.stderr.startswith("Error: ") and r.stderr.count("\n") == 1
    assert message in r.stderr


def test_a_symlink_out_of_the_store_is_refused(tmp_path):
    _st.prepare(tmp_path / "s", _st.plan_uniform(1, 1, 4096))
    (tmp_path / "outside.bin").write_bytes(b"\0" * 4096)
    link = tmp_path / "s" / "payload" / "restore-000000.bin"
    link.unlink()
    link.symlink_to(tmp_path / "outside.bin")
    with pytest.raises(_st.StoreError, match="lies outside the store"):
        _st.open_store(tmp_path / "s")


def test_a_repeated_chunk_and_null_entries_are_refused(tmp_path):
    _st.prepare(tmp_path / "s", _st.plan_uniform(1, 2, 4096))
    _journal_edit(tmp_path / "s", "chunk_index", 1, 0, _pa.int32())
    with pytest.raises(_st.StoreError, match="lists chunk 0 twice"):
        _st.open_store(tmp_path / "s")
    _journal_edit(tmp_path / "s", "size_bytes", 1, None, _pa.int64())
    with pytest.raises(_st.StoreError, match="null"):
        _st.open_store(tmp_path / "s")


@pytest.mark.parametrize("args", [["replay", "prepare", "--seed", "-1"], ["replay", "run", "STORE", "--seed", "-1"]])
def test_a_negative_seed_is_one_error_line(tmp_path, cli, args):
    _st.prepare(tmp_path / "s", _st.plan_uniform(1, 1, 4096))
    args = [str(tmp_path / "s") if a == "STORE" else a for a in args]
    if args[1] == "prepare":
        args += ["--out", str(tmp_path / "new")]
    r = cli(args)
    assert r.exit_code == 1
    assert r.stderr.startswith("Error: --seed must be an integer in 0..") or r.stderr.startswith("Error: --seed must be in 0..")
    assert r.stderr.count("\n") == 1


def test_a_billion_restores_are_refused_before_any_work(tmp_path, cli):
    _st.prepare(tmp_path / "s", _st.plan_uniform(1, 1, 4096))
    r = cli(["replay", "run", tmp_path / "s", "--restores", 1_000_000_000])
    assert r.exit_code == 1 and r.stderr.count("\n") == 1
    assert f"at most {MAX_TIMED_RESTORES:,} samples" in r.stderr
    assert not (tmp_path / "s" / "runs").exists()


def test_the_schedule_is_planned_lazily():
    plan = _schedule(_RunConfig(routes=["host"], pairs=1, restores=10**12, warmup=0))
    assert next(plan) == (0, 0, "host", "measured")  # a list of 10**12 entries would never get here
