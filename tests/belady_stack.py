"""The `belady` priority stack itself (oracle/curves.py's kernel before the Critical Stack Algorithm):
O(depth) per access, kept as the reference the one-pass `belady` curve must equal exactly (compiled with
numba here, a test dependency; the product's curves are C, native/kernels/curves.c)."""

from __future__ import annotations

import numba
import numpy as np

from kmesh_trace.oracle.curves import HitCurve, _measured
from kmesh_trace.oracle.stream import NEVER, AccessStream


@numba.njit(cache=True, nogil=True)
def _grown(hist, top):  # pragma: no cover (compiled)
    """`hist` (int64) with room for index `top`: at least twice as long, zeros added."""
    out = np.zeros(max(2 * len(hist), top + 1), np.int64)
    out[:len(hist)] = hist
    return out


@numba.njit(cache=True, nogil=True)
def level_buffers(req_start):  # pragma: no cover (compiled)
    """(count, position-sum histograms, a buffer for one request's hit levels)."""
    longest = 0
    for r in range(len(req_start) - 1):
        longest = max(longest, req_start[r + 1] - req_start[r])
    return np.zeros(1025, np.int64), np.zeros(1025, np.int64), np.empty(max(longest, 1), np.int64)


@numba.njit(cache=True, nogil=True)
def charge_as_prefix(levels, count, possum):  # pragma: no cover (compiled)
    """Add one request's hit levels to the histograms (grown as needed), charged as a prefix: the k-th
    cheapest hit is block k of the request's hit prefix (as native/kernels/curves.c charges them)."""
    th = np.sort(levels)
    nh = len(th)
    if th[nh - 1] >= len(count):
        count, possum = _grown(count, th[nh - 1]), _grown(possum, th[nh - 1])
    for k in range(nh):
        count[th[k]] += 1
        possum[th[k]] += k
    return count, possum


@numba.njit(cache=True, nogil=True)
def _stack_levels(obj, eligible, next_use, req_start, num_objects, never, measure_from):  # pragma: no cover
    # Levels are two sequential arrays (object, next use; object -1 = a hole); the inner loops touch
    # nothing else, so an object's level is found by scanning rather than kept up to date per move.
    size = 1024
    lvl_obj = np.full(size, -1, np.int64)
    lvl_key = np.zeros(size, np.int64)
    on_stack = np.zeros(num_objects, np.bool_)
    num_levels = 0
    count, possum, thr = level_buffers(req_start)
    for r in range(len(req_start) - 1):
        nh = 0
        for t in range(req_start[r], req_start[r + 1]):
            o = obj[t]
            if on_stack[o]:
                d = 0
                while lvl_obj[d] != o:
                    d += 1
                if eligible[t]:
                    thr[nh] = d + 1
                    nh += 1
                lvl_obj[d] = -1
                on_stack[o] = False
            ky = next_use[t]
            if ky == never:
                continue
            on_stack[o] = True
            y = o
            i = 0
            while True:
                if i == num_levels:
                    if i == size:
                        size *= 2
                        grown_obj = np.full(size, -1, np.int64)
                        grown_obj[:i] = lvl_obj
                        grown_key = np.zeros(size, np.int64)
                        grown_key[:i] = lvl_key
                        lvl_obj, lvl_key = grown_obj, grown_key
                    num_levels += 1
                    lvl_obj[i] = y
                    lvl_key[i] = ky
                    break
                z = lvl_obj[i]
                if z < 0:
                    lvl_obj[i] = y
                    lvl_key[i] = ky
                    break
                kz = lvl_key[i]
                if kz > ky:  # the nearer next use stays on this level
                    lvl_obj[i] = y
                    lvl_key[i] = ky
                    y = z
                    ky = kz
                i += 1
        while num_levels > 0 and lvl_obj[num_levels - 1] < 0:
            num_levels -= 1
        if r >= measure_from and nh > 0:
            count, possum = charge_as_prefix(thr[:nh], count, possum)
    return count, possum


def stack_belady_curve(stream: AccessStream, measure_from: int = 0) -> HitCurve:
    """`belady` at every capacity by carrying objects down the stack (the reference)."""
    count, possum = _stack_levels(stream.obj, stream.eligible, stream.next_use, stream.req_start,
                                  stream.num_objects, NEVER, int(measure_from))
    return HitCurve("belady", stream.block_size, count, possum, *_measured(stream, measure_from))
