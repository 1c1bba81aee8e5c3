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

import numpy as np

from kmesh_trace.native.kernels import I64, P
from kmesh_trace.oracle.kernel_ids import declare_widths, replay_at
from kmesh_trace.oracle.policies.base import StreamPolicy, reference_accesses
from kmesh_trace.oracle.stream import AccessStream, RequestBlocks

_kernel = declare_widths("ks_policies_belady", [I64, P], I64)


def belady_hits(stream: AccessStream, capacity: int) -> tuple[np.ndarray, int]:
    """Per-request hit blocks and the number of evictions (resident blocks displaced by a later one;
    native/kernels/policies_body.h)."""
    return replay_at(_kernel, stream, capacity, "belady")


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
    releases_gil = True
    kernel = staticmethod(belady_hits)
