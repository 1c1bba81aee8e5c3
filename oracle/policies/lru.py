"""`lru`: a block-level LRU cache with the engine's prefix lookup.

A request's hits are counted against the cache as the request found it: its eligible prompt
reads, in chain order, hit until the first one that is not resident (a prefix cache cannot use
a block whose ancestor it must recompute). Afterwards every full block of the request (prompt and
output) is touched or inserted, tail first, so a request's first block ends most recently used:
the order in which vLLM's `free_blocks` returns a finished request's blocks to its free queue.
Inserting into a full cache evicts the least recently used block.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Sequence

import numba
import numpy as np

from kmesh_trace.oracle.interruptible import run_interruptible
from kmesh_trace.oracle.policies.base import StreamPolicy, reference_accesses
from kmesh_trace.oracle.stream import AccessStream, RequestBlocks


@numba.njit(cache=True, nogil=True, inline="always")
def prefix_hits(obj, eligible, resident, a, b):  # pragma: no cover (compiled)
    """A prefix lookup: the request's leading eligible reads [a, b) that are resident."""
    h = 0
    for t in range(a, b):
        if not eligible[t] or not resident[obj[t]]:
            break
        h += 1
    return h


@numba.njit(cache=True, nogil=True)
def _lru_kernel(obj, eligible, req_start, num_objects, capacity):  # pragma: no cover (compiled)
    # Doubly linked recency list over object ids; node `num_objects` is the sentinel
    # (sentinel.next = most recent, sentinel.prev = least recent).
    s = num_objects
    prev = np.empty(num_objects + 1, np.int64)
    nxt = np.empty(num_objects + 1, np.int64)
    resident = np.zeros(num_objects, np.bool_)
    prev[s] = s
    nxt[s] = s
    size = 0
    evictions = 0
    n_req = len(req_start) - 1
    hits = np.zeros(n_req, np.int64)
    for r in range(n_req):
        a, b = req_start[r], req_start[r + 1]
        hits[r] = prefix_hits(obj, eligible, resident, a, b)
        if capacity <= 0:
            continue
        for t in range(b - 1, a - 1, -1):
            o = obj[t]
            if resident[o]:
                nxt[prev[o]] = nxt[o]
                prev[nxt[o]] = prev[o]
            else:
                if size == capacity:
                    victim = prev[s]
                    nxt[prev[victim]] = s
                    prev[s] = prev[victim]
                    resident[victim] = False
                    evictions += 1
                else:
                    size += 1
                resident[o] = True
            first = nxt[s]
            nxt[o] = first
            prev[o] = s
            prev[first] = o
            nxt[s] = o
    return hits, evictions


def lru_hits(stream: AccessStream, capacity: int) -> tuple[np.ndarray, int]:
    """Per-request hit blocks and the number of evictions."""
    hits, evictions = run_interruptible(_lru_kernel, stream.obj, stream.eligible, stream.req_start, stream.num_objects, int(capacity))
    return hits, int(evictions)


def lru_reference(requests: Sequence[RequestBlocks], block_size: int, capacity: int) -> tuple[list[int], int]:
    cache: OrderedDict[int, None] = OrderedDict()  # last = most recently used
    hits, evictions = [], 0
    for accesses in reference_accesses(requests, block_size):
        h = 0
        for block, elig in accesses:
            if not elig or block not in cache:
                break
            h += 1
        hits.append(h)
        if capacity <= 0:
            continue
        for block, _ in reversed(accesses):
            if block in cache:
                cache.move_to_end(block)
                continue
            if len(cache) == capacity:
                cache.popitem(last=False)
                evictions += 1
            cache[block] = None
    return hits, evictions


class LRU(StreamPolicy):
    name = "lru"
    summary = "block-level LRU; a request's hits stop at its first miss (prefix lookup)"
    kernel = staticmethod(lru_hits)
