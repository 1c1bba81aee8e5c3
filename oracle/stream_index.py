"""Compiled helpers that flatten a workload into its `AccessStream` (oracle/stream.py) in linear passes.

Kept apart from oracle/stream.py so that the modules which only need `RequestBlocks` load no kernel. One
stable sort of the block hashes gives both the dense object ids (the rank of each hash among the distinct
ones, as `np.unique(..., return_inverse=True)` numbers them) and every access's next use (accesses of one
hash are adjacent in that order, in stream order), instead of one sort for each. The passes are C
(native/kernels/stream_index.c); `tests/test_stream_index.py` compares them with numpy's own answers.
"""

from __future__ import annotations

import numpy as np

from kmesh_trace.native.kernels import I64, P, check, declare, ptr

_leading = declare("ks_stream_leading_flags", [P, I64, P, P])
_dense = declare("ks_stream_dense_ids", [P, P, I64, P, P, P, P, I64], I64)


def leading_flags(req_start: np.ndarray, n_first: np.ndarray) -> np.ndarray:
    """One bool per access: it is among the first `n_first[r]` accesses of its request r."""
    req_start = np.ascontiguousarray(req_start, np.int64)
    n_first = np.ascontiguousarray(n_first, np.int64)
    out = np.empty(int(req_start[-1]), np.bool_)
    _leading(ptr(req_start, np.int64), len(req_start) - 1, ptr(n_first, np.int64), ptr(out, np.bool_))
    return out


def dense_ids_and_next_uses(hashes, order, eligible, obj, next_use, never) -> int:
    """Fill `obj` (int32 or int64: the rank of each access's hash among the distinct hashes) and `next_use`
    (the position of the next access of the same hash when that access is eligible, else `never`) from
    `order`, a stable argsort of `hashes`; returns the number of distinct hashes."""
    hashes = np.ascontiguousarray(hashes).view(np.uint64) if hashes.dtype.itemsize == 8 else hashes.astype(np.uint64)
    order = np.ascontiguousarray(order, np.int64)
    eligible = np.ascontiguousarray(eligible, np.bool_)
    o32 = ptr(obj, np.int32) if obj.dtype == np.int32 else None
    o64 = None if o32 is not None else ptr(obj, np.int64)
    return check(_dense(ptr(hashes, np.uint64), ptr(order, np.int64), len(hashes), ptr(eligible, np.bool_), o32, o64,
                        ptr(next_use, np.int64), int(never)), "dense ids")
