"""`infinite`: every block ever written stays cached. A prompt read hits when its block was seen
before (written by an earlier access), whatever the capacity: the ceiling of any cache."""

from __future__ import annotations

from typing import Sequence

import numpy as np

from kmesh_trace.oracle.policies.base import StreamPolicy, reference_accesses
from kmesh_trace.oracle.stream import AccessStream, RequestBlocks


def infinite_hits(stream: AccessStream) -> np.ndarray:
    """Per-request hit blocks: eligible reads that are not their object's first access."""
    seen_before = np.ones(len(stream), bool)
    _, first = np.unique(stream.obj, return_index=True)
    seen_before[first] = False
    c = np.zeros(len(stream) + 1, np.int64)
    np.cumsum(seen_before & stream.eligible, out=c[1:])
    return c[stream.req_start[1:]] - c[stream.req_start[:-1]]


def infinite_reference(requests: Sequence[RequestBlocks], block_size: int) -> list[int]:
    seen: set[int] = set()
    hits = []
    for accesses in reference_accesses(requests, block_size):
        hits.append(sum(1 for h, elig in accesses if elig and h in seen))
        seen.update(h for h, _ in accesses)
    return hits


class Infinite(StreamPolicy):
    name = "infinite"
    summary = "every block ever written stays; a read hits if its block was written before"
    needs_capacity = False

    @staticmethod
    def kernel(stream: AccessStream, capacity: int | None) -> tuple[np.ndarray, None]:
        return infinite_hits(stream), None
