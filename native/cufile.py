"""The `cufile` route: GPUDirect Storage reads (cuFile, or its compatibility mode) into the GPU arena.

libcufile is loaded with ctypes at run time (from the system, the CUDA toolkit or the `nvidia-cufile`
wheel). Its probe opens the driver and registers an O_DIRECT file handle in the store's directory.

Two modes, chosen before the library reads its configuration (`KMESH_CUFILE_MODE`, default `auto`):

- `gds`: true GPUDirect Storage, DMA from storage into GPU memory through the `nvidia-fs` kernel module;
- `compat`: cuFile's compatibility mode (POSIX reads into cuFile's own host bounce buffers, then copies
  to the GPU), forced with `CUFILE_FORCE_COMPAT_MODE=true` and a private `cufile.json` (named by
  `CUFILE_ENV_PATH_JSON`) that allows it. Hosts without `nvidia-fs`, or whose disk cuFile cannot
  register for GDS (a virtio disk without udev data answers `cuFileHandleRegister` with 5027), can
  still run the route this way.

Either mode registers a file only when udev's database describes the disk it lives on (cuFile reads the
disk's `ID_FS_USAGE` from `/run/udev/data/b<major>:<minor>`, and answers `cuFileHandleRegister` with 5027
when it is missing). A host that runs no udev (a minimal VM) has no such record: the probe says so, and
with `KMESH_CUFILE_UDEV=write` (root) kmesh-trace writes the two properties udev's blkid builtin would
have written (`ID_FS_USAGE=filesystem`, `ID_FS_TYPE` from the mount table) before registering.

`auto` picks `gds` when the `nvidia-fs` module is loaded (`/proc/driver/nvidia-fs` exists) and `compat`
otherwise. A user's own `CUFILE_ENV_PATH_JSON` is respected. The mode that ran is reported by the probe
and in the run summary (`routes.cufile.mode`). cuFileRead is synchronous, so `depth` threads keep that
many reads in flight. Buffer ownership is not observable through cuFile, so the route reports it as not
measured.
"""

from __future__ import annotations

import ctypes
import json
import os
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable

import numpy as np

from kmesh_trace.native._lib import NOT_MEASURED, SAMPLE_DTYPE, Ownership, now_ns
from kmesh_trace.native.codes import cufile_code, failure
from kmesh_trace.native.gpu import GpuArena, RouteUnavailable
from kmesh_trace.native.route_base import (GPU_POISON, Probe, Restored, Route, cuda_driver_step, run_steps,
                                           torch_cuda_step)
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
_mode: str | None = None
MODES = ("auto", "gds", "compat")
NVIDIA_FS = Path("/proc/driver/nvidia-fs")


def choose_mode(requested: str | None = None) -> str:
    """`gds` or `compat` for `requested` (default: `KMESH_CUFILE_MODE`, else `auto`)."""
    requested = (requested or os.environ.get("KMESH_CUFILE_MODE") or "auto").strip().lower()
    if requested not in MODES:
        raise RouteUnavailable(f"KMESH_CUFILE_MODE must be one of {', '.join(MODES)} (got {requested!r})")
    if requested == "auto":
        return "gds" if NVIDIA_FS.exists() else "compat"
    return requested


def _configure_compat() -> None:
    """Force compatibility mode for this process; must run before libcufile is loaded."""
    os.environ["CUFILE_FORCE_COMPAT_MODE"] = "true"
    if "CUFILE_ENV_PATH_JSON" not in os.environ:  # a user's own configuration wins
        d = tempfile.mkdtemp(prefix="kmesh-cufile-")
        cfg = Path(d) / "cufile.json"
        cfg.write_text(json.dumps({"logging": {"dir": d, "level": "ERROR"},
                                   "properties": {"allow_compat_mode": True}}))
        os.environ["CUFILE_ENV_PATH_JSON"] = str(cfg)


def mode() -> str:
    """The mode this process runs cuFile in (fixed at the first load)."""
    return _mode if _mode is not None else choose_mode()


def mode_step() -> str:
    m = mode()
    if m == "gds":
        return "gds (nvidia-fs loaded: DMA from storage into GPU memory)"
    return ("compat (no nvidia-fs module, or compat asked for: POSIX reads into cuFile's host bounce buffers, "
            "then copies to the GPU)")


UDEV_DATA = Path("/run/udev/data")


def _fs_type(directory: Path) -> str | None:
    """The filesystem type of the mount holding `directory` (the longest matching mount point)."""
    best, fstype = "", None
    target = str(directory.resolve())
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        left, _, right = line.partition(" - ")
        mnt = left.split()[4].replace("\\040", " ")
        if (target == mnt or target.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best):
            best, fstype = mnt, right.split()[0]
    return fstype


def udev_step(directory: Path) -> str:
    """cuFile needs udev's record of the disk under `directory`; check it (or write it when asked)."""
    dev = os.stat(directory).st_dev
    major, minor = os.major(dev), os.minor(dev)
    if major == 0:
        raise RouteUnavailable(f"{directory} is not on a block device (device {major}:{minor}); cuFile registers "
                               "only files on a disk")
    record = UDEV_DATA / f"b{major}:{minor}"
    if record.exists() and "ID_FS_USAGE=" in record.read_text(errors="replace"):
        return f"udev describes the disk ({record})"
    if os.environ.get("KMESH_CUFILE_UDEV", "").strip().lower() != "write":
        raise RouteUnavailable(f"no udev record of the disk {major}:{minor} ({record} is missing or has no "
                               "ID_FS_USAGE): this host runs no udev; start it, or set KMESH_CUFILE_UDEV=write "
                               "to let kmesh-trace write the record (root)")
    fstype = _fs_type(Path(directory)) or "unknown"
    record.parent.mkdir(parents=True, exist_ok=True)
    with open(record, "a") as f:  # keep whatever a partial record already holds
        f.write(f"E:ID_FS_USAGE=filesystem\nE:ID_FS_TYPE={fstype}\n")
    return f"udev record written by kmesh-trace (KMESH_CUFILE_UDEV=write): {record}, ID_FS_TYPE={fstype}"


def load() -> ctypes.CDLL:
    global _cf, _mode
    if _cf is not None:
        return _cf
    _mode = choose_mode()
    if _mode == "compat":
        _configure_compat()
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
        raise RouteUnavailable(failure(what, cufile_code(st.err, st.cu_err)))


def driver_open() -> str:
    _ok(load().cuFileDriverOpen(), "cuFileDriverOpen")
    return f"driver opened ({mode()} mode)"


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
                                       ("cuFile mode", mode_step),
                                       ("udev record of the disk", lambda: udev_step(directory)),
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
        self.mode = mode()
        self.handles = Handles(register_fd, lambda h: load().cuFileHandleDeregister(h))
        try:  # a failure part-way releases what was built (close() skips the rest)
            self.arena = GpuArena(max_bytes)
            driver_open()
            self.mode = mode()  # fixed by the load that driver_open did
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
