"""The ctypes binding of the compiled analysis kernels (native/kernels/*.c, built by setup.py).

The kernels of the oracle (stream flattening, curves, policies, the engine model) are C compiled when
the package is installed, so an analysis needs no compiler at run time: loading them costs a `dlopen`,
not a JIT's import and cache. `lib()` loads the shared object once; `declare` gives an entry point its
C signature; `ptr` hands a numpy array across after checking what the C side assumes of it (its dtype
and C-contiguity), so a wrong array is a `TypeError` here, never memory misread there. An entry with
many parameters takes a structure of inputs and one of outputs (native/kernels/boundary.h), each
mirrored once as a `Struct` beside its caller; `declare` compares every structure an entry takes with the
library's layout table (`ks_layout`) and refuses a mismatch (`LayoutMismatchError`): the binding style of
native/replay.c's engine too (`kmesh_trace.native.binding`). ctypes releases the GIL around every call,
so a kernel can run on a worker thread (`oracle.interruptible`) or beside another kernel on a second core.

Every kernel keeps a plain reference (Python, in the tree or in tests/) that the tests compare it with.
"""

from __future__ import annotations

import ctypes

from kmesh_trace.errors import MissingDependencyError
from kmesh_trace.native import binding
from kmesh_trace.native.binding import LayoutMismatchError, Ptr, Struct, ptr  # noqa: F401 (the kernels' names)
from kmesh_trace.native.built import built_path

#: ctypes types for `declare` signatures: `P` is any array (through `ptr`), the rest scalars.
P, I32, I64, U64, F64 = ctypes.c_void_p, ctypes.c_int32, ctypes.c_int64, ctypes.c_uint64, ctypes.c_double

#: What a kernel returns when an allocation failed (KS_ENOMEM in native/kernels/kernels.h).
ENOMEM = -12


_lib: ctypes.CDLL | None = None
_layouts: dict[str, dict] | None = None

#: glibc's mallopt parameters (malloc.h).
M_MMAP_THRESHOLD, M_ARENA_MAX = -3, -8
#: Buffers from this size on are mapped on their own and unmapped when freed.
MMAP_THRESHOLD = 128 * 1024


def lib() -> ctypes.CDLL:
    """The loaded kernels; raises MissingDependencyError with the build command when they were not built."""
    global _lib
    if _lib is None:
        _lib = ctypes.CDLL(_path())
        return_freed_memory()
    return _lib


def return_freed_memory() -> None:
    """Have glibc give a kernel's freed working arrays back to the system: every thread on one malloc arena,
    and large buffers mapped on their own at a fixed threshold. By default glibc serves a worker thread from
    an arena of its own, keeps what it frees there, and raises its mapping threshold after the first large
    free, so the peak memory of an analysis grew with every thread that ran a kernel (the lru curve of the
    Mooncake trace: +11 MB on a thread against +4 MB on the main thread). No effect without glibc."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    mallopt(M_ARENA_MAX, 1)
    mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)


def declare(name: str, argtypes: list, restype=None):
    """The entry point `name` with its C signature (restype None: void); the `Struct`s it takes (by pointer:
    `ctypes.POINTER(S)`) are checked against the library's layout table first."""
    structs = binding.structs_in(argtypes)
    if structs:
        binding.check_layouts(layouts(), {s.c_type: s for s in structs}, _path(), "native/kernels/boundary.h",
                              "its mirror in Python")
    return binding.declare_all(lib(), {name: (argtypes, restype)}, _stale)


def layouts() -> dict[str, dict]:
    """The kernels' structures as the library describes them (`ks_layout`, native/kernels/layout.c)."""
    global _layouts
    if _layouts is None:
        row = binding.declare_all(lib(), {"ks_layout": ([I64, ctypes.POINTER(ctypes.c_char_p),
                                                         ctypes.POINTER(ctypes.c_char_p), ctypes.POINTER(U64),
                                                         ctypes.POINTER(U64)], I64)}, _stale)
        _layouts = binding.c_layouts(row)
    return _layouts


def _path() -> str:
    return str(built_path("_kmesh_kernels", "KMESH_KERNELS_LIB", "the compiled kernels library"))


def _stale(name: str) -> MissingDependencyError:
    return MissingDependencyError(
        f"the compiled kernels have no entry point {name}: they were built from other sources; rebuild "
        "them (`pip install -e .`) from this checkout")


def check(result: int, what: str) -> int:
    """`result` of a kernel that returns a count or a negative code; MemoryError on KS_ENOMEM."""
    if result == ENOMEM:
        raise MemoryError(f"{what}: the kernel could not allocate its working memory")
    return result
