"""`lru`: a block-level LRU cache with the engine's prefix lookup.

A request's hits are counted against the cache as the request found it: its eligible prompt
reads, in chain order, hit until the first one that is not resident (a prefix cache cannot use
a block whose ancestor it must recompute). Afterwards every full block of the request (prompt and
output) is touched or inserted, tail first, so a request's first block ends most recently used:
the order in which vLLM's `free_blocks` returns a finished request's blocks to its free queue.
Inserting into a full cache evicts the least recently used block.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from kmesh_trace.native.kernels import I64, P
from kmesh_trace.oracle.lru_store import LruStore
from kmesh_trace.oracle.kernel_ids import declare_widths, replay_at
from kmesh_trace.oracle.policies.base import StreamPolicy, reference_accesses
from kmesh_trace.oracle.stream import AccessStream, RequestBlocks

_kernel = declare_widths("ks_policies_lru", [I64, P], I64)


def lru_hits(stream: AccessStream, capacity: int) -> tuple[np.ndarray, int]:
    """Per-request hit blocks and the number of evictions (native/kernels/policies_body.h)."""
    return replay_at(_kernel, stream, capacity, "lru")


def lru_reference(requests: Sequence[RequestBlocks], block_size: int, capacity: int) -> tuple[list[int], int]:
    cache = LruStore()
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
        left, _ = cache.put([block for block, _ in reversed(accesses)], capacity)
        evictions += len(left)
    return hits, evictions


class LRU(StreamPolicy):
    name = "lru"
    summary = "block-level LRU; a request's hits stop at its first miss (prefix lookup)"
    releases_gil = True
    kernel = staticmethod(lru_hits)
