"""Compiled helpers that flatten a workload into its `AccessStream` (oracle/stream.py) in linear passes.

Kept apart from oracle/stream.py so that the modules which only need `RequestBlocks` do not import
numba. One stable sort of the block hashes gives both the dense object ids (the rank of each hash among
the distinct ones, as `np.unique(..., return_inverse=True)` numbers them) and every access's next use
(accesses of one hash are adjacent in that order, in stream order), instead of one sort for each.
"""

from __future__ import annotations

import numba
import numpy as np


@numba.njit(cache=True, nogil=True)
def leading_flags(req_start, n_first):  # pragma: no cover (compiled)
    """One bool per access: it is among the first `n_first[r]` accesses of its request r."""
    out = np.zeros(req_start[-1], np.bool_)
    for r in range(len(req_start) - 1):
        a = req_start[r]
        out[a:a + min(n_first[r], req_start[r + 1] - a)] = True
    return out


@numba.njit(cache=True, nogil=True)
def dense_ids_and_next_uses(hashes, order, eligible, obj, next_use, never):  # pragma: no cover (compiled)
    """Fill `obj` (the rank of each access's hash among the distinct hashes) and `next_use` (the position
    of the next access of the same hash when that access is eligible, else `never`) from `order`, a
    stable argsort of `hashes`; returns the number of distinct hashes."""
    n = len(hashes)
    rank = -1
    for k in range(n):
        t = order[k]
        if k == 0 or hashes[t] != hashes[order[k - 1]]:
            rank += 1
        obj[t] = rank
        nxt = never
        if k + 1 < n:
            u = order[k + 1]
            if hashes[u] == hashes[t] and eligible[u]:
                nxt = u
        next_use[t] = nxt
    return rank + 1
