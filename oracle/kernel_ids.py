"""The id width of the oracle's C kernels that are compiled once per width (native/kernels/policies.c,
curves.c): 32-bit object ids and positions while the stream is short enough, else 64-bit.

The 32-bit build also stores positions (touch times, next uses, n + t keys) in its id type, so it is taken
only when the stream has fewer than 2^30 accesses and its ids are int32 (`AccessStream` keeps them int32
while they fit); otherwise the ids are widened for the 64-bit build.
"""

from __future__ import annotations

import ctypes

import numpy as np

from kmesh_trace.native.kernels import I64, Ptr, Struct, check, declare
from kmesh_trace.oracle.interruptible import run_interruptible
from kmesh_trace.oracle.stream import NEVER, AccessStream


class AccessStreamStruct(Struct):
    """struct ks_access_stream (native/kernels/boundary.h): the stream as the policies and curves read it."""

    c_type = "ks_access_stream"
    _fields_ = [("obj32", Ptr(np.int32)), ("obj64", Ptr(np.int64)), ("eligible", Ptr(np.bool_)),
                ("next_use", Ptr(np.int64)), ("req_start", Ptr(np.int64)), ("num_requests", I64),
                ("num_objects", I64), ("never", I64)]

    @classmethod
    def over(cls, obj, eligible, next_use, req_start, num_objects: int, never: int = NEVER) -> AccessStreamStruct:
        """The arrays (obj int32 or int64, C-contiguous) as the kernel of obj's width reads them."""
        return cls.of(obj32=obj if obj.dtype == np.int32 else None, obj64=None if obj.dtype == np.int32 else obj,
                      eligible=eligible, next_use=next_use, req_start=req_start, num_requests=len(req_start) - 1,
                      num_objects=int(num_objects), never=int(never))


def declare_widths(name: str, argtypes: list, restype=None) -> dict[str, object]:
    """The entry points `name`_i32 and `name`_i64, by width: each takes the stream (`AccessStreamStruct`),
    then `argtypes`."""
    stream = ctypes.POINTER(AccessStreamStruct)
    return {w: declare(f"{name}_{w}", [stream, *argtypes], restype) for w in ("i32", "i64")}


def kernel_stream(stream: AccessStream) -> tuple[str, AccessStreamStruct]:
    """(the kernel's width, the stream as it reads it): `kernel_arrays`' arrays in an `AccessStreamStruct`."""
    width, obj, eligible, next_use, req_start = kernel_arrays(stream)
    return width, AccessStreamStruct.over(obj, eligible, next_use, req_start, stream.num_objects)


def kernel_arrays(stream: AccessStream) -> tuple[str, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(the kernel's width, and the ids, eligible flags, next uses and request offsets it reads): each
    C-contiguous in the dtype the kernel reads, the stream's own arrays when they already are."""
    obj = stream.obj
    if obj.dtype == np.int32 and 2 * len(obj) < 2**31:
        width, obj = "i32", np.ascontiguousarray(obj)
    else:
        width, obj = "i64", np.ascontiguousarray(obj, np.int64)
    return (width, obj, np.ascontiguousarray(stream.eligible, np.bool_),
            np.ascontiguousarray(stream.next_use, np.int64), np.ascontiguousarray(stream.req_start, np.int64))


def replay_at(kernels: dict, stream: AccessStream, capacity: int, what: str) -> tuple[np.ndarray, int]:
    """A per-capacity policy kernel of native/kernels/policies_body.h on `stream` (declared by
    `declare_widths`): (per-request hit blocks, evictions)."""
    width, args = kernel_stream(stream)
    hits = np.zeros(stream.num_requests, np.int64)
    evictions = run_interruptible(kernels[width], ctypes.byref(args), int(capacity), hits.ctypes.data)
    return hits, check(evictions, what)
