"""Replay routes behind one small interface, their registry, and probing.

A route owns its destination (registered host buffers, a GPU arena or both), poisons it, restores one
journal restore into it and hands the bytes back for verification. `host` and `host_fixed` live here;
`cufile` and `dmabuf_fixed` in their own modules. Every route is probed before use: a probe walks the
route's preconditions in order and reports the first that failed, never guessing.
"""

from __future__ import annotations

import mmap
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, ClassVar

import numpy as np

from kmesh_trace.errors import KmeshTraceError
from kmesh_trace.native import _lib
from kmesh_trace.native._lib import CHUNK_DTYPE, NOT_MEASURED, HostArena, Ownership, Ring, now_ns
from kmesh_trace.native.codes import cuda_code, failure
from kmesh_trace.native.gpu import GpuArena, RouteUnavailable
from kmesh_trace.native.store import ALIGNMENT, Chunk

HOST_POISON = 0xA5
GPU_POISON = 0x5A


@dataclass
class Step:
    name: str
    ok: bool
    detail: str = ""


@dataclass
class Probe:
    route: str
    steps: list[Step] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(s.ok for s in self.steps)

    @property
    def reason(self) -> str | None:
        """The first failed precondition, as `step: detail`."""
        bad = next((s for s in self.steps if not s.ok), None)
        return None if bad is None else f"{bad.name}: {bad.detail}" if bad.detail else bad.name

    def as_dict(self) -> dict:
        return {"route": self.route, "status": "ok" if self.ok else "unavailable", "reason": self.reason,
                "steps": [{"step": s.name, "ok": s.ok, "detail": s.detail} for s in self.steps]}


def run_steps(probe: Probe, steps: list[tuple], keep_going: bool = False) -> Probe:
    """Run (name, fn[, needs]) steps; fn returns a detail or raises. Stops at the first failure unless
    keep_going; then a step whose `needs` (names of earlier steps) failed is recorded as not tried."""
    failed: set[str] = set()
    for name, fn, *rest in steps:
        blocked = [n for n in (rest[0] if rest else ()) if n in failed]
        if blocked:
            probe.steps.append(Step(name, False, f"not tried: needs {', '.join(blocked)}"))
            failed.add(name)
            continue
        try:
            probe.steps.append(Step(name, True, fn() or ""))
        except Exception as e:  # a probe reports every failure as data, whatever raised it
            probe.steps.append(Step(name, False, str(e) or type(e).__name__))
            failed.add(name)
            if not keep_going:
                break
    return probe


@dataclass
class Restored:
    """Timing of one restore: samples per chunk (native records), timer 1 and, for GPU routes, timer 2."""

    samples: np.ndarray
    start_ns: int
    io_done_ns: int
    consumer_done_ns: int | None = None
    consumer_sum: int | None = None


class Route:
    """One way to restore a journal restore into a destination; subclasses fill in the destination.

    A constructor that fails part-way calls close() before raising, so close() must tolerate parts that
    were never built (they stay None) and being called twice."""

    name: ClassVar[str]
    gpu: ClassVar[bool] = False
    ring: Ring | None = None

    def __init__(self, max_bytes: int, depth: int, num_workers: int):
        self.max_bytes = max_bytes
        self.ring = Ring(depth, num_workers)

    def chunk_array(self, chunks: list[Chunk], fds: dict[str, int], paths: dict[str, Path]) -> np.ndarray:
        """The native chunk records for one restore: chunks land back to back in the destination."""
        a = np.zeros(len(chunks), dtype=CHUNK_DTYPE)
        off = 0
        for i, c in enumerate(chunks):
            a[i] = (fds[c.file], 0, c.offset_bytes, c.size_bytes, off)
            off += c.size_bytes
        return a

    def poison(self, n: int) -> None:
        raise NotImplementedError

    def restore(self, chunks: np.ndarray) -> Restored:
        raise NotImplementedError

    def fetch(self, n: int) -> np.ndarray:
        raise NotImplementedError

    def forget(self, fd: int) -> None:
        """`fd` is about to be closed: drop anything registered for it (its number will be reused)."""

    def ownership(self) -> Ownership:
        return self.ring.ownership() if self.ring is not None else NOT_MEASURED

    def close(self) -> Ownership:
        """Release everything; returns the ownership state read just before the ring was torn down."""
        own = self.ownership()
        if self.ring is not None:
            self.ring.close()  # unregisters the buffers too, and cannot fail part-way
            self.ring = None
        return own


