"""The ctypes binding of the native replay library (native/replay.c, built by setup.py).

It owns loading the shared object, the C structures (chunks in, samples out) and `Ring`, a context
manager over one engine instance (rings, registered buffers, the optional GPU copy hook). Nothing here
decides what to read or checks payloads; that is kmesh_trace.native.runner's job.

The record layouts below mirror struct kr_chunk and struct kr_sample by hand; loading the library
compares them with the layout the C reports (`kr_layout`: each structure's size, each field's offset
and size) and refuses a mismatch with `LayoutMismatchError`, so a stale build or an edit on one side
only cannot pass misread records across (the binding style of every native library:
`kmesh_trace.native.binding`). Return codes are read through kmesh_trace.native.codes.

`kr_register_dmabuf` speaks a proposed, unmerged io_uring ABI (see the NOTE in native/replay.c);
`dmabuf_abi_from_header()` says whether its constants came from the kernel header the library was built
against or are replay.c's own reading of the proposal.
"""

from __future__ import annotations

import ctypes
import errno
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kmesh_trace.errors import KmeshTraceError
from kmesh_trace.native import binding
from kmesh_trace.native.binding import LayoutMismatchError, layout_problems  # noqa: F401 (named here too)
from kmesh_trace.native.built import built_path, find_built
from kmesh_trace.native.codes import NativeCode, errno_code, failure

# One chunk in (struct kr_chunk) and one sample out (struct kr_sample), as numpy records so a whole
# restore crosses the boundary as two arrays and results become Parquet columns without a Python loop.
CHUNK_DTYPE = np.dtype([("fd", "<i4"), ("buf_index", "<i4"), ("file_offset", "<i8"), ("size", "<i8"),
                        ("buf_offset", "<i8")])
SAMPLE_DTYPE = np.dtype([("submit_ns", "<i8"), ("complete_ns", "<i8"), ("result", "<i8"), ("worker", "<i4"),
                         ("num_sqes", "<i4"), ("copy_result", "<i4"), ("pad", "<i4")])


# The C structure each record layout mirrors.
MIRRORED = {"kr_chunk": CHUNK_DTYPE, "kr_sample": SAMPLE_DTYPE}


class NativeError(KmeshTraceError):
    """The native engine refused an operation (the message names the code; `code` holds it, if any)."""

    def __init__(self, message: str, code: NativeCode | None = None):
        super().__init__(message)
        self.code = code


def _find_library() -> Path | None:
    return find_built("_kmesh_replay", "KMESH_NATIVE_LIB")


_lib: ctypes.CDLL | None = None


def lib() -> ctypes.CDLL:
    """The loaded engine; raises MissingDependencyError with the build command when it was not built."""
    global _lib
    if _lib is not None:
        return _lib
    path = built_path("_kmesh_replay", "KMESH_NATIVE_LIB", "the native replay library")
    L = ctypes.CDLL(str(path))
    _declare(L, path)
    check_layouts(c_layouts(L), path)
    _lib = L
    return L


def _declare(L: ctypes.CDLL, path: Path | str) -> None:
    """Give every entry point its C signature; a library without one was built from another replay.c."""
    vp, i32, u32, i64, u64 = ctypes.c_void_p, ctypes.c_int32, ctypes.c_uint32, ctypes.c_int64, ctypes.c_uint64
    p64 = ctypes.POINTER(ctypes.c_int64)
    sigs = {
        "kr_cuda_load": ([], i32),
        "kr_cuda_host_register": ([vp, ctypes.c_size_t], i32),
        "kr_cuda_host_unregister": ([vp], i32),
        "kr_now_ns": ([], i64),
        "kr_probe_io_uring": ([], i32),
        "kr_open": ([u32, u32, ctypes.POINTER(vp)], i32),
        "kr_register_buffers": ([vp, ctypes.POINTER(vp), ctypes.POINTER(u64), u32], i32),
        "kr_unregister_buffers": ([vp], i32),
        "kr_register_sparse": ([vp, u32], i32),
        "kr_register_dmabuf": ([vp, u32, i32, i32, u64], i32),
        "kr_attach_cuda": ([vp, u64, vp], i32),
        "kr_detach_cuda": ([vp], None),
        "kr_close": ([vp], None),
        "kr_restore": ([vp, vp, u32, vp, p64], i32),
        "kr_ring_state": ([vp, p64, p64, p64, p64], None),
        "kr_layout": ([u32, ctypes.POINTER(ctypes.c_char_p), ctypes.POINTER(ctypes.c_char_p),
                       ctypes.POINTER(u64), ctypes.POINTER(u64)], i32),
        "kr_dmabuf_abi": ([], u32),
    }
    binding.declare_all(L, sigs, lambda name: NativeError(
        f"{path} has no entry point {name}: it was built from another native/replay.c; rebuild it "
        "(`pip install -e .`) from this checkout"))


