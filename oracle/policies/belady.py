"""`belady`: the headroom bound of docs/DESIGN.md, optimal offline caching over the access stream.

Any full block may be kept independently of its ancestors, a block need not be admitted, running
requests pin nothing, generated full blocks are admitted as writes, and the final prompt fragment
(at least the last prompt token) is never a hit. Every eligible prompt read whose block is
resident is a hit. With unit-size blocks and optional admission, evicting the block whose next
counted use is farthest (the incoming block included, which is then not admitted) maximises the
hits (Belady's MIN; equivalently, greedy selection of reuse intervals by earliest end, at most
`capacity` overlapping). A block whose next access is a write has no counted next use: it is
recomputed there for free. Next uses are precomputed in the AccessStream, so nothing scans ahead.
"""

from __future__ import annotations

import heapq
from typing import Sequence

import numba
import numpy as np

from kmesh_trace.oracle.interruptible import run_interruptible
from kmesh_trace.oracle.policies.base import StreamPolicy, reference_accesses
from kmesh_trace.oracle.stream import NEVER, AccessStream, RequestBlocks


@numba.njit(cache=True, nogil=True, inline="always")
def _sift_up(key, who, where, i):  # pragma: no cover (compiled)
    k, o = key[i], who[i]
    while i > 0:
        p = (i - 1) >> 1
        if key[p] >= k:
            break
        key[i] = key[p]
        who[i] = who[p]
        where[who[i]] = i
        i = p
    key[i] = k
    who[i] = o
    where[o] = i


@numba.njit(cache=True, nogil=True, inline="always")
def _sift_down(key, who, where, i, size):  # pragma: no cover (compiled)
    k, o = key[i], who[i]
    while True:
        c = 2 * i + 1
        if c >= size:
            break
        if c + 1 < size and key[c + 1] > key[c]:
            c += 1
        if key[c] <= k:
            break
        key[i] = key[c]
        who[i] = who[c]
        where[who[i]] = i
        i = c
    key[i] = k
    who[i] = o
    where[o] = i


@numba.njit(cache=True, nogil=True, inline="always")
def _heap_remove(key, who, where, o, size):  # pragma: no cover (compiled); returns the new size
    i = where[o]
    where[o] = -1
    size -= 1
    if i < size:
        m = who[size]
        key[i] = key[size]
        who[i] = m
        where[m] = i
        _sift_up(key, who, where, i)
        _sift_down(key, who, where, where[m], size)
    return size


@numba.njit(cache=True, nogil=True, inline="always")
def _heap_push(key, who, where, o, k, size):  # pragma: no cover (compiled); returns the new size
    key[size] = k
    who[size] = o
    where[o] = size
    _sift_up(key, who, where, size)
    return size + 1


@numba.njit(cache=True, nogil=True)
def _belady_kernel(obj, eligible, next_use, req_start, num_objects, capacity, never):  # pragma: no cover
    # Max-heap of resident blocks keyed by next counted use; where[o] = heap slot or -1.
    cap = max(capacity, 0)
    key = np.empty(max(cap, 1), np.int64)
    who = np.empty(max(cap, 1), np.int64)
    where = np.full(num_objects, -1, np.int64)
    size = 0
    evictions = 0
    n_req = len(req_start) - 1
    hits = np.zeros(n_req, np.int64)
    for r in range(n_req):
        h = 0
        for t in range(req_start[r], req_start[r + 1]):
            o = obj[t]
            nu = next_use[t]
            i = where[o]
            if i >= 0:
                if eligible[t]:
                    h += 1
                if nu == never:  # no counted future: drop it now, freeing its slot
                    size = _heap_remove(key, who, where, o, size)
                else:
                    key[i] = nu
                    _sift_up(key, who, where, i)
            elif nu != never and cap > 0:
                if size < cap:
                    key[size] = nu
                    who[size] = o
                    size += 1
                    _sift_up(key, who, where, size - 1)
                elif key[0] > nu:
                    where[who[0]] = -1
                    evictions += 1
                    key[0] = nu
                    who[0] = o
                    _sift_down(key, who, where, 0, size)
        hits[r] = h
    return hits, evictions


def belady_hits(stream: AccessStream, capacity: int) -> tuple[np.ndarray, int]:
    """Per-request hit blocks and the number of evictions (resident blocks displaced by a later one)."""
    hits, evictions = run_interruptible(_belady_kernel, stream.obj, stream.eligible, stream.next_use, stream.req_start,
                                     stream.num_objects, int(capacity), NEVER)
    return hits, int(evictions)


def belady_reference(requests: Sequence[RequestBlocks], block_size: int, capacity: int) -> list[int]:
    """The same bound, plainly: next uses found by a backward scan, a lazy-deletion heap."""
    per_req = list(reference_accesses(requests, block_size))
    flat = [(h, e) for acc in per_req for h, e in acc]
    nxt: list[float] = [0.0] * len(flat)
    later: dict[int, tuple[int, bool]] = {}
    for t in range(len(flat) - 1, -1, -1):
        h, e = flat[t]
        pos, pos_elig = later.get(h, (-1, False))
        nxt[t] = pos if pos >= 0 and pos_elig else float("inf")
        later[h] = (t, e)
    resident: dict[int, float] = {}  # block -> its next counted use
    heap: list[tuple[float, int]] = []  # (-next use, block), stale entries skipped
    hits, t = [], 0
    for acc in per_req:
        n = 0
        for h, e in acc:
            nu = nxt[t]
            t += 1
            if h in resident:
                n += e
                del resident[h]
            if nu == float("inf") or capacity <= 0:
                continue
            if len(resident) >= capacity:
                while heap and resident.get(heap[0][1]) != -heap[0][0]:
                    heapq.heappop(heap)
                if -heap[0][0] <= nu:
                    continue  # the incoming block is the farthest: do not admit it
                del resident[heapq.heappop(heap)[1]]
            resident[h] = nu
            heapq.heappush(heap, (-nu, h))
        hits.append(n)
    return hits


class Belady(StreamPolicy):
    name = "belady"
    summary = "optimal eviction knowing the future; keeps any full block, ignores pins (the headroom bound)"
    kernel = staticmethod(belady_hits)
