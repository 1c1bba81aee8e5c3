"""Replay routes behind one small interface, their registry, and probing.

A route owns its destination (registered host buffers, a GPU arena or both), poisons it, restores one
journal restore into it and hands the bytes back for verification. `host` and `host_fixed` live here;
`cufile` and `dmabuf_fixed` in their own modules; what they all share (the `Route` interface, `Probe`)
is native/route_base.py, below every route. Every route is probed before use: a probe walks the
route's preconditions in order and reports the first that failed, never guessing.
"""

from __future__ import annotations

import mmap
import os
import tempfile
from pathlib import Path
from typing import Callable

import numpy as np

from kmesh_trace.errors import KmeshTraceError
from kmesh_trace.native import _lib
from kmesh_trace.native._lib import HostArena, Ownership, Ring, now_ns
from kmesh_trace.native.codes import cuda_code, failure
from kmesh_trace.native.gpu import GpuArena, RouteUnavailable
from kmesh_trace.native.route_base import (GPU_POISON, HOST_POISON, Probe, Restored, Route, Step, cuda_driver_step,
                                           run_steps, torch_cuda_step)
from kmesh_trace.native.store import ALIGNMENT

__all__ = ["GPU_POISON", "HOST_POISON", "ROUTES", "HostFixedRoute", "HostRoute", "Probe", "Restored", "Route",
           "Step", "make_route", "probe_route", "run_steps"]

class HostRoute(Route):
    """io_uring O_DIRECT reads into one registered, page-aligned host buffer (CPU only)."""

    name = "host"
    host: HostArena | None = None
    huge_pages = True  # the arena asks for transparent huge pages (HostArena)

    def __init__(self, max_bytes: int, depth: int = 8, num_workers: int = 1):
        try:
            super().__init__(max_bytes, depth, num_workers)
            self.host = HostArena(max_bytes, self.huge_pages)
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
