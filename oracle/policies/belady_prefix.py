"""`belady-prefix`: Belady's future knowledge applied only as a prefix cache can use it.

The cache is a prefix tree: a block is admitted only while its parent (the previous block of the
request's chain) is resident, and only leaves (blocks with no resident child) are evicted, so every
resident block's whole prefix is resident. A request's hits are a prefix lookup, as for `lru`: its
eligible prompt reads, in chain order, until the first one that is not resident. Afterwards its
blocks (prompt, then generated output) are visited in chain order: a resident block takes its new
next use; a missing one whose parent is resident is admitted into a free slot, or in place of the
leaf with the farthest next use (never the block's own parent) when its own next use is nearer;
otherwise it is not admitted (nor, then, are the rest of its chain). A block with no counted future
sorts after every block that has one (latest first), so it only takes a free slot, where it can
still carry descendants that have a future.

When every block hash names its whole prefix (token-id captures, chained hashes), a descendant's
next counted use is later than its ancestors', so `belady`'s farthest block is always a leaf and it
never keeps a block whose parent it declined: the two policies then agree, except where a block's
next access is a write (the prompt's last full block, a generated block), which `belady` drops and
this policy may keep as an ancestor. Hash lists whose blocks recur under other parents separate them.

A real prefix cache could follow this rule given the future, so its hits are reachable: together
with `belady` (which keeps any block, ignoring the prefix rule) it brackets the prefix-constrained
optimum.
"""

from __future__ import annotations

from typing import Sequence

import numba
import numpy as np

from kmesh_trace.oracle.interruptible import run_interruptible
from kmesh_trace.oracle.policies.base import StreamPolicy, reference_accesses
from kmesh_trace.oracle.policies.belady import _heap_push, _heap_remove, _sift_down, _sift_up
from kmesh_trace.oracle.policies.lru import prefix_hits
from kmesh_trace.oracle.stream import NEVER, AccessStream, RequestBlocks


@numba.njit(cache=True, nogil=True)
def _belady_prefix_kernel(obj, eligible, next_use, req_start, capacity, never, resident, nkey, parent_of, children,
                          where, key, who):  # pragma: no cover
    # Per object (arrays from `_kernel_arrays`): resident, effective next use of a resident block, parent,
    # resident children, and its slot in the max-heap (key, who) of resident leaves by effective next use (-1: none).
    n = len(obj)
    cap = max(capacity, 0)
    heap = 0
    size = 0
    evictions = 0
    n_req = len(req_start) - 1
    hits = np.zeros(n_req, np.int64)
    for r in range(n_req):
        a, b = req_start[r], req_start[r + 1]
        hits[r] = prefix_hits(obj, eligible, resident, a, b)
        if cap == 0:
            continue
        for t in range(a, b):
            o = obj[t]
            e = next_use[t]
            k = e if e != never else n + t  # no counted future: after every block that has one, latest first
            parent = obj[t - 1] if t > a else -1
            if resident[o]:
                nkey[o] = k
                if where[o] >= 0:
                    i = where[o]
                    key[i] = k
                    _sift_up(key, who, where, i)
                    _sift_down(key, who, where, where[o], heap)
                continue
            if parent >= 0 and not resident[parent]:
                continue
            if size == cap:
                victim = -1
                if heap > 0 and who[0] != parent:
                    victim = who[0]
                else:
                    for c in (1, 2):
                        if c < heap and (victim < 0 or key[c] > nkey[victim]):
                            victim = who[c]
                if victim < 0 or nkey[victim] <= k:
                    continue  # the incoming block's next use is the farthest: not admitted
                heap = _heap_remove(key, who, where, victim, heap)
                resident[victim] = False
                size -= 1
                evictions += 1
                vp = parent_of[victim]
                if vp >= 0:
                    children[vp] -= 1
                    if children[vp] == 0 and resident[vp]:
                        heap = _heap_push(key, who, where, vp, nkey[vp], heap)
            resident[o] = True
            nkey[o] = k
            parent_of[o] = parent
            children[o] = 0
            size += 1
            heap = _heap_push(key, who, where, o, k, heap)
            if parent >= 0:
                children[parent] += 1
                if children[parent] == 1 and where[parent] >= 0:
                    heap = _heap_remove(key, who, where, parent, heap)
    return hits, evictions


def _kernel_arrays(stream: AccessStream, capacity: int) -> tuple[np.ndarray, ...]:
    """The kernel's state, in the narrowest integers its values fit: keys are positions or n + t (< 2n), ids
    and heap slots stay below the objects; the heap holds at most min(capacity, objects) leaves."""
    m = stream.num_objects
    ids = np.int32 if m < 2**31 else np.int64
    keys = np.int32 if 2 * len(stream) < 2**31 else np.int64
    slots = max(min(int(capacity), m), 1)
    return (np.zeros(m, np.bool_), np.zeros(m, keys), np.full(m, -1, ids), np.zeros(m, ids), np.full(m, -1, ids),
            np.empty(slots, keys), np.empty(slots, ids))


def belady_prefix_hits(stream: AccessStream, capacity: int) -> tuple[np.ndarray, int]:
    """Per-request hit blocks and the number of evictions."""
    hits, evictions = run_interruptible(_belady_prefix_kernel, stream.obj, stream.eligible, stream.next_use,
                                        stream.req_start, int(capacity), NEVER, *_kernel_arrays(stream, capacity))
    return hits, int(evictions)


def belady_prefix_reference(requests: Sequence[RequestBlocks], block_size: int, capacity: int) -> tuple[list[int], int]:
    """The same policy, plainly: next uses by a backward scan, the farthest leaf by a linear search."""
    per_req = list(reference_accesses(requests, block_size))
    flat = [(h, e) for acc in per_req for h, e in acc]
    n = len(flat)
    nxt = [0] * n
    later: dict[int, tuple[int, bool]] = {}
    for t in range(n - 1, -1, -1):
        h, e = flat[t]
        pos, pos_elig = later.get(h, (-1, False))
        nxt[t] = pos if pos >= 0 and pos_elig else None
        later[h] = (t, e)
    resident: dict[int, int] = {}  # block -> effective next use
    parent_of: dict[int, int | None] = {}
    hits, evictions, t = [], 0, 0
    for acc in per_req:
        n_hit = 0
        for h, e in acc:
            if not e or h not in resident:
                break
            n_hit += 1
        hits.append(n_hit)
        parent = None
        for h, _ in acc:
            nu, t = nxt[t], t + 1
            k = nu if nu is not None else n + t - 1
            this_parent, parent = parent, h
            if capacity <= 0:
                continue
            if h in resident:
                resident[h] = k
                continue
            if this_parent is not None and this_parent not in resident:
                continue
            if len(resident) >= capacity:
                leaves = [b for b in resident if b != this_parent and not any(parent_of[c] == b for c in resident)]
                if not leaves:
                    continue
                victim = max(leaves, key=resident.__getitem__)
                if resident[victim] <= k:
                    continue
                del resident[victim]
                evictions += 1
            resident[h] = k
            parent_of[h] = this_parent
    return hits, evictions


class BeladyPrefix(StreamPolicy):
    name = "belady-prefix"
    summary = "Belady's future knowledge within a prefix cache: evicts only leaves, farthest next use first (reachable)"
    kernel = staticmethod(belady_prefix_hits)
