"""The `cufile` route: GPUDirect Storage reads (cuFile, or its compatibility mode) into the GPU arena.

libcufile is loaded with ctypes at run time (from the system, the CUDA toolkit or the `nvidia-cufile`
wheel). Its probe opens the driver and registers an O_DIRECT file handle in the store's directory, the
step that fails on hosts without the nvidia-fs module or udev data for the disk (error 5027; benchmarks/README.md shows it on the H200 host).
cuFileRead is synchronous, so `depth` threads keep that many reads in flight. Buffer ownership is not
observable through cuFile, so the route reports it as not measured.
"""

from __future__ import annotations

import ctypes
import os
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable

import numpy as np

from kmesh_trace.native._lib import NOT_MEASURED, SAMPLE_DTYPE, Ownership, now_ns
from kmesh_trace.native.gpu import GpuArena, RouteUnavailable
from kmesh_trace.native.routes import GPU_POISON, Probe, Restored, Route, cuda_driver_step, run_steps, torch_cuda_step
from kmesh_trace.native.store import ALIGNMENT

_OPAQUE_FD = 1  # CU_FILE_HANDLE_TYPE_OPAQUE_FD


class _Status(ctypes.Structure):
    _fields_ = [("err", ctypes.c_int), ("cu_err", ctypes.c_int)]  # CUfileError_t


class _Handle(ctypes.Union):
    _fields_ = [("fd", ctypes.c_int), ("handle", ctypes.c_void_p)]


class _Descr(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("handle", _Handle), ("fs_ops", ctypes.c_void_p)]  # CUfileDescr_t


def _candidates() -> list[str]:
    names = ["libcufile.so.0", "libcufile.so"]
    try:
        import nvidia.cufile as wheel  # the nvidia-cufile wheel ships the library

        for base in list(getattr(wheel, "__path__", [])):
            names += [str(Path(base) / "lib" / n) for n in ("libcufile.so.0", "libcufile.so")]
    except ImportError:
        pass
    cuda_home = os.environ.get("CUDA_HOME", "/usr/local/cuda")
    return names + [f"{cuda_home}/lib64/libcufile.so.0", f"{cuda_home}/targets/x86_64-linux/lib/libcufile.so.0"]


_cf: ctypes.CDLL | None = None


def load() -> ctypes.CDLL:
    global _cf
    if _cf is not None:
        return _cf
    errors = []
    for name in _candidates():
        try:
            L = ctypes.CDLL(name)
            break
        except OSError as e:
            errors.append(str(e))
    else:
        raise RouteUnavailable("libcufile not found (install the CUDA toolkit's GDS or `pip install nvidia-cufile`)")
    for fn in ("cuFileDriverOpen", "cuFileHandleRegister", "cuFileBufRegister", "cuFileBufDeregister"):
        getattr(L, fn).restype = _Status
    L.cuFileHandleRegister.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(_Descr)]
    L.cuFileBufRegister.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    L.cuFileBufDeregister.argtypes = [ctypes.c_void_p]
    L.cuFileHandleDeregister.argtypes = [ctypes.c_void_p]
    L.cuFileHandleDeregister.restype = None
    L.cuFileRead.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int64, ctypes.c_int64]
    L.cuFileRead.restype = ctypes.c_ssize_t
    _cf = L
    return L


def _ok(st: _Status, what: str) -> None:
    if st.err:
        cu = f", CUresult {st.cu_err}" if st.cu_err else ""
        raise RouteUnavailable(f"{what} failed (cuFile error {st.err}{cu})")


def driver_open() -> str:
    _ok(load().cuFileDriverOpen(), "cuFileDriverOpen")
    return "driver opened (GDS or compatibility mode)"


def register_fd(fd: int) -> ctypes.c_void_p:
    d = _Descr(_OPAQUE_FD, _Handle(fd=fd), None)
    h = ctypes.c_void_p()
    _ok(load().cuFileHandleRegister(ctypes.byref(h), ctypes.byref(d)), "cuFileHandleRegister of an O_DIRECT file")
    return h