def c_layouts(L: ctypes.CDLL) -> dict[str, dict]:
    """What the library says of its structures: {type: {"size": n, "fields": {field: (offset, size)}}}."""
    return binding.c_layouts(L.kr_layout)


def check_layouts(c: dict[str, dict], path: Path | str = "the native library", mirrored: dict | None = None) -> None:
    """Raise LayoutMismatchError naming every difference between the C structures and their mirrors."""
    binding.check_layouts(c, MIRRORED if mirrored is None else mirrored, path, "native/replay.c",
                          "kmesh_trace.native._lib")


def dmabuf_abi_from_header() -> dict[str, bool]:
    """Whether each constant of the proposed (unmerged) io_uring DMA-BUF registration came from the kernel
    header the library was built against (True) or is replay.c's own value (False)."""
    bits = lib().kr_dmabuf_abi()
    return {"IORING_RSRC_F_EXTENDED_UPDATE": bool(bits & 1), "IORING_BUF_TYPE_DMABUF": bool(bits & 2)}


def strerror(rc: int) -> str:
    """`-errno` from the engine as text (EINVAL: Invalid argument)."""
    return str(errno_code(rc))


def _check(rc: int, what: str) -> None:
    if rc < 0:
        code = errno_code(rc)
        raise NativeError(failure(what, code), code)


def now_ns() -> int:
    """CLOCK_MONOTONIC in ns, the same clock the engine stamps samples with."""
    return lib().kr_now_ns()


def probe_io_uring() -> int:
    """0 when io_uring rings and IORING_OP_READ_FIXED work here, else -errno."""
    return lib().kr_probe_io_uring()


@dataclass(frozen=True)
class Ownership:
    """Drained-ownership proof: every slot acquired was released and the kernel owns nothing.

    A route that cannot observe its buffers' owner (cuFile reads are opaque) reports every field as None:
    `drained` is then None, "not measured", never a proof."""

    num_acquired: int | None = None
    num_released: int | None = None
    num_inflight: int | None = None
    num_cq_pending: int | None = None

    @property
    def drained(self) -> bool | None:
        if self.num_acquired is None:
            return None
        return self.num_acquired == self.num_released and self.num_inflight == 0 and self.num_cq_pending == 0


NOT_MEASURED = Ownership()