class HostRoute(Route):
    """io_uring O_DIRECT reads into one registered, page-aligned host buffer (CPU only)."""

    name = "host"
    host: HostArena | None = None

    def __init__(self, max_bytes: int, depth: int = 8, num_workers: int = 1):
        try:
            super().__init__(max_bytes, depth, num_workers)
            self.host = HostArena(max_bytes)
            self.ring.register_buffers([self.host.address], [max_bytes])
        except BaseException:
            self.close()
            raise

    def poison(self, n: int) -> None:
        self.host.array[:n] = HOST_POISON

    def restore(self, chunks: np.ndarray) -> Restored:
        t0 = now_ns()
        samples, io_done = self.ring.restore(chunks)
        return Restored(samples, t0, io_done)

    def fetch(self, n: int) -> np.ndarray:
        return self.host.array[:n]

    def close(self) -> Ownership:
        own = super().close()
        if self.host is not None:
            self.host.close()
            self.host = None
        return own


class HostFixedRoute(HostRoute):
    """`host`, then each completed chunk copied asynchronously from the page-locked buffer to a GPU arena."""

    name = "host_fixed"
    gpu = True
    arena: GpuArena | None = None
    _pinned = False  # the host buffer is registered with CUDA (cuMemHostRegister)

    def __init__(self, max_bytes: int, depth: int = 8, num_workers: int = 1):
        try:
            self.arena = GpuArena(max_bytes)
            super().__init__(max_bytes, depth, num_workers)
            rc = _lib.lib().kr_cuda_host_register(self.host.address, max_bytes)
            if rc:
                raise RouteUnavailable(failure("cuMemHostRegister of the io_uring buffer", cuda_code(rc)))
            self._pinned = True
            rc = self.ring.attach_cuda(self.arena.address, self.arena.stream_handle)
            if rc:
                raise RouteUnavailable(failure("attaching the CUDA copy to the ring", cuda_code(rc)))
        except BaseException:
            self.close()
            raise

    def poison(self, n: int) -> None:
        super().poison(n)  # a stale staging buffer must not be able to hide a failed read
        self.arena.poison(n, GPU_POISON)

    def restore(self, chunks: np.ndarray) -> Restored:
        r = super().restore(chunks)
        n = int(chunks["size"].sum())
        r.consumer_done_ns, total = self.arena.consume(n)
        r.consumer_sum = int(total.item())
        return r

    def fetch(self, n: int) -> np.ndarray:
        return self.arena.fetch(n)

    def close(self) -> Ownership:
        if self.arena is not None:
            self.arena.stream.synchronize()  # every enqueued copy has finished reading the staging buffer
        if self.ring is not None:
            self.ring.detach_cuda()
        if self._pinned:
            _lib.lib().kr_cuda_host_unregister(self.host.address)
            self._pinned = False
        own = super().close()
        if self.arena is not None:
            self.arena.close()
            self.arena = None
        return own


# ---------------------------------------------------------------- probing


def _direct_dir_step(directory: Path) -> Callable[[], str]:
    def step() -> str:
        fd, name = tempfile.mkstemp(dir=directory, prefix=".kmesh-probe-")
        try:
            os.write(fd, b"\0" * ALIGNMENT)
            os.close(fd)
            d = os.open(name, os.O_RDONLY | os.O_DIRECT)
            os.close(d)
        except OSError as e:
            raise OSError(f"O_DIRECT open in {directory} failed ({e.strerror}); put the store on ext4/xfs, "
                          f"not tmpfs") from e
        finally:
            os.unlink(name)
        return str(directory)
    return step


