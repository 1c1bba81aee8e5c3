"""The `dmabuf_fixed` route: storage read by io_uring straight into a GPU arena exported as a DMA-BUF.

The arena is exported with cuMemGetHandleForAddressRange (cuda-python), registered as fixed buffer 0
through the proposed extended IORING_REGISTER_BUFFERS_UPDATE (native/replay.c), and read with
IORING_OP_READ_FIXED from the raw NVMe block device that holds the store, at the device offsets FIEMAP
gives for each chunk. Mainline kernels do not accept that registration yet; the probe walks every
precondition, keeps going after a failure so that each step's answer is on record, and reports the
first that failed. The run path is complete for kernels that have the interface, but it has never run
on one: treat its first results there as a bring-up, not a measurement.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import numpy as np

from kmesh_trace.errors import MissingDependencyError
from kmesh_trace.native import _lib, blockdev
from kmesh_trace.native._lib import CHUNK_DTYPE, Ownership, Ring, now_ns
from kmesh_trace.native.gpu import ARENA_ALIGNMENT, GpuArena, RouteUnavailable
from kmesh_trace.native.route_base import GPU_POISON, Probe, Restored, Route, cuda_driver_step, run_steps
from kmesh_trace.native.store import ALIGNMENT, Chunk


def _driver():
    try:
        from cuda.bindings import driver
    except ImportError as e:
        raise MissingDependencyError("the dmabuf_fixed route needs cuda-python: pip install 'kmesh-trace[gpu]'") from e
    return driver


def _call(fn, *args):
    """cuda-python returns (CUresult, *outputs); raise on an error, return the outputs."""
    res, *outs = fn(*args)
    if int(res) != 0:
        raise RouteUnavailable(f"{fn.__name__} failed ({res.name if hasattr(res, 'name') else int(res)})")
    return outs[0] if len(outs) == 1 else outs


def _context():
    cu = _driver()
    _call(cu.cuInit, 0)
    dev = _call(cu.cuDeviceGet, 0)
    ctx = _call(cu.cuDevicePrimaryCtxRetain, dev)
    _call(cu.cuCtxSetCurrent, ctx)
    return cu, dev


def dmabuf_supported() -> str:
    cu, dev = _context()
    v = _call(cu.cuDeviceGetAttribute, cu.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED, dev)
    if v != 1:
        raise RouteUnavailable("CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED is 0 (the proprietary kernel module does not "
                               "export DMA-BUFs; use the open module)")
    return "CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED = 1"


def export(address: int, size: int) -> int:
    """A DMA-BUF fd for [address, address+size) of device memory (page aligned)."""
    cu = _driver()
    fd = _call(cu.cuMemGetHandleForAddressRange, address, size,
               cu.CUmemRangeHandleType.CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD, 0)
    return int(fd)


def _exporter(fd: int) -> str:
    try:
        info = Path(f"/proc/self/fdinfo/{fd}").read_text()
    except OSError:
        return "?"
    return next((ln.split(":", 1)[1].strip() for ln in info.splitlines() if ln.startswith("exp_name")), "?")


def probe(directory: Path, host: list) -> Probe:
    state: dict = {}

    def export_step() -> str:
        cu, _ = _context()
        ptr = _call(cu.cuMemAlloc, ARENA_ALIGNMENT)
        state["free"] = lambda: cu.cuMemFree(ptr)
        state["fd"] = fd = export(int(ptr), ARENA_ALIGNMENT)
        return f"cuMemGetHandleForAddressRange gave fd {fd} (exp_name {_exporter(fd)})"

    def device_step() -> str:
        if "target" in state:
            return f"{state['target_name']} opened O_DIRECT"
        dev = blockdev.device_of(directory)
        if dev is None:
            raise RouteUnavailable(f"{directory} is on no block device")
        if not dev.is_nvme:
            raise RouteUnavailable(f"{directory} is on {dev.path}, not a raw NVMe block device (the proposed "
                                   f"interface reads NVMe devices opened O_DIRECT)")
        fd = os.open(dev.path, os.O_RDONLY | os.O_DIRECT)
        state["target"], state["target_name"] = fd, str(dev.path)
        return f"{dev.path} opened O_DIRECT"

    def register_step() -> str:
        try:
            device_step()
        except (RouteUnavailable, OSError):
            pass  # recorded by its own step; the kernel is asked against a stand-in file instead
        target = state.get("target")
        stand_in = None
        if target is None:  # still ask the kernel, with an O_DIRECT file standing in for the device
            fd, stand_in = tempfile.mkstemp(dir=directory, prefix=".kmesh-probe-")
            os.write(fd, b"\0" * ALIGNMENT)
            os.close(fd)
            target = os.open(stand_in, os.O_RDONLY | os.O_DIRECT)
        try:
            with Ring(2, 1) as ring:
                rc = ring.register_sparse(1)
                if rc < 0:
                    raise RouteUnavailable(f"sparse buffer table: {_lib.strerror(rc)}")
                rc = ring.register_dmabuf(0, state.get("fd", -1), target, ARENA_ALIGNMENT)
                ring.unregister_buffers()
        finally:
            if stand_in:
                os.close(target)
                os.unlink(stand_in)
        how = (f"against {state['target_name']}" if stand_in is None else "against an O_DIRECT file standing in "
               "for the device") + ("" if "fd" in state else ", with no DMA-BUF to offer (fd -1)")
        if rc < 0:
            raise RouteUnavailable(f"IORING_REGISTER_BUFFERS_UPDATE with a DMA-BUF descriptor: {_lib.strerror(rc)} "
                                   f"({how}); this kernel has no io_uring DMA-BUF registered buffers")
        return f"kernel accepted the DMA-BUF registration ({how})"

    cuda = ("CUDA driver", "cuda-python")
    steps = host + [("CUDA driver", cuda_driver_step), ("cuda-python", lambda: str(_driver().__name__)),
                    ("DMA-BUF supported", dmabuf_supported, cuda), ("DMA-BUF export", export_step, cuda),
                    ("io_uring DMA-BUF registration", register_step, ("io_uring",)),
                    ("raw NVMe block device", device_step)]
    try:
        # Keep going: each answer is worth recording even after the first failure, which `reason` reports.
        return run_steps(Probe("dmabuf_fixed"), steps, keep_going=True)
    finally:
        for k in ("fd", "target"):
            if k in state:
                os.close(state[k])
        if "free" in state:
            state["free"]()


class DmabufRoute(Route):
    name = "dmabuf_fixed"
    gpu = True
    arena: GpuArena | None = None
    dmabuf_fd: int | None = None
    target_fd: int | None = None

    def __init__(self, max_bytes: int, depth: int, num_workers: int, store_dir: Path):
        dev = blockdev.device_of(store_dir)
        if dev is None or not dev.is_nvme:
            raise RouteUnavailable(f"the store {store_dir} is not on a raw NVMe block device")
        size = -(-max_bytes // ARENA_ALIGNMENT) * ARENA_ALIGNMENT
        try:  # a failure part-way releases what was built (close() skips the rest)
            self.arena = GpuArena(size)
            _context()
            self.dmabuf_fd = export(self.arena.address, size)
            self.target_fd = os.open(dev.path, os.O_RDONLY | os.O_DIRECT)
            super().__init__(max_bytes, depth, num_workers)
            rc = self.ring.register_sparse(1)
            if rc >= 0:
                rc = self.ring.register_dmabuf(0, self.dmabuf_fd, self.target_fd, size)
            if rc < 0:
                raise RouteUnavailable(f"io_uring DMA-BUF registration: {_lib.strerror(rc)}")
            self.cu = _driver()
        except BaseException:
            self.close()
            raise

    def chunk_array(self, chunks: list[Chunk], fds: dict[str, int], paths: dict[str, Path]) -> np.ndarray:
        """Device ranges instead of file ranges: a chunk becomes one read per extent it spans."""
        rows, off = [], 0
        for c in chunks:
            for file_off, dev_off, length in blockdev.extents(paths[c.file], c.offset_bytes, c.size_bytes):
                if dev_off % ALIGNMENT or length % ALIGNMENT:
                    raise RouteUnavailable(f"{c.chunk_key}: extent at device offset {dev_off} is not "
                                           f"{ALIGNMENT}-aligned")
                rows.append((self.target_fd, 0, dev_off, length, off + file_off - c.offset_bytes))
            off += c.size_bytes
        return np.array(rows, dtype=CHUNK_DTYPE)

    def poison(self, n: int) -> None:
        self.arena.poison(n, GPU_POISON)

    def restore(self, chunks: np.ndarray) -> Restored:
        t0 = now_ns()
        samples, io_done = self.ring.restore(chunks)
        r = Restored(samples, t0, io_done)
        # Storage DMA into device memory must be made visible to kernels before the consumer reads it.
        _call(self.cu.cuFlushGPUDirectRDMAWrites,
              self.cu.CUflushGPUDirectRDMAWritesTarget.CU_FLUSH_GPU_DIRECT_RDMA_WRITES_TARGET_CURRENT_CTX,
              self.cu.CUflushGPUDirectRDMAWritesScope.CU_FLUSH_GPU_DIRECT_RDMA_WRITES_TO_OWNER)
        r.consumer_done_ns, total = self.arena.consume(int(chunks["size"].sum()))
        r.consumer_sum = int(total.item())
        return r

    def fetch(self, n: int) -> np.ndarray:
        return self.arena.fetch(n)

    def close(self) -> Ownership:
        own = super().close()
        for fd in (self.dmabuf_fd, self.target_fd):
            if fd is not None:
                os.close(fd)
        self.dmabuf_fd = self.target_fd = None
        if self.arena is not None:
            self.arena.close()
            self.arena = None
        return own
