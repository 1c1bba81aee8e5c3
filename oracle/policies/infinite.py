"""`infinite`: every block ever written stays cached. A prompt read hits when its block was seen
before (written by an earlier access), whatever the capacity: the ceiling of any cache."""

from __future__ import annotations

from typing import Sequence

import numpy as np

from kmesh_trace.oracle.policies.base import StreamPolicy, reference_accesses
from kmesh_trace.oracle.stream import AccessStream, RequestBlocks
from kmesh_trace.oracle.stream_index import infinite_hits as hits


def infinite_hits(stream: AccessStream) -> np.ndarray:
    """Per-request hit blocks: eligible reads that are not their object's first access (one C pass,
    oracle/stream_index.py; tests compare it with numpy's and with `infinite_reference`)."""
    return hits(stream)


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