class Ring:
    """One engine instance: `num_workers` io_uring rings of `depth` entries each."""

    def __init__(self, depth: int = 8, num_workers: int = 1):
        self._L = lib()
        self._ctx = ctypes.c_void_p()
        _check(self._L.kr_open(depth, num_workers, ctypes.byref(self._ctx)), "io_uring setup")
        self.depth, self.num_workers = depth, num_workers

    @property
    def ctx(self) -> ctypes.c_void_p:
        """The live engine context; a closed ring refuses (the C side would dereference NULL)."""
        if not self._ctx:
            raise NativeError("this io_uring ring is closed; open a new Ring")
        return self._ctx

    def register_buffers(self, addrs: list[int], lens: list[int]) -> None:
        n = len(addrs)
        a = (ctypes.c_void_p * n)(*addrs)
        sz = (ctypes.c_uint64 * n)(*lens)
        _check(self._L.kr_register_buffers(self.ctx, a, sz, n), "registering fixed buffers with io_uring")

    def unregister_buffers(self) -> None:
        _check(self._L.kr_unregister_buffers(self.ctx), "unregistering fixed buffers")

    def register_sparse(self, n: int) -> int:
        return self._L.kr_register_sparse(self.ctx, n)

    def register_dmabuf(self, slot: int, dmabuf_fd: int, target_fd: int, length: int) -> int:
        return self._L.kr_register_dmabuf(self.ctx, slot, dmabuf_fd, target_fd, length)

    def attach_cuda(self, dev_base: int, stream: int) -> int:
        return self._L.kr_attach_cuda(self.ctx, dev_base, ctypes.c_void_p(stream))

    def detach_cuda(self) -> None:
        self._L.kr_detach_cuda(self.ctx)

    def restore(self, chunks: np.ndarray) -> tuple[np.ndarray, int]:
        """Read every chunk; returns (samples, io_done_ns). Per-chunk failures are in samples['result']."""
        # Checked with a raise, not an assert (`python -O` drops asserts): the C side reads raw memory.
        if chunks.dtype != CHUNK_DTYPE or not chunks.flags.c_contiguous:
            raise NativeError(f"restore needs a C-contiguous array of CHUNK_DTYPE records (got dtype {chunks.dtype}, "
                              f"{'' if chunks.flags.c_contiguous else 'not '}contiguous)")
        samples = np.zeros(len(chunks), dtype=SAMPLE_DTYPE)
        done = ctypes.c_int64()
        rc = self._L.kr_restore(self.ctx, chunks.ctypes.data, len(chunks), samples.ctypes.data, ctypes.byref(done))
        if rc == -errno.EBADFD:
            raise NativeError("io_uring restore refused: an earlier ring failure left reads this ring could not "
                              "reap (the kernel may still write into its buffers); close it and open a new one",
                              errno_code(rc))
        _check(rc, "io_uring restore")
        return samples, done.value

    def ownership(self) -> Ownership:
        v = [ctypes.c_int64() for _ in range(4)]
        self._L.kr_ring_state(self.ctx, *[ctypes.byref(x) for x in v])
        return Ownership(*(x.value for x in v))

    def close(self) -> None:
        if self._ctx:
            self._L.kr_close(self._ctx)
            self._ctx = ctypes.c_void_p()

    def __enter__(self) -> "Ring":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


HUGE_PAGE = 2 << 20  # a transparent huge page (x86-64, arm64 with 4 KiB pages)


def _advise_huge(m) -> bool:
    """MADV_HUGEPAGE on mapping `m`; False where this kernel or Python has no such advice."""
    import mmap

    try:
        m.madvise(mmap.MADV_HUGEPAGE)
    except (AttributeError, OSError):
        return False
    return True


class HostArena:
    """Page-aligned anonymous memory (mmap), viewed as a numpy uint8 array; the io_uring destination.

    An arena of a huge page or more starts on a huge-page boundary and is advised MADV_HUGEPAGE: where
    the kernel grants huge pages, the registered buffer is physically contiguous in 2 MiB runs, so one
    large read becomes a few block requests instead of one per 254 scattered 4 KiB pages (max_segments
    of a virtio disk). `huge=False` keeps plain pages (a kernel without THP gives plain pages anyway)."""

    def __init__(self, num_bytes: int, huge: bool = True):
        import mmap

        self.num_bytes = num_bytes
        size = max(num_bytes, mmap.PAGESIZE)
        pad = HUGE_PAGE if huge and size >= HUGE_PAGE else 0
        self._map = mmap.mmap(-1, size + pad, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        base = np.frombuffer(self._map, dtype=np.uint8, count=1).ctypes.data
        self.array = np.frombuffer(self._map, dtype=np.uint8, count=num_bytes, offset=-base % HUGE_PAGE if pad else 0)
        self.address = self.array.ctypes.data
        if self.address % mmap.PAGESIZE:  # mmap gives page-aligned memory; O_DIRECT reads need it
            raise NativeError(f"host arena at {self.address:#x} is not page aligned ({mmap.PAGESIZE} bytes)")
        self.huge = bool(pad) and _advise_huge(self._map)

    def close(self) -> None:
        self.array = None
        try:
            self._map.close()
        except BufferError:
            pass  # a caller still holds a view (fetched bytes); the mapping goes with the last view
