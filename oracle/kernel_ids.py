"""The id width of the oracle's C kernels that are compiled once per width (native/kernels/policies.c,
curves.c): 32-bit object ids and positions while the stream is short enough, else 64-bit.

The 32-bit build also stores positions (touch times, next uses, n + t keys) in its id type, so it is taken
only when the stream has fewer than 2^30 accesses and its ids are int32 (`AccessStream` keeps them int32
while they fit); otherwise the ids are widened for the 64-bit build.
"""

from __future__ import annotations

import numpy as np

from kmesh_trace.native.kernels import check, declare, ptr
from kmesh_trace.oracle.interruptible import run_interruptible
from kmesh_trace.oracle.stream import NEVER, AccessStream


def declare_widths(name: str, argtypes: list, restype=None) -> dict[str, object]:
    """The entry points `name`_i32 and `name`_i64, by width."""
    return {w: declare(f"{name}_{w}", argtypes, restype) for w in ("i32", "i64")}


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


def replay_at(kernels: dict, stream: AccessStream, capacity: int, what: str, *, next_uses: bool = True
              ) -> tuple[np.ndarray, int]:
    """A per-capacity policy kernel of native/kernels/policies_body.h on `stream` (declared by
    `declare_widths`): (per-request hit blocks, evictions). The kernel reads the ids, the eligible flags,
    the next uses when `next_uses`, and the request offsets."""
    width, obj, eligible, next_use, req_start = kernel_arrays(stream)
    hits = np.zeros(stream.num_requests, np.int64)
    head = [ptr(obj, obj.dtype), ptr(eligible, np.bool_)]
    if next_uses:
        head.append(ptr(next_use, np.int64))
    tail = [NEVER] if next_uses else []
    evictions = run_interruptible(kernels[width], *head, ptr(req_start, np.int64), stream.num_requests,
                                  stream.num_objects, int(capacity), *tail, ptr(hits, np.int64))
    return hits, check(evictions, what)