def probe(directory: Path) -> Probe:
    def handle_step() -> str:
        fd, name = tempfile.mkstemp(dir=directory, prefix=".kmesh-probe-")
        try:
            os.write(fd, b"\0" * ALIGNMENT)
            os.close(fd)
            d = os.open(name, os.O_RDONLY | os.O_DIRECT)
            try:
                load().cuFileHandleDeregister(register_fd(d))
            finally:
                os.close(d)
        finally:
            os.unlink(name)
        return f"file handle registered in {directory}"

    return run_steps(Probe("cufile"), [("CUDA driver", cuda_driver_step), ("PyTorch CUDA", torch_cuda_step),
                                       ("libcufile", lambda: load()._name), ("cuFileDriverOpen", driver_open),
                                       ("cuFileHandleRegister", handle_step)])


class Handles:
    """cuFile handles of open descriptors. A handle belongs to the open file it was registered for, but a
    closed descriptor's number is reused by the next open: so a handle is keyed by the descriptor AND the
    file's identity (device, inode), and forget() deregisters it before the caller closes the descriptor."""

    def __init__(self, register: Callable[[int], object], deregister: Callable[[object], None]):
        self._register, self._deregister = register, deregister
        self._by_fd: dict[int, tuple[tuple[int, int], object]] = {}

    def get(self, fd: int):
        st = os.fstat(fd)
        ident = (st.st_dev, st.st_ino)
        known = self._by_fd.get(fd)
        if known is not None and known[0] == ident:
            return known[1]
        self.forget(fd)  # the number now names another file: the handle it had is stale
        h = self._register(fd)
        self._by_fd[fd] = (ident, h)
        return h

    def forget(self, fd: int) -> None:
        known = self._by_fd.pop(fd, None)
        if known is not None:
            self._deregister(known[1])

    def close(self) -> None:
        for fd in list(self._by_fd):
            self.forget(fd)


class CufileRoute(Route):
    name = "cufile"
    gpu = True
    arena: GpuArena | None = None
    pool: ThreadPoolExecutor | None = None
    _buf_registered = False

    def __init__(self, max_bytes: int, depth: int = 8, num_workers: int = 1):
        self.max_bytes, self.depth = max_bytes, depth
        self.handles = Handles(register_fd, lambda h: load().cuFileHandleDeregister(h))
        try:  # a failure part-way releases what was built (close() skips the rest)
            self.arena = GpuArena(max_bytes)
            driver_open()
            _ok(load().cuFileBufRegister(self.arena.address, max_bytes, 0), "cuFileBufRegister of the arena")
            self._buf_registered = True
            self.pool = ThreadPoolExecutor(max_workers=depth)
        except BaseException:
            self.close()
            raise

    def poison(self, n: int) -> None:
        self.arena.poison(n, GPU_POISON)

    def _read(self, s: np.ndarray, i: int, fh, size: int, file_offset: int, buf_offset: int) -> None:
        s["submit_ns"][i] = now_ns()
        s["result"][i] = load().cuFileRead(fh, self.arena.address, size, file_offset, buf_offset)
        s["complete_ns"][i] = now_ns()
        s["num_sqes"][i] = 1

    def restore(self, chunks: np.ndarray) -> Restored:
        fh = {int(fd): self.handles.get(int(fd)) for fd in np.unique(chunks["fd"])}
        s = np.zeros(len(chunks), dtype=SAMPLE_DTYPE)
        t0 = now_ns()
        futs = [self.pool.submit(self._read, s, i, fh[int(c["fd"])], int(c["size"]), int(c["file_offset"]),
                                 int(c["buf_offset"])) for i, c in enumerate(chunks)]
        for f in futs:
            f.result()
        io_done = now_ns()
        r = Restored(s, t0, io_done)
        r.consumer_done_ns, total = self.arena.consume(int(chunks["size"].sum()))
        r.consumer_sum = int(total.item())
        return r

    def fetch(self, n: int) -> np.ndarray:
        return self.arena.fetch(n)

    def forget(self, fd: int) -> None:
        self.handles.forget(fd)

    def ownership(self) -> Ownership:
        # cuFileRead is synchronous and hides its bounce buffers: there is no owner to observe, so this is
        # reported as not measured rather than as counters that rise together and always "drain".
        return NOT_MEASURED

    def close(self) -> Ownership:
        if self.pool is not None:
            self.pool.shutdown(wait=True)
            self.pool = None
        self.handles.close()
        if self._buf_registered:
            load().cuFileBufDeregister(self.arena.address)
            self._buf_registered = False
        if self.arena is not None:
            self.arena.close()
            self.arena = None
        return NOT_MEASURED