def _engine_step() -> str:
    _lib.lib()
    return str(_lib._find_library())


def _io_uring_step() -> str:
    rc = _lib.probe_io_uring()
    if rc:
        raise OSError(f"io_uring with IORING_OP_READ_FIXED is unavailable ({_lib.strerror(rc)}); check "
                      f"sysctl kernel.io_uring_disabled and seccomp")
    return "READ_FIXED supported"


def _register_step() -> str:
    buf = HostArena(ALIGNMENT)
    try:
        with Ring(2, 1) as ring:
            ring.register_buffers([buf.address], [ALIGNMENT])
            ring.unregister_buffers()
    except KmeshTraceError as e:
        raise OSError(f"{e} (RLIMIT_MEMLOCK is {_memlock()})") from e
    return f"RLIMIT_MEMLOCK {_memlock()}"


def _memlock() -> str:
    import resource

    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    return "unlimited" if soft == resource.RLIM_INFINITY else f"{soft} bytes"


def cuda_driver_step() -> str:
    code = cuda_code(_lib.lib().kr_cuda_load())
    if not code.ok:
        raise OSError(str(code) if code.is_engine_code else failure("cuInit", code))
    return "libcuda.so.1 loaded, cuInit ok"


def torch_cuda_step() -> str:
    from kmesh_trace.native.gpu import torch_cuda

    torch = torch_cuda()
    return f"torch {torch.__version__}, {torch.cuda.get_device_name()}"


def _pin_step() -> str:
    from kmesh_trace.native.gpu import ensure_context

    ensure_context()  # cuMemHostRegister needs a current context (CUDA_ERROR_INVALID_CONTEXT, 201, otherwise)
    buf = HostArena(mmap.PAGESIZE)
    rc = _lib.lib().kr_cuda_host_register(buf.address, mmap.PAGESIZE)
    if rc:
        raise OSError(failure("cuMemHostRegister", cuda_code(rc)))
    _lib.lib().kr_cuda_host_unregister(buf.address)
    return "page-locked io_uring buffers can be registered with CUDA"


def host_steps(directory: Path) -> list[tuple[str, Callable[[], str | None]]]:
    return [("native engine built", _engine_step), ("io_uring", _io_uring_step),
            ("O_DIRECT", _direct_dir_step(directory)), ("registered buffers", _register_step)]


def probe_route(name: str, directory: Path | None = None) -> Probe:
    directory = Path(directory or tempfile.gettempdir()).resolve()
    steps = host_steps(directory)
    if name == "host":
        return run_steps(Probe(name), steps)
    if name == "host_fixed":
        return run_steps(Probe(name), steps + [("CUDA driver", cuda_driver_step), ("PyTorch CUDA", torch_cuda_step),
                                               ("cuMemHostRegister", _pin_step)])
    if name == "cufile":
        from kmesh_trace.native import cufile

        return cufile.probe(directory)
    if name == "dmabuf_fixed":
        from kmesh_trace.native import dmabuf

        return dmabuf.probe(directory, steps)
    raise KmeshTraceError(f"unknown route {name!r}; choose from {', '.join(ROUTES)}")


ROUTES = ("host", "host_fixed", "cufile", "dmabuf_fixed")


def make_route(name: str, max_bytes: int, depth: int, num_workers: int, store_dir: Path) -> Route:
    if name == "host":
        return HostRoute(max_bytes, depth, num_workers)
    if name == "host_fixed":
        return HostFixedRoute(max_bytes, depth, num_workers)
    if name == "cufile":
        from kmesh_trace.native.cufile import CufileRoute

        return CufileRoute(max_bytes, depth, num_workers)
    if name == "dmabuf_fixed":
        from kmesh_trace.native.dmabuf import DmabufRoute

        return DmabufRoute(max_bytes, depth, num_workers, store_dir)
    raise KmeshTraceError(f"unknown route {name!r}; choose from {', '.join(ROUTES)}")
