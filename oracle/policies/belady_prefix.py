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

import numpy as np

from kmesh_trace.native.kernels import I64, P
from kmesh_trace.oracle.kernel_ids import declare_widths, replay_at
from kmesh_trace.oracle.policies.base import StreamPolicy, reference_accesses
from kmesh_trace.oracle.stream import AccessStream, RequestBlocks

_kernel = declare_widths("ks_policies_belady_prefix", [I64, P], I64)


def belady_prefix_hits(stream: AccessStream, capacity: int) -> tuple[np.ndarray, int]:
    """Per-request hit blocks and the number of evictions (native/kernels/policies_body.h)."""
    return replay_at(_kernel, stream, capacity, "belady-prefix")


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
    releases_gil = True
    kernel = staticmethod(belady_prefix_hits)
